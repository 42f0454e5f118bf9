"""User-facing configuration (pydantic, unknown keys are errors).

Precedence where several sources meet (CLI): defaults < ``--config`` YAML < dedicated flags <
``--set key=value``; see :func:`merge_settings`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from .errors import ConfigError


class CompileConfig(BaseModel):
    """Options of :func:`autodeploy.compile`."""

    model_config = ConfigDict(extra="forbid")

    dtype: str = Field("auto", description="auto (checkpoint dtype), bfloat16, float16 (half) or float32 (float), as vLLM names them too")
    device: str = Field("auto", description="auto (cuda if available, else cpu), cpu, cuda, cuda:N")
    attn_implementation: Literal["eager", "sdpa"] = Field(
        "eager", description="HF attention code traced by export; both are canonicalized"
    )
    weights: Literal["checkpoint", "random"] = Field(
        "checkpoint", description="random: skip the checkpoint, fill weights randomly on the device (benchmarks)"
    )
    max_seq_len: int | None = Field(None, ge=1, description="longest prompt + output; default: the model's limit")
    max_batch_size: int = Field(64, ge=1, description="most sequences in one step")
    max_num_tokens: int = Field(8192, ge=1, description="most tokens in one step (token budget)")
    tokens_per_block: int = Field(16, ge=1, description="KV-cache page size in tokens")
    kv_cache_free_gpu_memory_fraction: float = Field(
        0.9, gt=0, le=1, description="share of free GPU memory (after weights) used for the KV cache"
    )
    gpu_memory_utilization: float | None = Field(
        None, gt=0, le=1, description="vLLM's meaning: share of the GPU's TOTAL memory this process may use in all "
        "(weights, activations, KV cache); the KV cache gets what is left of it (replaces "
        "kv_cache_free_gpu_memory_fraction, a share of the memory still free after the weights)"
    )
    num_kv_blocks: int | None = Field(None, ge=1, description="fix the KV-cache size instead of measuring memory")
    tp_size: int = Field(1, ge=1, description="tensor-parallel size: ranks (processes, one GPU each) sharing the model")
    compile_workers: int | None = Field(
        None, ge=0, description="processes compiling start-up's Triton kernels into the disk cache, started "
        "before export (default on CUDA: cores - 1, at most 16; 0: the warm-up's threads alone)"
    )
    early_compiles: bool = Field(
        True, description="compile workers start on the attention kernels guessed from the HF config while "
        "torch.export runs (the warm-up then finds them compiled)"
    )
    kv_cache_cpu_bytes: int = Field(1 << 30, ge=1, description="KV-cache budget when running on the CPU")
    attention_backend: str = Field(
        "auto", description="paged attention: auto (triton on CUDA, torch on CPU), torch, triton, flashinfer"
    )
    kv_cache_dtype: Literal["auto", "fp8", "fp8_e4m3", "bfloat16", "float16", "float32"] = Field(
        "auto", description="KV cache dtype: auto (FP8 where the checkpoint quantizes its KV cache, else the model "
        "dtype), fp8 / fp8_e4m3 (float8_e4m3fn with the checkpoint's per-tensor k/v scales, or 1.0), or a float dtype"
    )
    quantization: Literal["fp8", "nvfp4", "modelopt", "modelopt_fp4", "compressed-tensors"] | None = Field(
        None, description="quantize a bf16/fp16 checkpoint while loading: fp8 (per-channel weights, dynamic "
        "per-token activations) or nvfp4 (weight-only); a quantized checkpoint needs no flag (vLLM's names of "
        "its format, modelopt, modelopt_fp4, compressed-tensors, fp8, are accepted as a confirmation)"
    )
    enforce_eager: bool = Field(False, description="no CUDA graphs: every step runs eagerly (as vLLM's --enforce-eager)")
    revision: str | None = Field(None, description="branch, tag or commit of a Hugging Face Hub model id "
                                 "(default: main); ignored for a local path")
    allow_pickle: bool = Field(False, description="accept pickle (.bin) weights; only for trusted checkpoints")
    trust_remote_code: bool = Field(False, description="run modeling code shipped with the checkpoint")
    dump_dir: str | None = Field(None, description="write every intermediate graph here (or AUTODEPLOY_DUMP_DIR)")
    pipeline: str | None = Field(None, description="YAML file replacing the default pass pipeline")
    passes: dict[str, dict[str, Any]] = Field(
        default_factory=dict, description="per-pass config overrides, e.g. {fuse_qkv: {enabled: false}}"
    )

    @model_validator(mode="after")
    def _one_memory_share(self) -> CompileConfig:
        if self.gpu_memory_utilization is not None and "kv_cache_free_gpu_memory_fraction" in self.model_fields_set:
            raise ValueError("set gpu_memory_utilization (a share of the GPU's total memory) or "
                             "kv_cache_free_gpu_memory_fraction (a share of the free memory), not both")
        return self


def load_yaml(path: str | Path) -> dict[str, Any]:
    try:
        data = yaml.safe_load(Path(path).read_text()) or {}
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError(f"cannot read config file {path}: {exc}") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must hold a mapping, not {type(data).__name__}")
    return data


def parse_set_option(item: str) -> tuple[str, Any]:
    """``key=value`` with a YAML-typed value; dotted keys address nested settings."""
    key, sep, raw = item.partition("=")
    if not sep or not key:
        raise ConfigError(f"--set expects key=value, got '{item}'")
    try:
        return key.strip(), yaml.safe_load(raw)
    except yaml.YAMLError as exc:
        raise ConfigError(f"--set {item}: cannot parse value: {exc}") from exc


def set_dotted(target: dict[str, Any], key: str, value: Any) -> None:
    *parents, leaf = key.split(".")
    for part in parents:
        target = target.setdefault(part, {})
        if not isinstance(target, dict):
            raise ConfigError(f"--set {key}: '{part}' is not a mapping")
    target[leaf] = value


def merge_settings(*layers: dict[str, Any]) -> dict[str, Any]:
    """Merge setting layers, later ones winning, mappings merged key by key."""
    merged: dict[str, Any] = {}
    for layer in layers:
        _deep_update(merged, layer)
    return merged


def _deep_update(base: dict[str, Any], update: dict[str, Any]) -> None:
    for key, value in update.items():
        if isinstance(value, dict) and isinstance(base.get(key), dict):
            _deep_update(base[key], value)
        else:
            base[key] = value


def validate(model: type[BaseModel], data: dict[str, Any], what: str) -> BaseModel:
    try:
        return model(**data)
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(map(str, e['loc'])) or '<root>'}: {e['msg']}" for e in exc.errors())
        raise ConfigError(f"invalid {what}: {problems}") from None
