"""Quantized linear layers: ``fp8_linear``, ``nvfp4_linear`` and their norm/activation-fused variants.

``fp8_linear(x, weight, weight_scale, input_scale, bias, block_size, activations)``: ``weight`` is
``float8_e4m3fn [N, K]``; the SHAPE of ``weight_scale`` (fp32) says its kind: ``[]`` per tensor,
``[N]`` per output channel (also what per-tensor scales of fused q/k/v or gate/up parts become),
``[ceil(N/bn), ceil(K/bk)]`` per block, with ``block_size = [bn, bk]``. One op covers all three:
they differ only in how the scale is broadcast, the graph rewrites (fusion, sharding) treat them
alike, and the kernels pick their path from the same shape. ``activations`` is ``none``
(weight-only), ``static`` (``input_scale`` fp32 ``[]``), ``token`` or ``group`` (groups of ``bk``).

``nvfp4_linear(x, weight, weight_scale, weight_scale_2, bias)``: ``weight`` uint8 ``[N, K/2]`` (two
e2m1 per byte), ``weight_scale`` e4m3 ``[N, K/16]``, ``weight_scale_2`` fp32 ``[]`` (or ``[N]`` when
fused parts had different global scales). Activations stay in x's dtype: Hopper has no FP4 tensor
cores, so the checkpoint's ``input_scale`` (for Blackwell's FP4 activations) is not applied.

The torch reference (the CPU path; see ``autodeploy.quantization.numerics``) dequantizes the weight
to fp32, fake-quantizes the activations as the format says, multiplies in fp32, adds the bias and
rounds to x's dtype once. On CUDA (``quant_kernel``): up to ``QUANT_GEMV_MAX_ROWS`` rows take the
weight-only GEMV of ``kernels/quant_gemv.py`` (activations are NOT rounded to FP8 there: decode is
bound by the weight stream, and skipping the rounding only removes error); FP8 up to
``FP8_WEIGHT_ONLY_MAX_ROWS`` rows (and FP8 weight-only at any rows) the weight-only tensor-core GEMM of
``kernels/quant_gemm.py`` (``fp8_weight_only_gemm``: x times the dequantized tiles, likewise unrounded);
more rows the FP8 GEMM there (activations quantized as above), NVFP4 its weight-only GEMM. Up to
``FP8_SMALL_M_MAX_ROWS`` rows (``AUTODEPLOY_FP8_SMALL_M_MAX_ROWS``; 0, off, until the GPU timing says where it
wins), FP8 with activations per token or static and per-tensor / per-channel weight scales takes the swap-AB
FP8 x FP8 tensor-core GEMM of ``kernels/fp8_small_m.py`` ahead of all of these (activations quantized first,
so it computes the reference's rounding).

Fused variants mirror ``ops/fused_linear.py``: ``{fp8,nvfp4}_rms_norm_linear(x, norm_weight, eps,
<linear args after x>)``, ``..._add_rms_norm_linear(x, residual, norm_weight, eps, <...>)`` ->
``(out, x + residual)`` and ``..._swiglu_down(gate_up, <linear args after x>, activation)``: each is
exactly the norm / ``act(gate) * up`` op followed by the quantized linear. At the "gemv" path the step is
folded into the GEMV's operand loads, as the bf16 ops fold it into theirs (``*_prologue_gemv``: one launch
instead of two, the norm's 1/rms applied to the sums; ``AUTODEPLOY_QUANT_GEMV_PROLOGUE`` and
``..._MAX_ROWS`` say which steps, formats and rows); where the FP8 x FP8 GEMMs take the call, the activation
quantizer is folded into the step's kernel (``kernels/norm_quantize.py``); elsewhere the step's kernel runs
before the linear.
"""

from __future__ import annotations

import os

import torch

from ..quantization.numerics import dequantize_fp8, dequantize_nvfp4, fake_quantize_activations
from ._triton import use_triton
from .mlp import gated_activation
from .norm import fused_add_rms_norm, rms_norm

