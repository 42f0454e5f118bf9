"""Checkpoint discovery, building the HF model on the meta device, and weight sources.

The model is built without memory (meta device); only its non-persistent buffers (RoPE inverse
frequencies, embedding scales...) are computed for real, with the model's own ``_init_weights``, the
way ``from_pretrained`` does. Weights arrive later, tensor by tensor, from a :class:`WeightSource`.
"""

from __future__ import annotations

import json
import logging
import zlib
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig

from . import hf_experts
from .errors import ModelLoadError

log = logging.getLogger("autodeploy.loading")

SAFETENSORS_SUFFIX = ".safetensors"
PICKLE_SUFFIXES = (".bin", ".pt", ".pth")


@dataclass(frozen=True)
class Checkpoint:
    """A local HF checkpoint directory: its config and weight files."""

    path: Path
    config: PretrainedConfig
    weight_files: tuple[Path, ...]
    trust_remote_code: bool = False

    @property
    def is_safetensors(self) -> bool:
        return all(f.suffix == SAFETENSORS_SUFFIX for f in self.weight_files)


def resolve_model_path(path: str | Path, revision: str | None = None, allow_pickle: bool = False) -> Path:
    """The checkpoint directory ``path`` stands for: a checkpoint directory as it is; a ``.gguf``
    file, or a directory holding exactly one (and no config.json), converted once into a cached HF
    checkpoint (see ``autodeploy.gguf_convert``); a Hugging Face Hub id that is not a local path, its
    snapshot at ``revision`` from the local cache or downloaded (see ``autodeploy.hub``)."""
    from .gguf_convert import converted_checkpoint, find_gguf_file
    from .hub import looks_like_hub_id, resolve_hub_model

    local = Path(path).expanduser()
    if not local.exists() and looks_like_hub_id(str(path)):
        local = resolve_hub_model(str(path), revision, allow_pickle)
    gguf_file = find_gguf_file(local)
    return converted_checkpoint(gguf_file) if gguf_file is not None else local


def open_checkpoint(
    model_dir: str | Path, *, allow_pickle: bool = False, trust_remote_code: bool = False, require_weights: bool = True
) -> Checkpoint:
    path = Path(model_dir).expanduser()
    if not (path / "config.json").is_file():
        raise ModelLoadError(f"{path} is not a checkpoint directory: config.json not found")
    try:
        config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    except ValueError as exc:  # unknown model_type, or remote code refused
        if "trust_remote_code" in str(exc):
            raise ModelLoadError(
                f"{path} needs its own Python code to load (config.json points to custom code), and running it "
                "can do anything. Pass --trust_remote_code (trust_remote_code=True in Python) only if you trust "
                "the source."
            ) from exc
        raise ModelLoadError(f"cannot read {path / 'config.json'}: {exc}") from exc
    files = _weight_files(path, allow_pickle)
    if require_weights and not files:
        raise ModelLoadError(f"no *.safetensors weights in {path}")
    if require_weights:
        _check_safetensors_headers(files)
    return Checkpoint(path, config, tuple(files), trust_remote_code)


def _check_safetensors_headers(files: list[Path]) -> None:
    """Read each safetensors header now (it is small), so a truncated or corrupt file is reported at
    once, not after the export and the passes have run."""
    from safetensors import SafetensorError, safe_open

    for file in files:
        if file.suffix != SAFETENSORS_SUFFIX:
            continue
        try:
            with safe_open(str(file), framework="pt") as handle:
                handle.keys()
        except (SafetensorError, OSError) as exc:
            raise ModelLoadError(f"{file} is not a valid safetensors file ({exc}); download or convert it again") from exc


def _weight_files(path: Path, allow_pickle: bool) -> list[Path]:
    safetensors = sorted(path.glob(f"*{SAFETENSORS_SUFFIX}"))
    if safetensors:
        return safetensors
    pickled = sorted(p for p in path.iterdir() if p.suffix in PICKLE_SUFFIXES and "training_args" not in p.name)
    if pickled and not allow_pickle:
        raise ModelLoadError(
            f"{path} holds only pickle weights ({pickled[0].name}); loading pickle can run arbitrary code. "
            "Convert them to safetensors, or pass --allow_pickle (allow_pickle=True in Python) if you trust the "
            "source."
        )
    return pickled


