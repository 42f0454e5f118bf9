"""An experiment, measured and not kept: linear layers of a decode batch (a few to ``MAX_ROWS`` rows)
on the tensor cores, under PDL (bench/skinny_gpu.py measures it against cuBLAS; docs/perf.md,
2026-12-04: slower than cuBLAS at 64 rows, level at 8, so the runtime keeps cuBLAS).

``out[M, N] = x[M, K] @ W[N, K].T (+ bias)``. At these shapes a linear costs its weight stream: at 64
rows of the 8B shape cuBLAS streams qkv at 2.9 TB/s, the o projection at 2.7 and down (split-K plus
a reduce kernel) at 3.1 against 4.28 for a copy (H200, bench/gemm_sweep.py, 2026-12-04), because a
kernel of 8-37 us loses several microseconds to its launch and ramp, and a cuBLAS kernel cannot start
before the kernel before it ends. Here, as in the GEMV (``autodeploy/kernels/gemv.py``), every program
loads its first weight tile before the PDL wait, so the ramp overlaps the previous kernel's tail.

One program computes ``BLOCK_N`` output features of every row (``BLOCK_M`` >= M, padded rows masked)
over a K range. Where the column tiles alone would leave SMs idle (the o and down projections have
32 tiles of 128 features), K is split: each split stores its fp32 partial, and the last split of a
column tile to arrive sums the partials in split order (the same sum on every run) and stores the
output. Re-reading x costs L2 traffic of M / BLOCK_N times the weight's, so tiles stay wide.
"""

from __future__ import annotations

from dataclasses import dataclass

import kernels_only  # noqa: F401  (autodeploy.kernels without transformers; this folder)

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from autodeploy.kernels import pdl
from autodeploy.kernels.attention_config import _sm_count_of
from autodeploy.kernels.paged_attention import split_counters
from autodeploy.kernels.pdl import Trigger

MAX_ROWS = 64  # one BLOCK_M of the tensor cores' tile; more rows go to cuBLAS
START, AFTER_WAIT = tl.constexpr(Trigger.START.value), tl.constexpr(Trigger.AFTER_WAIT.value)


@triton.jit(do_not_specialize=["M"])
def _skinny_gemm_kernel(
    x_ptr, w_ptr, bias_ptr, out_ptr, part_ptr, counters_ptr,
    M, N, K, k_per_split, stride_xm, stride_wn, stride_om, stride_ps, stride_pm,
    HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr, DOT_PRECISION: tl.constexpr, PDL: tl.constexpr,
    TRIGGER: tl.constexpr,
):
    tile = tl.program_id(0)
    split = tl.program_id(1)
    cols = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    rows = tl.arange(0, BLOCK_M)
    row_ok = rows < M
    lanes = tl.arange(0, BLOCK_K)
    k_lo = split * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)
    w_tile = w_ptr + cols.to(tl.int64)[:, None] * stride_wn + lanes[None, :]
    x_tile = x_ptr + rows[:, None] * stride_xm + lanes[None, :]
    # weights: no kernel of the step writes them, so the first tile comes before the wait
    w_first = tl.load(w_tile + k_lo, mask=_k_mask(col_ok, k_lo + lanes, k_hi, EVEN_K), other=0.0)
    if TRIGGER == START:
        pdl.allow_dependents(PDL)
    pdl.wait(PDL)
    if TRIGGER == AFTER_WAIT:
        pdl.allow_dependents(PDL)
    x_first = tl.load(x_tile + k_lo, mask=_k_mask(row_ok, k_lo + lanes, k_hi, EVEN_K), other=0.0)
    acc = tl.dot(x_first, tl.trans(w_first), input_precision=DOT_PRECISION, out_dtype=tl.float32)
    for k0 in range(k_lo + BLOCK_K, k_hi, BLOCK_K):
        w = tl.load(w_tile + k0, mask=_k_mask(col_ok, k0 + lanes, k_hi, EVEN_K), other=0.0)
        x = tl.load(x_tile + k0, mask=_k_mask(row_ok, k0 + lanes, k_hi, EVEN_K), other=0.0)
        acc = tl.dot(x, tl.trans(w), acc, input_precision=DOT_PRECISION)
    out_mask = row_ok[:, None] & col_ok[None, :]
    if SPLIT_K == 1:
        _store_output(out_ptr, bias_ptr, rows, cols, col_ok, stride_om, out_mask, acc, HAS_BIAS)
    else:
        parts = part_ptr + rows[:, None] * stride_pm + cols[None, :]
        tl.store(parts + split * stride_ps, acc, mask=out_mask)
        counter = counters_ptr + tile
        # acq_rel at GPU scope after the CTA's stores: see paged_attention._arrive for why the whole
        # CTA's partials are visible to the split that arrives last
        arrived = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
        if arrived == SPLIT_K - 1:
            total = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            for s in range(SPLIT_K):  # in split order: the same sum whichever split arrives last
                total += tl.load(parts + s * stride_ps, mask=out_mask, other=0.0, cache_modifier=".cg")
            _store_output(out_ptr, bias_ptr, rows, cols, col_ok, stride_om, out_mask, total, HAS_BIAS)
            tl.atomic_xchg(counter, 0, sem="relaxed", scope="gpu")  # ready for the next launch