# the agreed boundary of the quantized GEMV kernels (batch-1..4 decode); 0 sends every call to the GEMM
QUANT_GEMV_MAX_ROWS = int(os.environ.get("AUTODEPLOY_QUANT_GEMV_MAX_ROWS", "4"))
# up to this many rows FP8 takes the weight-only tensor-core GEMM (split-K, no activation quantizer launch):
# at 16 rows it ran the 8B layer's linears in 108 us against 119 us for fp8_gemm with its quantizer (H100,
# 2026-12-07); beyond, the FP8 x FP8 GEMM's halved operand bytes and faster MMA win
FP8_WEIGHT_ONLY_MAX_ROWS = 16
# up to this many rows FP8 with quantized activations takes the swap-AB FP8 x FP8 GEMM of kernels/fp8_small_m.py
# (~1.1 SASS instructions per weight byte in its sm_90 loop against ~6.7 for the FP8 GEMV, ~5.8 for the
# weight-only GEMM); off until timed on a GPU (bench/probes/fp8_small_m.py): the switch of the A/B runs
FP8_SMALL_M_MAX_ROWS = int(os.environ.get("AUTODEPLOY_FP8_SMALL_M_MAX_ROWS", "0"))
STEPS = ("RMS_NORM", "ADD_RMS_NORM", "GATED")  # the fused ops' steps (kernels/gemv.py's Prologue names)
FORMATS = ("fp8", "nvfp4")


# unset: every step apart. The folds measured slower on an H100 (bench/probes/quant_kernels.py --steps, 2026-12-07
# 22:24: a step + qkv/gate_up/down, 32 layers, FP8 2.879 -> 3.381 ms, NVFP4 1.893 -> 2.491; the FP8 bs1 engine step
# 3.543 -> 3.987 ms): they add sm_90 SASS instructions to loops that are issue-bound already (per weight byte, FP8
# 7.0 plain -> 8.3 / 9.0 / 11.3 with RMSNorm / add + RMSNorm / gated; NVFP4's word kernel 4.95 per element -> 5.8 /
# 6.9 / 8.5, against an H100's ~4.9 budget at the copy bandwidth) and save one launch each (~2-4 us)
DEFAULT_FOLDED = ""


def _folded_from_env(value: str | None) -> frozenset[tuple[str, str]]:
    """``AUTODEPLOY_QUANT_GEMV_PROLOGUE``: the (format, step) pairs whose step folds into the GEMV. Unset
    ``DEFAULT_FOLDED``, ``1`` all, ``0`` or empty none, else a comma list of ``STEP`` (both formats), ``FORMAT:STEP``
    or ``FORMAT:all``."""
    if value is None:
        value = DEFAULT_FOLDED
    if value.strip() == "1":
        return frozenset((f, s) for f in FORMATS for s in STEPS)
    pairs = set()
    for item in (v.strip() for v in value.split(",") if v.strip() not in ("", "0")):
        fmt, _, step = item.rpartition(":")
        formats = (fmt.lower(),) if fmt else FORMATS
        steps = STEPS if step.lower() == "all" else (step.upper(),)
        if not set(formats) <= set(FORMATS) or not set(steps) <= set(STEPS):
            raise ValueError(f"AUTODEPLOY_QUANT_GEMV_PROLOGUE={value!r}: {item!r} is none of 1, 0, STEP, FORMAT:STEP, "
                             f"FORMAT:all (formats {', '.join(FORMATS)}; steps {', '.join(STEPS)})")
        pairs |= {(f, s) for f in formats for s in steps}
    return frozenset(pairs)


# the fused ops' steps folded into the GEMV's operand loads at the "gemv" path (one launch, not two); the others
# run as their own kernel before the GEMV (the A/B: bench/probes/quant_kernels.py --steps)
QUANT_GEMV_PROLOGUE = _folded_from_env(os.environ.get("AUTODEPLOY_QUANT_GEMV_PROLOGUE"))
# up to this many rows (every program applies the step to every row: at 4 rows the FP8 GEMV's loop, already
# issue-bound, takes 14.3 instructions per weight byte with add + RMSNorm against 12.1 plain)
QUANT_GEMV_PROLOGUE_MAX_ROWS = int(os.environ.get("AUTODEPLOY_QUANT_GEMV_PROLOGUE_MAX_ROWS", "4"))


