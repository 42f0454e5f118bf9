"""The FP8 activation quantizer: x -> (e4m3 x, scale), static per tensor, dynamic per token or per
1 x g group (``fp8_quantize``), for the FP8 GEMMs of ``quant_gemm.py``.

Values are rounded to the e4m3 grid in fp32 (``round_to_e4m3``) before the cast, so the cast is exact:
the same bytes as torch's ``.to(float8_e4m3fn)`` on the GPU and in Triton's interpreter (whose own fp32 ->
fp8 rounding carries into the exponent wrongly), and divisions are IEEE (``div_rn``; Triton's ``/`` is an
approximate division). ``norm_quantize.py`` fuses the same quantization into the step before a linear.
The per-token / static quantizer is launched with PDL on sm_90+ (``pdl.py``), as ``norm_quantize``: the
GEMM after it places its programs while it runs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import pdl
from . import quant_reference as ref

MIN_AMAX = tl.constexpr(ref.MIN_AMAX)
FP8_MAX = tl.constexpr(ref.FP8_MAX)
MAX_GROUP = 8192  # a group is one tile of the quantizer



@triton.jit
def round_to_e4m3(v):
    """fp32 ``v`` clamped to +-448 and rounded to the nearest e4m3 value (ties to even), as fp32: the
    magnitude over its quantum 2**(e - 3) (e: v's exponent, at least e4m3's smallest normal -6) is
    below 16, where adding and subtracting 1.5 * 2**23 rounds to an integer."""
    v = tl.minimum(tl.maximum(v, -FP8_MAX), FP8_MAX)
    bits = v.to(tl.int32, bitcast=True)
    exponent = tl.maximum(((bits >> 23) & 0xFF) - 127, -6)
    inverse_quantum = ((130 - exponent) << 23).to(tl.float32, bitcast=True)  # 2**(3 - e)
    quantum = ((exponent + 124) << 23).to(tl.float32, bitcast=True)  # 2**(e - 3)
    rounded = ((tl.abs(v) * inverse_quantum + 12582912.0) - 12582912.0) * quantum
    # the sign put back bitwise: -x in Triton is 0 - x, which turns -0.0 into +0.0
    return (rounded.to(tl.int32, bitcast=True) | (bits & -2147483648)).to(tl.float32, bitcast=True)


@triton.jit
def _e4m3(x, scale):
    return round_to_e4m3(tl.math.div_rn(x, scale)).to(tl.float8e4nv)


@triton.jit
def _quantize_rows_kernel(x_ptr, q_ptr, scale_ptr, K, stride_xm, stride_qm, STATIC: tl.constexpr,
                          BLOCK: tl.constexpr, PDL: tl.constexpr):
    """One row: its amax (unless ``STATIC``), its scale, its e4m3 values."""
    pdl.allow_dependents(PDL)  # the GEMM after it may place its programs (and prefetch weights) meanwhile
    pdl.wait(PDL)
    row = tl.program_id(0).to(tl.int64)
    lanes = tl.arange(0, BLOCK)
    if STATIC:
        scale = tl.load(scale_ptr)
    else:
        amax = tl.zeros([BLOCK], dtype=tl.float32)
        for k0 in range(0, K, BLOCK):
            x = tl.load(x_ptr + row * stride_xm + k0 + lanes, mask=k0 + lanes < K, other=0.0)
            amax = tl.maximum(amax, tl.abs(x.to(tl.float32)))
        scale = tl.math.div_rn(tl.maximum(tl.max(amax, 0), MIN_AMAX), FP8_MAX)
        tl.store(scale_ptr + row, scale)
    for k0 in range(0, K, BLOCK):
        x = tl.load(x_ptr + row * stride_xm + k0 + lanes, mask=k0 + lanes < K, other=0.0)
        tl.store(q_ptr + row * stride_qm + k0 + lanes, _e4m3(x.to(tl.float32), scale), mask=k0 + lanes < K)


@triton.jit
def _quantize_groups_kernel(x_ptr, q_ptr, scale_ptr, K, group_size, stride_xm, stride_qm, stride_sm,
                            stride_sg, GROUP_PAD: tl.constexpr, BLOCK_G: tl.constexpr):
    """``BLOCK_G`` groups of one row: each group's amax, scale and e4m3 values."""
    row = tl.program_id(0).to(tl.int64)
    groups = tl.program_id(1) * BLOCK_G + tl.arange(0, BLOCK_G)
    lanes = tl.arange(0, GROUP_PAD)
    ks = groups[:, None] * group_size + lanes[None, :]
    mask = (lanes < group_size)[None, :] & (ks < K)  # the last group may be short
    x = tl.load(x_ptr + row * stride_xm + ks, mask=mask, other=0.0).to(tl.float32)
    scale = tl.math.div_rn(tl.maximum(tl.max(tl.abs(x), 1), MIN_AMAX), FP8_MAX)
    tl.store(scale_ptr + row * stride_sm + groups * stride_sg, scale, mask=groups * group_size < K)
    tl.store(q_ptr + row * stride_qm + ks, _e4m3(x, scale[:, None]), mask=mask)


