"""The step before an FP8 GEMM and the FP8 quantization of its output in one pass: RMSNorm (with or
without the residual add) or ``act(gate) * up``, then the activations' e4m3 values and scale.

Decode batches beyond the GEMVs' few rows run ``fp8_gemm`` on activations quantized per token (or with
the checkpoint's static scale). Done apart, each such linear costs a norm or activation kernel, a
quantizer kernel reading its output back, and the GEMM. Here one program per row computes the step's
value in fp32, rounds it to the activations' dtype (the value the separate op would store, so the
result is the separate steps'), and quantizes it as ``quant_gemm.fp8_quantize`` does (dynamic: the
row's amax over 448, IEEE division, e4m3 rounding ties to even). The row lives in registers: one block
of the next power of two of its length (16384 for a 14336-wide MLP), so this is for hidden sizes up to
``MAX_COLUMNS``.
"""

from __future__ import annotations

from enum import IntEnum

import torch
import triton
import triton.language as tl

from . import pdl
from . import quant_reference as ref
from .activation import ACTIVATION_IDS, activate
from .fp8_quantize import FP8_MAX, MIN_AMAX, _e4m3

MAX_COLUMNS = 16384


class Step(IntEnum):
    RMS_NORM = 0
    ADD_RMS_NORM = 1
    GATED = 2


RMS_NORM, ADD_RMS_NORM, GATED = (tl.constexpr(s.value) for s in Step)


@triton.jit
def _step_quantize_kernel(
    x_ptr, second_ptr, weight_ptr, q_ptr, scale_ptr, sum_ptr,
    stride_x, stride_2, stride_q, stride_s, n_cols, eps,
    STEP: tl.constexpr, ACTIVATION: tl.constexpr, STATIC: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr,
):
    """One row: the step's value (``second`` is the residual or, gated, ``up``; x is gate), rounded to
    x's dtype, then its e4m3 values and (unless ``STATIC``) its scale."""
    pdl.allow_dependents(PDL)  # the GEMM after it may place its programs meanwhile
    pdl.wait(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    dtype = x.dtype
    x = x.to(tl.float32)
    second = tl.load(second_ptr + row * stride_2 + cols, mask=mask, other=0.0).to(tl.float32)
    if STEP == GATED:
        value = activate(x, ACTIVATION) * second
    else:
        if STEP == ADD_RMS_NORM:
            summed = (x + second).to(dtype)
            tl.store(sum_ptr + row * stride_s + cols, summed, mask=mask)
            x = summed.to(tl.float32)
        rstd = tl.rsqrt(tl.sum(x * x, 0) / n_cols + eps)
        value = x * rstd * tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    value = value.to(dtype).to(tl.float32)
    if STATIC:
        scale = tl.load(scale_ptr)
    else:
        scale = tl.math.div_rn(tl.maximum(tl.max(tl.abs(value), 0), MIN_AMAX), FP8_MAX)
        tl.store(scale_ptr + row, scale)
    tl.store(q_ptr + row * stride_q + cols, _e4m3(value, scale), mask=mask)


def rms_norm_quantize(x: torch.Tensor, weight: torch.Tensor, eps: float, scale: torch.Tensor | None = None,
                      residual: torch.Tensor | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``fp8_quantize(rms_norm(x [+ residual], weight, eps), scale)`` and ``x + residual`` (or None):
    ``(x_fp8 [..., K], scale [..., 1] (dynamic) or the static scale, summed)``."""
    rows = _rows(x, "rms_norm_quantize")
    summed = None
    if residual is not None:
        if residual.shape != x.shape or residual.dtype != x.dtype:
            raise ValueError(f"rms_norm_quantize: the residual must match x {tuple(x.shape)} {x.dtype}, got "
                             f"{tuple(residual.shape)} {residual.dtype}")
        summed = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
    second = _rows(residual, "rms_norm_quantize") if residual is not None else rows
    step = Step.RMS_NORM if residual is None else Step.ADD_RMS_NORM
    q, found = _launch(rows, second, weight.contiguous(), summed, eps, step, "silu", scale)
    return q.view(x.shape), _shaped(found, scale, x), None if summed is None else summed.view(x.shape)


def act_mul_quantize(gate_up: torch.Tensor, activation: str = "silu",
                     scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``fp8_quantize(act(gate) * up, scale)`` of ``gate_up`` [..., 2I] (gate, then up)."""
    if activation not in ACTIVATION_IDS:
        raise ValueError(f"act_mul_quantize: unknown activation '{activation}', known: {sorted(ACTIVATION_IDS)}")
    if gate_up.shape[-1] % 2:
        raise ValueError(f"act_mul_quantize: gate_up has an odd number of columns, {gate_up.shape[-1]}")
    width = gate_up.shape[-1] // 2
    gate, up = gate_up[..., :width], gate_up[..., width:]
    rows_g, rows_u = gate.reshape(-1, width), up.reshape(-1, width)  # views of gate_up's rows
    q, found = _launch(_rows(rows_g, "act_mul_quantize"), _rows(rows_u, "act_mul_quantize"), rows_g, None, 0.0,
                       Step.GATED, activation, scale)
    return q.view(*gate.shape), _shaped(found, scale, gate)


def _rows(t: torch.Tensor, what: str) -> torch.Tensor:
    ref.check_activations(t, t.shape[-1], what)
    if t.shape[-1] > MAX_COLUMNS:
        raise ValueError(f"{what}: rows of at most {MAX_COLUMNS} columns, got {t.shape[-1]}")
    rows = t.reshape(-1, t.shape[-1])
    return rows if rows.stride(-1) == 1 else rows.contiguous()


def _shaped(found: torch.Tensor, static: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    return static if static is not None else found.view(*like.shape[:-1], 1)


def _launch(rows, second, weight, summed, eps, step: Step, activation: str, scale):
    if scale is not None and (scale.dtype != torch.float32 or scale.numel() != 1):
        raise ValueError(f"a static scale must be one float32 value, got {scale.dtype} of shape "
                         f"{tuple(scale.shape)}")
    m, k = rows.shape
    q = torch.empty((m, k), dtype=torch.float8_e4m3fn, device=rows.device)
    found = scale.reshape(1) if scale is not None else torch.empty((m, 1), dtype=torch.float32, device=rows.device)
    sums = summed if summed is not None else q
    if m and k:
        block = triton.next_power_of_2(k)
        _step_quantize_kernel[(m,)](
            rows, second, weight, q, found, sums, rows.stride(0), second.stride(0), q.stride(0), sums.stride(0), k,
            float(eps), STEP=int(step), ACTIVATION=ACTIVATION_IDS[activation], STATIC=scale is not None,
            BLOCK=block, num_warps=min(16, max(4, block // 1024)), **pdl.launch_options(rows.device))
    return q, found