def quant_kernel(rows: int, on_gpu: bool, kind: str, activations: str = "none",
                 block_scaled: bool = False) -> str:
    """Which implementation a quantized linear of ``rows`` rows runs: ``small_m`` (FP8 x FP8 swap-AB
    GEMM), ``gemv``, ``weight_only`` (FP8 weight-only tensor-core GEMM), ``gemm`` or ``reference``
    (module doc)."""
    if not on_gpu:
        return "reference"
    if kind == "fp8" and activations in ("token", "static") and not block_scaled and _small_m(rows):
        return "small_m"
    if rows <= QUANT_GEMV_MAX_ROWS:
        return "gemv"
    if kind == "fp8" and (activations == "none" or rows <= FP8_WEIGHT_ONLY_MAX_ROWS):
        return "weight_only"
    return "gemm"


def _small_m(rows: int) -> bool:
    return 0 < rows <= FP8_SMALL_M_MAX_ROWS


def _rows(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1, x.shape[-1])


def _block(block_size: list[int] | None) -> tuple[int, int] | None:
    return (int(block_size[0]), int(block_size[1])) if block_size else None


def fp8_linear_reference(x, weight, weight_scale, input_scale, bias, block_size, activations) -> torch.Tensor:
    block = _block(block_size)
    group = block[1] if block else None
    xq = fake_quantize_activations(x, activations, input_scale, group)
    out = xq @ dequantize_fp8(weight, weight_scale, block).T
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype)


def nvfp4_linear_reference(x, weight, weight_scale, weight_scale_2, bias) -> torch.Tensor:
    out = x.float() @ dequantize_nvfp4(weight, weight_scale, weight_scale_2).T
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype)


