"""What a quantized checkpoint (or ``--quantization``) asks for, as frozen data.

A :class:`LinearFormat` says how one linear layer is stored and computed (FP8 or NVFP4, the shape
of its weight scales, what happens to its activations); a :class:`QuantPlan` says which producer
wrote the checkpoint, the one format of its quantized linears, which modules it leaves
unquantized, and what it says about the KV cache. ``readers.py`` builds plans from checkpoints;
the ``quantize`` pass applies them to the graph.
"""

from __future__ import annotations

import fnmatch
import re
from dataclasses import dataclass
from typing import Literal

WeightScale = Literal["tensor", "channel", "block", "nvfp4"]
Activations = Literal["none", "static", "token", "group"]

ACTIVATION_WORDS = {
    "none": "bf16/fp16 activations (weight-only)",
    "static": "static per-tensor FP8 activations (input_scale)",
    "token": "dynamic per-token FP8 activations",
    "group": "dynamic per-token-group FP8 activations",
}


@dataclass(frozen=True)
class LinearFormat:
    """How the quantized linears of a checkpoint are stored and computed."""

    kind: Literal["fp8", "nvfp4"]
    weight_scale: WeightScale
    activations: Activations
    block_size: tuple[int, int] | None = None  # (rows, cols) of a weight-scale block
    scale_name: str = "weight_scale"  # the checkpoint's name of the weight scale (block FP8: weight_scale_inv)
    input_scale_name: str | None = None  # a checkpoint tensor that is read (and checked) per linear

    @property
    def group_size(self) -> int | None:
        """The activation group of ``group`` activations: the weight block's width along K."""
        return self.block_size[1] if self.activations == "group" and self.block_size else None

    def describe(self) -> str:
        if self.kind == "nvfp4":
            return "NVFP4 (e2m1 weights, e4m3 scales per 16, fp32 global scale; bf16/fp16 activations)"
        scale = {"tensor": "per-tensor", "channel": "per-channel"}.get(self.weight_scale)
        if scale is None:
            scale = f"{self.block_size[0]}x{self.block_size[1]} block"
        return f"FP8 e4m3 weights, {scale} scales, {ACTIVATION_WORDS[self.activations]}"


@dataclass(frozen=True)
class QuantPlan:
    """A checkpoint's (or the online) quantization, as the ``quantize`` pass applies it."""

    method: str  # e.g. "modelopt FP8", "compressed-tensors FP8_DYNAMIC", "online fp8"
    format: LinearFormat
    excluded: tuple[str, ...] = ()  # module patterns the producer leaves unquantized, as it wrote them
    online: bool = False  # quantize bf16/fp16 weights while loading
    kv_cache: str | None = None  # what the checkpoint says of the KV cache (e.g. "FP8"), or None
    kv_cache_fp8: bool = False  # that is the FP8 (e4m3) per-tensor KV cache autodeploy runs

    def is_excluded(self, module: str) -> bool:
        return any(_matches(pattern, module) for pattern in self.excluded)


def _matches(pattern: str, module: str) -> bool:
    """A producer's module pattern: ``re:REGEX`` (compressed-tensors), a glob (ModelOpt), a module
    name or a trailing part of one (``lm_head`` matches ``lm_head`` and ``model.lm_head``)."""
    if pattern.startswith("re:"):
        return re.match(pattern[3:], module) is not None
    if any(ch in pattern for ch in "*?["):
        return fnmatch.fnmatchcase(module, pattern)
    return module == pattern or module.endswith("." + pattern)


@dataclass(frozen=True)
class QuantSummary:
    """What the ``quantize`` pass did, for the compile report and the serve start-up report."""

    method: str
    format: str
    quantized: tuple[str, ...]  # modules whose linears run quantized
    unquantized: tuple[str, ...]  # linear modules left in the model dtype (excluded, LM head, tied)
    excluded: tuple[str, ...]  # the producer's exclusion patterns, as written
    dequantized: tuple[str, ...] = ()  # quantized in the checkpoint, dequantized at load (MoE experts)
    kv_cache: str = ""  # the KV cache's dtype, and what the checkpoint asked for

    def lines(self) -> list[str]:
        lines = [f"{self.method}: {self.format}",
                 f"{len(self.quantized)} linear layers quantized, e.g. {_sample(self.quantized)}",
                 f"left unquantized: {_sample(self.unquantized, 4) if self.unquantized else 'none'}"
                 + (f" (excluded by the checkpoint: {', '.join(self.excluded)})" if self.excluded else "")]
        if self.dequantized:
            lines.append(f"dequantized to the model dtype while loading (no quantized MoE op yet): "
                         f"{len(self.dequantized)} expert weights, e.g. {_sample(self.dequantized)}")
        if self.kv_cache:
            lines.append(f"KV cache dtype: {self.kv_cache}")
        return lines


def _sample(names: tuple[str, ...], count: int = 2) -> str:
    shown = ", ".join(names[:count])
    return shown + (f" (+{len(names) - count} more)" if len(names) > count else "")
