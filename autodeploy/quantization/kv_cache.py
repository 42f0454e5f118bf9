"""The KV cache's dtype and, for an FP8 cache, each attention layer's per-tensor k/v scales.

``CompileConfig.kv_cache_dtype`` decides: ``auto`` takes what the checkpoint asks for (ModelOpt's
``kv_cache_quant_algo: FP8``, compressed-tensors' ``kv_cache_scheme`` of 8-bit floats per tensor)
and the model dtype otherwise; ``fp8`` / ``fp8_e4m3`` (vLLM's spellings) ask for ``float8_e4m3fn``
on any checkpoint; a float dtype keeps the cache unquantized even where the checkpoint asks for FP8.

An FP8 cache stores ``e4m3(clamp(k / k_scale, +-448))`` and attention reads ``e4m3 * k_scale``
(likewise v). The scales are the checkpoint's, as each producer names them under the attention
module (compressed-tensors: ``self_attn.k_scale``; ModelOpt: ``self_attn.k_proj.k_scale``); a
checkpoint without any gets 1.0 (vLLM's default). Scales for some layers only, a scale that is not
one positive number, or a KV scheme other than FP8 per tensor stop the compile.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import QuantizationError
from .scheme import QuantPlan

log = logging.getLogger("autodeploy.quantize")
FP8_KV_DTYPE = torch.float8_e4m3fn
FP8_SETTINGS = ("fp8", "fp8_e4m3")
SCALE_LEAVES = {"k": "k_scale", "v": "v_scale"}


@dataclass(frozen=True)
class KVCacheFormat:
    """The cache dtype, and what the checkpoint asked for (its words; None if nothing)."""

    dtype: torch.dtype
    checkpoint_asks: str | None = None
    setting: str = "auto"

    @property
    def fp8(self) -> bool:
        return self.dtype == FP8_KV_DTYPE

    @property
    def model_dtype(self) -> bool:
        """Nothing asked for: the cache takes the dtype of each attention's keys (the model's)."""
        return self.setting == "auto" and not self.fp8

    def describe(self) -> str:
        name = str(self.dtype).removeprefix("torch.")
        if self.checkpoint_asks is None:
            return name + (f" (--kv_cache_dtype {self.setting})" if self.setting != "auto" else "")
        if self.fp8 and self.setting == "auto":
            return f"{name} (the checkpoint's {self.checkpoint_asks} KV cache)"
        return f"{name} (--kv_cache_dtype {self.setting}; the checkpoint asks for {self.checkpoint_asks})"


def resolve_kv_cache(setting: str, plan: QuantPlan | None, model_dtype: torch.dtype) -> KVCacheFormat:
    """The cache format for ``kv_cache_dtype`` = ``setting`` with the checkpoint's plan (module doc)."""
    asked = plan.kv_cache if plan is not None else None
    if setting in FP8_SETTINGS:
        return KVCacheFormat(FP8_KV_DTYPE, asked, setting)
    if setting != "auto":
        return KVCacheFormat(getattr(torch, setting), asked, setting)
    if asked is None:
        return KVCacheFormat(model_dtype)
    if plan.kv_cache_fp8:
        return KVCacheFormat(FP8_KV_DTYPE, asked)
    raise QuantizationError(
        f"{plan.method}: the checkpoint quantizes its KV cache as {asked}; autodeploy's quantized KV cache is FP8 "
        f"(e4m3) with per-tensor scales only. Pass --kv_cache_dtype {str(model_dtype).removeprefix('torch.')} to "
        "serve it with an unquantized KV cache")


def kv_cache_format(setting: str, model_dir: Path | None, model_dtype: torch.dtype) -> KVCacheFormat:
    """:func:`resolve_kv_cache` with the plan of the checkpoint in ``model_dir`` (None: no checkpoint)."""
    from .readers import read_quant_plan

    return resolve_kv_cache(setting, read_quant_plan(model_dir) if model_dir is not None else None, model_dtype)


def read_kv_scales(
    files: tuple[Path, ...], modules: list[str | None], stored: dict[str, tuple[str, tuple[int, ...]]]
) -> tuple[list[tuple[float, float]], bool]:
    """Per attention layer (its HF module path, None if unknown) its ``(k_scale, v_scale)``, and
    whether they came from the checkpoint (``stored``: its tensors, from the safetensors headers)."""
    names = [_scale_names(module, stored) for module in modules]
    found = [n for n in names if n is not None]
    if not found:
        return [(1.0, 1.0)] * len(modules), False
    if len(found) != len(names):
        layer = names.index(None)
        raise QuantizationError(f"the checkpoint stores KV cache scales for {len(found)} of {len(names)} attention "
                                f"layers; none for layer {layer} ({modules[layer] or 'module unknown'}): "
                                "expected k_scale and v_scale tensors under it")
    values = _read_scalars(files, {name for pair in found for name in pair})
    return [(values[k], values[v]) for k, v in found], True


def _scale_names(module: str | None, stored: dict) -> tuple[str, str] | None:
    """The stored ``(k_scale, v_scale)`` names under ``module`` (``M.k_scale``, ``M.k_proj.k_scale``, ...)."""
    if module is None:
        return None
    pair = []
    for leaf in SCALE_LEAVES.values():
        under = [n for n in stored if n.startswith(module + ".") and n.endswith("." + leaf)]
        if len(under) > 1:
            raise QuantizationError(f"{module}: several KV cache scales {', '.join(sorted(under))}; expected one")
        pair.append(under[0] if under else None)
    if (pair[0] is None) != (pair[1] is None):
        present = pair[0] or pair[1]
        raise QuantizationError(f"{present} is stored but not its {'v' if pair[0] else 'k'}_scale partner")
    return tuple(pair) if pair[0] is not None else None


def _read_scalars(files: tuple[Path, ...], names: set[str]) -> dict[str, float]:
    from safetensors import safe_open

    values = {}
    for file in files:
        with safe_open(str(file), framework="pt") as handle:
            for name in names & set(handle.keys()):
                tensor = handle.get_tensor(name)
                value = float(tensor.float().reshape(-1)[0]) if tensor.numel() == 1 else math.nan
                if tensor.numel() != 1 or not (math.isfinite(value) and value > 0):
                    raise QuantizationError(f"{name} has shape {list(tensor.shape)} and value(s) "
                                            f"{tensor.flatten()[:4].tolist()}: an FP8 KV cache needs one positive "
                                            "scale per tensor (per-head KV scales are not supported)")
                values[name] = value
    return values