def _fp8_path(x: torch.Tensor, activations: str, block_size) -> str:
    return quant_kernel(x.numel() // x.shape[-1], use_triton(x), "fp8", activations, bool(block_size))


def _fp8(x, weight, weight_scale, input_scale, bias, block_size, activations) -> torch.Tensor:
    path = _fp8_path(x, activations, block_size)
    if path == "reference":
        return fp8_linear_reference(x, weight, weight_scale, input_scale, bias, block_size, activations)
    block = _block(block_size)
    if path == "small_m":
        from ..kernels.fp8_quantize import fp8_quantize

        q, scale = fp8_quantize(_rows(x), _static(input_scale, activations))
        out = _fp8_of_quantized(q, scale, x.dtype, weight, weight_scale, bias)
        return out.reshape(*x.shape[:-1], weight.shape[0])
    if path == "gemv":
        from ..kernels.quant_gemv import fp8_gemv

        out = fp8_gemv(_rows(x), weight, weight_scale, block_size=block, bias=bias)
    elif path == "weight_only":
        from ..kernels.quant_gemm import fp8_weight_only_gemm

        out = fp8_weight_only_gemm(_rows(x), weight, weight_scale, block_size=block, bias=bias)
    else:
        from ..kernels.quant_gemm import fp8_gemm

        out = fp8_gemm(_rows(x), weight, weight_scale, input_scale=_static(input_scale, activations), block_size=block,
                       bias=bias)
    return out.reshape(*x.shape[:-1], weight.shape[0])


def _quantizes_in_the_step(x: torch.Tensor, activations: str, block_size) -> bool:
    """Whether a fused op's norm / activation runs with the activation quantizer in one kernel
    (``kernels/norm_quantize.py``): the call takes an FP8 x FP8 GEMM, its activations per token or static."""
    return (_fp8_path(x, activations, block_size) in ("gemm", "small_m") and activations in ("token", "static")
            and not block_size)


def _fp8_of_quantized(q, scale, out_dtype, weight, weight_scale, bias) -> torch.Tensor:
    """The FP8 x FP8 GEMM of activations quantized already: the swap-AB kernel up to
    ``FP8_SMALL_M_MAX_ROWS`` rows, ``fp8_gemm_quantized`` beyond."""
    rows, scale = q.reshape(-1, q.shape[-1]), scale.reshape(-1, 1) if scale.dim() else scale
    if _small_m(rows.shape[0]):
        from ..kernels.fp8_small_m import fp8_small_m_gemm as kernel
    else:
        from ..kernels.quant_gemm import fp8_gemm_quantized as kernel
    out = kernel(rows, scale, weight, weight_scale, bias, out_dtype=out_dtype)
    return out.reshape(*q.shape[:-1], weight.shape[0])


def _static(input_scale, activations: str):
    return input_scale if activations == "static" else None


def _nvfp4_path(x: torch.Tensor) -> str:
    return quant_kernel(x.numel() // x.shape[-1], use_triton(x), "nvfp4")


def _nvfp4(x, weight, weight_scale, weight_scale_2, bias) -> torch.Tensor:
    path = _nvfp4_path(x)
    if path == "reference":
        return nvfp4_linear_reference(x, weight, weight_scale, weight_scale_2, bias)
    if path == "gemv":
        from ..kernels.quant_gemv import nvfp4_gemv as kernel
    else:
        from ..kernels.quant_gemm import nvfp4_gemm as kernel
    # a per-row weight_scale_2 (fused parts with their own global scales) scales each output feature in the kernel
    out = kernel(_rows(x), weight, weight_scale, weight_scale_2, bias=bias)
    return out.reshape(*x.shape[:-1], weight.shape[0])


def _folds_step(x: torch.Tensor, path: str, fmt: str, step: str) -> bool:
    """Whether a fused op runs its norm / activation (``step``, of ``STEPS``) in the quantized GEMV's operand
    loads: at the "gemv" path (weight-only activations, no quantizer in the step), unless switched off."""
    rows = x.numel() // x.shape[-1]
    return path == "gemv" and (fmt, step) in QUANT_GEMV_PROLOGUE and rows <= QUANT_GEMV_PROLOGUE_MAX_ROWS


def _step(kind: str, **inputs):
    """The ``GemvPrologue`` of one fused op's step (``STEPS``)."""
    from ..kernels.gemv import GemvPrologue, Prologue

    return GemvPrologue(Prologue[kind], **inputs)


def _fp8_with_step(x, step, weight, weight_scale, bias, block_size):
    """``(fp8 linear of step(x), x + residual or None)``: one GEMV launch."""
    from ..kernels.quant_gemv import fp8_prologue_gemv

    return fp8_prologue_gemv(x, weight, weight_scale, _block(block_size), bias, prologue=step)


def _nvfp4_with_step(x, step, weight, weight_scale, weight_scale_2, bias):
    """``(nvfp4 linear of step(x), x + residual or None)``: one GEMV launch."""
    from ..kernels.quant_gemv import nvfp4_prologue_gemv

    return nvfp4_prologue_gemv(x, weight, weight_scale, weight_scale_2, bias, prologue=step)


def _sum_fits(x: torch.Tensor, residual: torch.Tensor) -> bool:
    """Whether the GEMV can add the residual (it writes x + residual in x's dtype and shape)."""
    return residual.shape == x.shape and residual.dtype == x.dtype


def _fake(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], weight.shape[0])


def _fake_with_sum(x, residual, weight):
    summed = torch.empty_like(x, dtype=torch.promote_types(x.dtype, residual.dtype))
    return _fake(summed, weight), summed


# ---- FP8 -------------------------------------------------------------------------------------------

@torch.library.custom_op("autodeploy::fp8_linear", mutates_args=())
def fp8_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
               input_scale: torch.Tensor | None = None, bias: torch.Tensor | None = None,
               block_size: list[int] | None = None, activations: str = "none") -> torch.Tensor:
    return _fp8(x, weight, weight_scale, input_scale, bias, block_size, activations)


