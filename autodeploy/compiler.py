"""``autodeploy.compile``: checkpoint directory -> ``CompiledModel``.

build on meta -> torch.export -> passes (in stage order) -> CompiledModel. Each step is timed; the
report lists every pass with its matches and milliseconds.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Any

import torch
from transformers import PretrainedConfig

from . import ops  # noqa: F401  (registers the canonical ops)
from .compiled import CompiledModel, CompileReport, canonical_op_counts
from .config import CompileConfig, validate
from .errors import ConfigError
from .export import export_model
from .hf_experts import experts_module_paths
from .model_loading import Checkpoint, build_meta_model, open_checkpoint, resolve_dtype, resolve_model_path
from .pipeline import CompileContext, load_pipeline, run_pipeline

log = logging.getLogger("autodeploy")

DEFAULT_MAX_SEQ_LEN = 4096


def compile(model_dir: str | Path, **options: Any) -> CompiledModel:  # noqa: A001 (public API name)
    """Compile the HF causal LM in ``model_dir`` (config.json + safetensors, or a ``.gguf`` file,
    converted once into a cached checkpoint, or a Hugging Face Hub id) for inference.

    ``options`` are the fields of :class:`autodeploy.config.CompileConfig`.
    """
    config = validate(CompileConfig, options, "compile options")
    checkpoint = open_checkpoint(
        resolve_model_path(model_dir, config.revision, config.allow_pickle),
        allow_pickle=config.allow_pickle,
        trust_remote_code=config.trust_remote_code,
        require_weights=config.weights == "checkpoint",
    )
    return compile_config(checkpoint.config, config, checkpoint)


def compile_config(
    hf_config: PretrainedConfig, config: CompileConfig, checkpoint: Checkpoint | None = None
) -> CompiledModel:
    """Compile from an HF config; weights from ``checkpoint`` or random (``config.weights``)."""
    if checkpoint is None and config.weights != "random":
        raise ConfigError("compiling from a config alone needs weights='random'")
    timings: dict[str, float] = {}
    device = _tensor_parallel_device(config) or resolve_device(config.device)
    dtype = resolve_dtype(hf_config, config.dtype)

    start = time.perf_counter()
    model, buffers = build_meta_model(hf_config, dtype, config.attn_implementation, config.trust_remote_code)
    timings["build"] = time.perf_counter() - start

    workers = _start_compile_workers(config, device)  # their imports overlap the export
    max_seq_len = config.max_seq_len or model_max_len(hf_config)
    try:
        if workers is not None and config.early_compiles and _early_compiles_apply(config, device):
            start = time.perf_counter()
            _start_early_compiles(hf_config, config, device, dtype, max_seq_len, workers, checkpoint)
            timings["early_compiles"] = time.perf_counter() - start
        start = time.perf_counter()
        gm = export_model(model)
        timings["export"] = time.perf_counter() - start
        gm.meta.update(autodeploy_size_hints=size_hints(hf_config), autodeploy_max_seq_len=max_seq_len,
                       autodeploy_buffer_values=buffers)  # what mask and position-bias checks read
        gm.meta["autodeploy_experts_modules"] = experts_module_paths(model)  # canonicalize_moe checks each
        del model

        ctx = CompileContext(
            gm=gm, hf_config=hf_config, config=config, device=device, dtype=dtype,
            checkpoint=checkpoint, buffers=buffers, dump_dir=_dump_dir(config),
        )
        ctx.artifacts["max_seq_len"] = max_seq_len
        ctx.artifacts["exported_parameters"] = {n: (tuple(p.shape), p.dtype) for n, p in gm.named_parameters()}
        ctx.artifacts["compile_workers"] = workers
        start = time.perf_counter()
        records = run_pipeline(ctx, load_pipeline(config.pipeline, config.passes))
        timings["passes"] = time.perf_counter() - start
        ctx.gm.meta.pop("autodeploy_buffer_values", None)  # the model's buffers are loaded: keep no second copy
    finally:
        if workers is not None:
            workers.close()

    report = CompileReport(
        model_type=hf_config.model_type,
        architecture=(hf_config.architectures or [type(hf_config).__name__])[0],
        dtype=dtype,
        device=device,
        stage_seconds=timings,
        passes=records,
        op_counts=canonical_op_counts(ctx.gm),
        quantization=tuple(summary.lines()) if (summary := ctx.artifacts.get("quantization")) else (),
        kv_cache=ctx.artifacts.get("kv_cache_words", ""),
    )
    model_dir = checkpoint.path if checkpoint else None
    return CompiledModel(
        ctx.gm, ctx.artifacts["kv_pool"], ctx.artifacts["kv_capacity"], hf_config, config, report, model_dir,
        cuda_graphs=ctx.artifacts.get("cuda_graphs"), piecewise=ctx.artifacts.get("piecewise_graphs"),
        mixed_graphs=ctx.artifacts.get("mixed_graphs"),
    )


def _early_compiles_apply(config: CompileConfig, device: torch.device) -> bool:
    """Whether the Triton backend runs the attention and the warm-up compiles its variants."""
    from .ops.attention_backends import resolve_attention_backend

    warm_up = config.passes.get("warm_up", {})
    return (resolve_attention_backend(config.attention_backend, device).name == "triton"
            and warm_up.get("enabled", True) is not False and warm_up.get("attention_variants", True) is not False)


def _start_early_compiles(hf_config, config: CompileConfig, device, dtype, max_seq_len: int, workers,
                          checkpoint) -> None:
    """The attention kernels guessed from the config, to the workers (``early_compile.py``)."""
    from .early_compile import start_early_attention_compiles
    from .quantization.kv_cache import kv_cache_format

    try:
        kv = kv_cache_format(config.kv_cache_dtype, checkpoint.path if checkpoint else None, dtype)
        start_early_attention_compiles(hf_config, config, device, dtype, max_seq_len, workers, kv.dtype)
    except Exception as exc:  # noqa: BLE001 (a guess: the warm-up compiles what it needs either way)
        log.warning("early attention compiles skipped (%s: %s)", type(exc).__name__, exc)


def _start_compile_workers(config: CompileConfig, device: torch.device):
    if config.compile_workers == 0 or (config.compile_workers is None and device.type != "cuda"):
        return None  # by default only where Triton compiles for a GPU
    from .kernels.compile_workers import start_compile_workers  # triton only where asked for

    return start_compile_workers(config.compile_workers, device)


def _tensor_parallel_device(config: CompileConfig) -> torch.device | None:
    """With ``tp_size`` > 1: join the job (started by ``autodeploy serve`` or torchrun) and use this
    rank's device."""
    if config.tp_size == 1:
        return None
    from .distributed import init_tensor_parallel

    return init_tensor_parallel(config.tp_size, device=config.device).device


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    resolved = torch.device(device)
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device '{device}' requested but CUDA is not available")
    return resolved


def model_max_len(hf_config: PretrainedConfig) -> int:
    for key in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length", "max_seq_len"):
        value = getattr(hf_config, key, None)
        if isinstance(value, int) and value > 0:
            return value
    return DEFAULT_MAX_SEQ_LEN


def size_hints(hf_config: PretrainedConfig) -> tuple[int, ...]:
    """Sliding-window and chunk sizes the config mentions: the mask checks evaluate masks across them
    (``graph/mask.py``; they never trust them)."""
    hints = set()
    for key, value in hf_config.to_dict().items():
        if ("window" in key or "chunk" in key) and isinstance(value, int) and not isinstance(value, bool) and value > 0:
            hints.add(value)
    return tuple(sorted(hints))


def _dump_dir(config: CompileConfig) -> Path | None:
    directory = config.dump_dir or os.environ.get("AUTODEPLOY_DUMP_DIR")
    return Path(directory) if directory else None