def resolve_dtype(config: PretrainedConfig, dtype: str | torch.dtype | None) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype in (None, "auto"):
        value = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None) or torch.float32
        return getattr(torch, value) if isinstance(value, str) else value
    # torch's names and the short ones; "half" and "float" as vLLM's --dtype takes them
    resolved = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}.get(dtype) or getattr(
        torch, str(dtype), None)
    if resolved not in (torch.float32, torch.float16, torch.bfloat16):
        raise ModelLoadError(f"unknown dtype '{dtype}'; known: auto, bfloat16 (bf16), float16 (half, fp16), "
                             "float32 (float, fp32)")
    return resolved


def build_meta_model(
    config: PretrainedConfig, dtype: torch.dtype, attn_implementation: str, trust_remote_code: bool = False
) -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    """The HF causal LM on the meta device, plus real CPU values of its non-persistent buffers."""
    kwargs = {"dtype": dtype, "attn_implementation": attn_implementation, "trust_remote_code": trust_remote_code}
    if _has_experts_interface(config):
        hf_experts.register()
        kwargs["experts_implementation"] = hf_experts.IMPLEMENTATION  # MoE experts export as autodeploy::moe
    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, **kwargs)
    except ValueError as exc:
        raise ModelLoadError(f"transformers cannot build {config.model_type} as a causal LM: {exc}") from exc
    model.eval().requires_grad_(False)
    hf_experts.plan_experts(model)
    return model, _materialize_non_persistent_buffers(model)


def _has_experts_interface(config: PretrainedConfig) -> bool:
    return hasattr(config, "_experts_implementation")