@fp8_linear.register_fake
def _(x, weight, weight_scale, input_scale=None, bias=None, block_size=None, activations="none"):
    return _fake(x, weight)


@torch.library.custom_op("autodeploy::fp8_rms_norm_linear", mutates_args=())
def fp8_rms_norm_linear(x: torch.Tensor, norm_weight: torch.Tensor, eps: float, weight: torch.Tensor,
                        weight_scale: torch.Tensor, input_scale: torch.Tensor | None = None,
                        bias: torch.Tensor | None = None, block_size: list[int] | None = None,
                        activations: str = "none") -> torch.Tensor:
    if _folds_step(x, _fp8_path(x, activations, block_size), "fp8", "RMS_NORM"):
        step = _step("RMS_NORM", norm_weight=norm_weight, eps=eps)
        return _fp8_with_step(x, step, weight, weight_scale, bias, block_size)[0]
    if _quantizes_in_the_step(x, activations, block_size):
        from ..kernels.norm_quantize import rms_norm_quantize

        q, scale, _ = rms_norm_quantize(x, norm_weight, eps, _static(input_scale, activations))
        return _fp8_of_quantized(q, scale, x.dtype, weight, weight_scale, bias)
    return _fp8(rms_norm(x, norm_weight, eps), weight, weight_scale, input_scale, bias, block_size, activations)


@fp8_rms_norm_linear.register_fake
def _(x, norm_weight, eps, weight, weight_scale, input_scale=None, bias=None, block_size=None, activations="none"):
    return _fake(x, weight)


@torch.library.custom_op("autodeploy::fp8_add_rms_norm_linear", mutates_args=())
def fp8_add_rms_norm_linear(x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                            weight: torch.Tensor, weight_scale: torch.Tensor,
                            input_scale: torch.Tensor | None = None, bias: torch.Tensor | None = None,
                            block_size: list[int] | None = None,
                            activations: str = "none") -> tuple[torch.Tensor, torch.Tensor]:
    if _folds_step(x, _fp8_path(x, activations, block_size), "fp8", "ADD_RMS_NORM") and _sum_fits(x, residual):
        step = _step("ADD_RMS_NORM", residual=residual, norm_weight=norm_weight, eps=eps)
        return _fp8_with_step(x, step, weight, weight_scale, bias, block_size)
    if _quantizes_in_the_step(x, activations, block_size) and residual.dtype == x.dtype:
        from ..kernels.norm_quantize import rms_norm_quantize

        q, scale, summed = rms_norm_quantize(x, norm_weight, eps, _static(input_scale, activations), residual)
        return _fp8_of_quantized(q, scale, x.dtype, weight, weight_scale, bias), summed
    normed, summed = fused_add_rms_norm(x, residual, norm_weight, eps)
    return _fp8(normed, weight, weight_scale, input_scale, bias, block_size, activations), summed


@fp8_add_rms_norm_linear.register_fake
def _(x, residual, norm_weight, eps, weight, weight_scale, input_scale=None, bias=None, block_size=None,
      activations="none"):
    return _fake_with_sum(x, residual, weight)


@torch.library.custom_op("autodeploy::fp8_swiglu_down", mutates_args=())
def fp8_swiglu_down(gate_up: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                    input_scale: torch.Tensor | None = None, bias: torch.Tensor | None = None,
                    block_size: list[int] | None = None, activations: str = "none",
                    activation: str = "silu") -> torch.Tensor:
    if _folds_step(gate_up, _fp8_path(gate_up, activations, block_size), "fp8", "GATED"):
        step = _step("GATED", activation=activation)
        return _fp8_with_step(gate_up, step, weight, weight_scale, bias, block_size)[0]
    if _quantizes_in_the_step(gate_up, activations, block_size):
        from ..kernels.norm_quantize import act_mul_quantize

        q, scale = act_mul_quantize(gate_up, activation, _static(input_scale, activations))
        return _fp8_of_quantized(q, scale, gate_up.dtype, weight, weight_scale, bias)
    gate, up = gate_up.chunk(2, dim=-1)
    hidden = gated_activation(gate, up, activation)
    return _fp8(hidden, weight, weight_scale, input_scale, bias, block_size, activations)