def fp8_quantize(x: torch.Tensor, scale: torch.Tensor | None = None,
                 group_size: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x_fp8, scale)`` with ``x ~ x_fp8 * scale``, e4m3 saturating, for x [..., K] (bf16/fp16/fp32).

    ``scale`` given (one fp32 value): static per tensor, returned as is. Otherwise dynamic: per token
    (scale [..., 1]) or, with ``group_size``, per group of that many columns (scale [..., ceil(K / g)],
    the last group the columns left; column-major in memory as cuBLASLt's blockwise scaling wants it).
    """
    k = x.shape[-1]
    ref.check_activations(x, k, "fp8_quantize")
    if scale is not None and (scale.dtype != torch.float32 or scale.numel() != 1):
        raise ValueError(f"fp8_quantize: a static scale must be one float32 value, got {scale.dtype} of "
                         f"shape {tuple(scale.shape)}")
    if group_size is not None and (scale is not None or not 1 <= group_size <= MAX_GROUP):
        raise ValueError(f"fp8_quantize: group_size must be 1 to {MAX_GROUP} columns, and scale None; got "
                         f"group_size={group_size}, scale={scale}")
    rows = x.reshape(-1, k)
    rows = rows if rows.stride(-1) == 1 else rows.contiguous()
    q = torch.empty(rows.shape, dtype=torch.float8_e4m3fn, device=x.device)
    if group_size is not None:
        found = _quantize_groups(rows, q, group_size)
        return q.view(x.shape), found.view(*x.shape[:-1], found.shape[1])
    if scale is not None:
        _quantize_rows(rows, q, scale.reshape(1), static=True)
        return q.view(x.shape), scale
    found = torch.empty((rows.shape[0], 1), dtype=torch.float32, device=x.device)
    _quantize_rows(rows, q, found, static=False)
    return q.view(x.shape), found.view(*x.shape[:-1], 1)


def _quantize_rows(rows: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, static: bool) -> None:
    (m, k), block = rows.shape, min(4096, triton.next_power_of_2(rows.shape[1]))
    if m and k:
        _quantize_rows_kernel[(m,)](rows, q, scale, k, rows.stride(0), q.stride(0), STATIC=static,
                                    BLOCK=block, num_warps=4, **pdl.launch_options(rows.device))


def _quantize_groups(rows: torch.Tensor, q: torch.Tensor, group_size: int) -> torch.Tensor:
    """The scales [M, ceil(K / g)], column-major."""
    (m, k), groups = rows.shape, triton.cdiv(rows.shape[1], group_size)
    found = torch.empty((groups, m), dtype=torch.float32, device=rows.device).t()
    group_pad = triton.next_power_of_2(group_size)
    block_g = max(1, min(triton.next_power_of_2(groups), 2048 // group_pad))
    if m and groups:
        _quantize_groups_kernel[(m, triton.cdiv(groups, block_g))](
            rows, q, found, k, group_size, rows.stride(0), q.stride(0), found.stride(0), found.stride(1),
            GROUP_PAD=group_pad, BLOCK_G=block_g, num_warps=4)
    return found