def _materialize_non_persistent_buffers(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    values: dict[str, torch.Tensor] = {}
    for module_name, module in model.named_modules():
        names = [n for n in getattr(module, "_non_persistent_buffers_set", ()) if module._buffers.get(n) is not None]
        if not names:
            continue
        module.to_empty(device="cpu", recurse=False)
        _init_buffers(model, module_name, module, names)
        for name in names:
            values[f"{module_name}.{name}" if module_name else name] = module._buffers[name].clone()
        for key in list(module._parameters):
            if module._parameters[key] is not None:
                module._parameters[key] = torch.nn.Parameter(module._parameters[key].to("meta"), requires_grad=False)
        for key in list(module._buffers):
            if module._buffers[key] is not None:
                module._buffers[key] = module._buffers[key].to("meta")
    return values


def _init_buffers(model: torch.nn.Module, module_name: str, module: torch.nn.Module, names: list[str]) -> None:
    """Fill ``module``'s non-persistent buffers as HF's ``_init_weights`` does: the module's own call
    first, then its ancestors' (FalconH1's model writes every mixer's ``mup_vector``), nearest first.
    Float buffers start as NaN so that one no call writes is an error, not uninitialized memory."""
    floats = [n for n in names if module._buffers[n].is_floating_point()]
    for name in floats:
        module._buffers[name].fill_(float("nan"))
    parts = module_name.split(".") if module_name else []
    owners = [module] + [model.get_submodule(".".join(parts[:i])) for i in range(len(parts) - 1, -1, -1)]
    with torch.no_grad():
        for owner in owners:
            model._init_weights(owner)
            if not any(module._buffers[n].isnan().any() for n in floats):
                return
    missing = [f"{module_name}.{n}" for n in floats if module._buffers[n].isnan().any()]
    raise ModelLoadError(f"no _init_weights of {type(model).__name__} fills the non-persistent buffers {missing}; "
                         "their values are not in the checkpoint, so the model cannot be built")


class WeightSource(ABC):
    """Yields ``(name, tensor)`` in the model's parameter naming, one tensor at a time."""

    @abstractmethod
    def names(self) -> set[str]:
        """Every tensor name this source yields."""

    @abstractmethod
    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The tensors, one at a time."""


Slices = dict[str, Callable[[Any], torch.Tensor]]  # name -> the part to load, from a lazy slice or a tensor


class SafetensorsSource(WeightSource):
    """Streams tensors straight from ``*.safetensors`` files (names as stored); a tensor named in
    ``slices`` is read through a lazy slice, so only the part it asks for leaves the file; with
    ``only``, the other tensors are not read at all."""

    def __init__(self, files: tuple[Path, ...], slices: Slices | None = None, only: set[str] | None = None):
        from safetensors import safe_open

        self._open = safe_open
        self.files = files
        self.slices = slices or {}
        self.only = only

    def names(self) -> set[str]:
        out: set[str] = set()
        for f in self.files:
            with self._open(str(f), framework="pt") as handle:
                out.update(handle.keys())
        return out

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        for f in self.files:
            with self._open(str(f), framework="pt") as handle:
                for key in handle.keys():
                    if self.only is not None and key not in self.only:
                        continue
                    if key in self.slices:
                        yield key, self.slices[key](handle.get_slice(key))
                    else:
                        yield key, handle.get_tensor(key)


class TransformersSource(WeightSource):
    """Loads through ``from_pretrained`` on the CPU, for checkpoints whose stored names or layout
    differ from the model's parameters (transformers' weight conversions, e.g. per-expert MoE
    weights stacked into one tensor). Costs one host copy of the model (``slices`` are cut from it)."""

    def __init__(self, checkpoint: Checkpoint, dtype: torch.dtype, slices: Slices | None = None):
        self.checkpoint, self.dtype = checkpoint, dtype
        self.slices = slices or {}
        self._state: dict[str, torch.Tensor] | None = None

    def _load(self) -> dict[str, torch.Tensor]:
        if self._state is None:
            # use_kernels=False: transformers 5.25 defaults to hub kernels for some layers (Mamba-2's), which
            # it cannot fetch offline; the weights are all that is read here
            kwargs = {"dtype": self.dtype, "trust_remote_code": self.checkpoint.trust_remote_code,
                      "use_kernels": False}
            if not self.checkpoint.is_safetensors:
                kwargs["use_safetensors"] = False
            model = AutoModelForCausalLM.from_pretrained(self.checkpoint.path, **kwargs)
            self._state = dict(model.state_dict())
        return self._state

    def names(self) -> set[str]:
        return set(self._load())

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        state = self._load()
        for name in list(state):
            tensor = state.pop(name)
            yield name, self.slices[name](tensor) if name in self.slices else tensor
        self._state = None


class RandomSource(WeightSource):
    """Random tensors made on ``device`` in place of a checkpoint: N(0, ``std``) for matrices, ones for
    vectors (norm weights), each seeded by its name, so a name has the same value on every
    tensor-parallel rank (before its slice is cut) and in every pipeline (fused or not)."""

    def __init__(self, shapes: dict[str, tuple[tuple[int, ...], torch.dtype]], device: torch.device, std: float,
                 slices: Slices | None = None):
        self.shapes, self.device, self.std, self.slices = shapes, device, std, slices or {}

    def names(self) -> set[str]:
        return set(self.shapes)

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name, (shape, dtype) in self.shapes.items():
            tensor = torch.empty(shape, dtype=dtype, device=self.device)
            if len(shape) >= 2:
                tensor.normal_(0.0, self.std, generator=torch.Generator(self.device).manual_seed(zlib.crc32(name.encode())))
            else:
                tensor.fill_(1.0)
            yield name, self.slices[name](tensor) if name in self.slices else tensor


def choose_weight_source(
    checkpoint: Checkpoint, param_names: set[str], dtype: torch.dtype, slices: Slices | None = None
) -> WeightSource:
    """Stream safetensors directly when every parameter is stored under its own name."""
    if checkpoint.is_safetensors:
        direct = SafetensorsSource(checkpoint.weight_files, slices)
        if param_names <= direct.names():
            return direct
    log.info("checkpoint names differ from the model's parameters: loading through transformers")
    return TransformersSource(checkpoint, dtype, slices)


def read_generation_config(path: Path) -> dict:
    file = path / "generation_config.json"
    return json.loads(file.read_text()) if file.is_file() else {}