@triton.jit
def _k_mask(ok, ks, k_hi, EVEN_K: tl.constexpr):
    """Mask of a [rows, BLOCK_K] tile: the rows in ``ok``, and (unless every K range is whole blocks)
    the columns below ``k_hi``."""
    mask = ok[:, None] & (ks < k_hi)[None, :]
    if EVEN_K:  # constant along K: the loads stay 16-byte vectors
        mask = tl.broadcast_to(ok[:, None], mask.shape)
    return mask


@triton.jit
def _store_output(out_ptr, bias_ptr, rows, cols, col_ok, stride_om, mask, acc, HAS_BIAS: tl.constexpr):
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + rows[:, None] * stride_om + cols[None, :], acc.to(out_ptr.dtype.element_ty), mask=mask)


@dataclass(frozen=True)
class SkinnyLaunch:
    """Tile sizes and K splits of one launch (a function of the shapes and the SM count only)."""

    block_n: int
    block_k: int
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 4
    trigger: Trigger = Trigger.AFTER_WAIT

    @classmethod
    def choose(cls, m: int, n: int, k: int, sm_count: int, block_n: int = 128, block_k: int = 64,
               programs_per_sm: float = 1.0, **options) -> "SkinnyLaunch":
        """Tiles of ``block_n`` features x ``block_k``-wide K blocks, K split until the grid has
        ``programs_per_sm`` programs per SM; ``options``: the other fields."""
        tiles = triton.cdiv(n, block_n)
        target = int(programs_per_sm * sm_count)
        split = max(1, min(triton.cdiv(k, block_k), target // tiles)) if tiles < target else 1
        return cls(block_n, block_k, split, **options)


def skinny_gemm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                launch: SkinnyLaunch | None = None) -> torch.Tensor:
    """``x @ weight.T + bias`` for x [..., K] of at most ``MAX_ROWS`` rows (any float dtype; fp32 is
    for tests: the tensor cores then run in exact fp32)."""
    n, k = weight.shape
    rows = x.reshape(-1, k)
    rows = rows if rows.stride(-1) == 1 else rows.contiguous()
    m = rows.shape[0]
    if m > MAX_ROWS:
        raise ValueError(f"skinny_gemm takes at most {MAX_ROWS} rows, got {m}")
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m:
        _launch(rows, weight, bias, out, launch or SkinnyLaunch.choose(m, n, k, _sm_count(x.device)))
    return out.view(*x.shape[:-1], n)


def _launch(rows, weight, bias, out, launch: SkinnyLaunch):
    m, (n, k) = rows.shape[0], weight.shape
    k_blocks = triton.cdiv(k, launch.block_k)
    k_per_split = triton.cdiv(k_blocks, launch.split_k) * launch.block_k
    splits = triton.cdiv(k, k_per_split)  # every split gets at least one K block
    tiles = triton.cdiv(n, launch.block_n)
    block_m = max(16, triton.next_power_of_2(m))
    if splits > 1:
        parts = torch.empty((splits, block_m, n), dtype=torch.float32, device=rows.device)
        counters = pdl_counters(tiles, rows.device)
    else:
        parts = counters = out
    _skinny_gemm_kernel[(tiles, splits)](
        rows, weight, bias if bias is not None else weight, out, parts, counters,
        m, n, k, k_per_split, rows.stride(0), weight.stride(0), out.stride(0),
        parts.stride(0) if splits > 1 else 0, parts.stride(1) if splits > 1 else 0,
        HAS_BIAS=bias is not None, EVEN_K=k % launch.block_k == 0, BLOCK_M=block_m, BLOCK_N=launch.block_n,
        BLOCK_K=launch.block_k, SPLIT_K=splits,
        DOT_PRECISION="ieee" if rows.dtype == torch.float32 else "tf32",
        TRIGGER=int(launch.trigger), num_warps=launch.num_warps, num_stages=launch.num_stages,
        **pdl.launch_options(rows.device),
    )


def pdl_counters(size: int, device: torch.device) -> torch.Tensor:
    """Zeroed int32 arrival counters of the split-K reduction (persistent; see ``split_counters``)."""
    return split_counters(size, device, owner="skinny_gemm")


def _sm_count(device: torch.device) -> int:
    return _sm_count_of(device) if device.type == "cuda" else 8  # the interpreter: small tests still split K