@fp8_swiglu_down.register_fake
def _(gate_up, weight, weight_scale, input_scale=None, bias=None, block_size=None, activations="none",
      activation="silu"):
    return _fake(gate_up, weight)


# ---- NVFP4 -----------------------------------------------------------------------------------------

@torch.library.custom_op("autodeploy::nvfp4_linear", mutates_args=())
def nvfp4_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, weight_scale_2: torch.Tensor,
                 bias: torch.Tensor | None = None) -> torch.Tensor:
    return _nvfp4(x, weight, weight_scale, weight_scale_2, bias)


@nvfp4_linear.register_fake
def _(x, weight, weight_scale, weight_scale_2, bias=None):
    return _fake(x, weight)


@torch.library.custom_op("autodeploy::nvfp4_rms_norm_linear", mutates_args=())
def nvfp4_rms_norm_linear(x: torch.Tensor, norm_weight: torch.Tensor, eps: float, weight: torch.Tensor,
                          weight_scale: torch.Tensor, weight_scale_2: torch.Tensor,
                          bias: torch.Tensor | None = None) -> torch.Tensor:
    if _folds_step(x, _nvfp4_path(x), "nvfp4", "RMS_NORM"):
        step = _step("RMS_NORM", norm_weight=norm_weight, eps=eps)
        return _nvfp4_with_step(x, step, weight, weight_scale, weight_scale_2, bias)[0]
    return _nvfp4(rms_norm(x, norm_weight, eps), weight, weight_scale, weight_scale_2, bias)


@nvfp4_rms_norm_linear.register_fake
def _(x, norm_weight, eps, weight, weight_scale, weight_scale_2, bias=None):
    return _fake(x, weight)


@torch.library.custom_op("autodeploy::nvfp4_add_rms_norm_linear", mutates_args=())
def nvfp4_add_rms_norm_linear(x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                              weight: torch.Tensor, weight_scale: torch.Tensor, weight_scale_2: torch.Tensor,
                              bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    if _folds_step(x, _nvfp4_path(x), "nvfp4", "ADD_RMS_NORM") and _sum_fits(x, residual):
        step = _step("ADD_RMS_NORM", residual=residual, norm_weight=norm_weight, eps=eps)
        return _nvfp4_with_step(x, step, weight, weight_scale, weight_scale_2, bias)
    normed, summed = fused_add_rms_norm(x, residual, norm_weight, eps)
    return _nvfp4(normed, weight, weight_scale, weight_scale_2, bias), summed


@nvfp4_add_rms_norm_linear.register_fake
def _(x, residual, norm_weight, eps, weight, weight_scale, weight_scale_2, bias=None):
    return _fake_with_sum(x, residual, weight)


@torch.library.custom_op("autodeploy::nvfp4_swiglu_down", mutates_args=())
def nvfp4_swiglu_down(gate_up: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                      weight_scale_2: torch.Tensor, bias: torch.Tensor | None = None,
                      activation: str = "silu") -> torch.Tensor:
    if _folds_step(gate_up, _nvfp4_path(gate_up), "nvfp4", "GATED"):
        return _nvfp4_with_step(gate_up, _step("GATED", activation=activation), weight, weight_scale, weight_scale_2,
                                bias)[0]
    gate, up = gate_up.chunk(2, dim=-1)
    return _nvfp4(gated_activation(gate, up, activation), weight, weight_scale, weight_scale_2, bias)


@nvfp4_swiglu_down.register_fake
def _(gate_up, weight, weight_scale, weight_scale_2, bias=None, activation="silu"):
    return _fake(gate_up, weight)
