"""Triton RMSNorm, optionally fused with the residual add that precedes it.

One program per row (the hidden size fits one block: 16 KiB of fp32 at hidden 4096), launched under
PDL (``kernels/pdl.py``) so that the GEMM after it can load weights meanwhile. Math in fp32
as the reference op (``autodeploy::rms_norm``); the fused variant rounds ``x + residual`` to its
output dtype first, so the normalised value is computed from exactly the sum it returns.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import pdl


@triton.jit
def _rms_norm_kernel(
    x_ptr, residual_ptr, weight_ptr, out_ptr, sum_ptr,
    stride_x, stride_r, stride_o, stride_s, n_cols, eps,
    BLOCK: tl.constexpr, HAS_RESIDUAL: tl.constexpr, PDL: tl.constexpr,
):
    pdl.allow_dependents(PDL)  # the next kernel (a GEMM's weight preload) may start meanwhile
    pdl.wait(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        residual = tl.load(residual_ptr + row * stride_r + cols, mask=mask, other=0.0).to(tl.float32)
        summed = (x + residual).to(sum_ptr.dtype.element_ty)
        tl.store(sum_ptr + row * stride_s + cols, summed, mask=mask)
        x = summed.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, 0) / n_cols + eps)
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (x * rstd * weight).to(out_ptr.dtype.element_ty), mask=mask)


def _rows(t: torch.Tensor) -> torch.Tensor:
    rows = t.reshape(-1, t.shape[-1])
    return rows if rows.stride(-1) == 1 else rows.contiguous()


def _launch(x, residual, weight, out, summed, eps):
    n_cols = x.shape[-1]
    block = triton.next_power_of_2(n_cols)
    warps = min(16, max(1, block // 512))
    _rms_norm_kernel[(x.shape[0],)](
        x, residual, weight, out, summed,
        x.stride(0), residual.stride(0), out.stride(0), summed.stride(0), n_cols, float(eps),
        BLOCK=block, HAS_RESIDUAL=residual is not x, num_warps=warps, **pdl.launch_options(x.device),
    )


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``rms_norm(x, weight, eps)`` over the last dim; returns a contiguous tensor in x's dtype."""
    rows = _rows(x)
    out = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
    if rows.shape[0]:
        _launch(rows, rows, weight.contiguous(), out, out, eps)
    return out.view(x.shape)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(``rms_norm(x + residual)``, ``x + residual``); same shapes, the sum in the promoted dtype."""
    dtype = torch.promote_types(x.dtype, residual.dtype)
    rows_x, rows_r = _rows(x), _rows(residual.expand_as(x))
    summed = torch.empty(rows_x.shape, dtype=dtype, device=x.device)
    out = torch.empty_like(summed)
    if rows_x.shape[0]:
        _launch(rows_x, rows_r, weight.contiguous(), out, summed, eps)
    return out.view(x.shape), summed.view(x.shape)
