"""FP8 x FP8 linear layers of a few rows (decode batches) on the tensor cores, swap-AB.

``out[M, N] = (x_fp8[M, K] * x_scale) @ (W[N, K] * w_scale).T (+ bias)`` for activations quantized
already (per token, or one static scale: ``norm_quantize.py`` in the step before, or ``fp8_quantize``)
and per-tensor or per-channel weight scales: what ``quant_gemm.fp8_gemm_quantized`` computes, for the
rows where a decode step is its weight stream.

Each program computes ``out^T`` for ``BLOCK_N`` output features and ``BLOCK_M`` rows: ``tl.dot(W tile,
x tile^T)``, so the weight's features fill the MMA's M dimension (64 per warpgroup: sm_90's wgmma on
e4m3 operands) and the few rows its N (16, the least ``tl.dot`` takes). The weight bytes go from global
to shared memory (``cp.async``, ``num_stages`` deep), then by ``ldmatrix`` into the wgmma unconverted:
~1 SASS instruction per weight byte in the loop (per thread; ``bench/probes/fp8_small_m.py --sass``)
against ~6.7 for the CUDA-core GEMV (``quant_gemv.py``) and ~5.8 for the weight-only GEMM (fp8 ->
bf16 per element). The GPU has to be filled by weight rows alone, so K is split (``SmallMLaunch.choose``)
where the features' tiles leave SMs idle; the splits' fp32 partials are summed in the same launch by
the last split of each tile to arrive (per-tile arrival counters, as the paged attention merges its
splits), which then applies the scales and the bias: one launch per linear, capturable in a CUDA
graph (no host sync; the counters are zero again after every launch). Launched with PDL on sm_90+:
the programs wait for the kernel before them (which wrote x) and let the next one launch after that.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from . import pdl
from . import quant_reference as ref
from .paged_attention import _arrive, split_counters

MAX_ROWS = 64  # the largest row tile (16, 32 or 64 rows); more rows take more row tiles


@dataclass(frozen=True)
class SmallMLaunch:
    """Tiles of one swap-AB launch: ``block_n`` features x ``block_k`` bytes of K per step, the rows
    padded to ``block_m``; ``split_k`` programs per feature tile."""

    block_n: int = 64
    block_k: int = 128
    block_m: int = 16
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 4
    prefetch: int = 0  # K tiles of each split asked into L2 before the PDL wait (PDL launches only)

    @classmethod
    def choose(cls, m: int, n: int, k: int, programs: int = 528, block_n: int = 64,
               block_k: int = 128) -> "SmallMLaunch":
        """Rows padded to 16/32/64 (row tiles of 64 beyond); K split in halves while the launch has fewer
        than ``programs`` programs (four per SM of an H100) and each split keeps at least 4 K tiles, at
        most 8 ways; each split's first 4 K tiles prefetched into L2 before the PDL wait (as the GEMVs
        load their first tile before it)."""
        block_m = min(MAX_ROWS, max(16, triton.next_power_of_2(m)))
        tiles, k_tiles, split = triton.cdiv(n, block_n), triton.cdiv(k, block_k), 1
        while split < 8 and tiles * split * 2 <= programs and k_tiles // (split * 2) >= 4:
            split *= 2
        return cls(block_n, block_k, block_m, split, prefetch=4 if block_k >= 128 else 0)


@triton.jit(do_not_specialize=["M"])  # one compile for every decode batch
def _fp8_small_m_kernel(
    w_ptr, x_ptr, w_scale_ptr, x_scale_ptr, bias_ptr, out_ptr, partial_ptr, counters_ptr,
    M, N, K, stride_wn, stride_xm, stride_om, stride_ws, stride_xs,
    HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr, EVEN_K: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr, PREFETCH: tl.constexpr,
):
    """One (feature tile, K split, row tile): ``out^T`` (module doc); e4m3 operands passed as bytes.
    Rows past M read row M - 1 (a valid address, no mask in the loop) and are not stored."""
    tile_n, split, tile_m = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    cols = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tile_m * BLOCK_M + tl.arange(0, BLOCK_M)
    ks = tl.arange(0, BLOCK_K)
    w_tile = w_ptr + tl.minimum(cols, N - 1).to(tl.int64)[:, None] * stride_wn + ks[None, :]
    x_tile = x_ptr + tl.minimum(rows, M - 1).to(tl.int64)[:, None] * stride_xm + ks[None, :]
    per_split = tl.cdiv(tl.cdiv(K, BLOCK_K), SPLIT_K) * BLOCK_K
    k_start = split * per_split
    k_end = tl.minimum(k_start + per_split, K)
    if PREFETCH:  # the split's first K tiles into L2 while the previous kernel runs (no kernel writes weights)
        _prefetch_l2(w_ptr, cols, N, stride_wn, k_start, k_end, PREFETCH * BLOCK_K)
    pdl.wait(PDL)  # x is the previous kernel's output
    pdl.allow_dependents(PDL)
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        if EVEN_K:
            w = tl.load(w_tile + k0)
            x = tl.load(x_tile + k0)
        else:
            k_ok = (k0 + ks < k_end)[None, :]
            w = tl.load(w_tile + k0, mask=k_ok, other=0)
            x = tl.load(x_tile + k0, mask=k_ok, other=0)
        acc = tl.dot(w.to(tl.float8e4nv, bitcast=True), tl.trans(x.to(tl.float8e4nv, bitcast=True)), acc)
    if SPLIT_K == 1:
        _store_out(acc, out_ptr, w_scale_ptr, x_scale_ptr, bias_ptr, cols, rows, M, N, stride_om, stride_ws,
                   stride_xs, HAS_BIAS)
    else:  # fp32 partials [SPLIT_K, M, N]; the last split of the tile to arrive sums them
        mask = (cols < N)[:, None] & (rows < M)[None, :]
        partials = partial_ptr + rows.to(tl.int64)[None, :] * N + cols[:, None]
        tl.store(partials + split * M * N, acc, mask=mask)
        counter = counters_ptr + tile_n * tl.num_programs(2) + tile_m
        if _arrive(counter) == SPLIT_K - 1:
            total = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
            for s in tl.static_range(SPLIT_K):  # .cg: past L1, which may hold no other split's stores
                total += tl.load(partials + s * M * N, mask=mask, other=0.0, cache_modifier=".cg")
            _store_out(total, out_ptr, w_scale_ptr, x_scale_ptr, bias_ptr, cols, rows, M, N, stride_om,
                       stride_ws, stride_xs, HAS_BIAS)
            tl.atomic_xchg(counter, 0, sem="relaxed", scope="gpu")


@triton.jit
def _prefetch_l2(w_ptr, cols, N, stride_wn, k_start, k_end, BYTES: tl.constexpr):
    """``prefetch.global.L2`` of each 128-byte line of the first ``BYTES`` of this split's weight rows
    (addresses clamped into the split: nothing past the weight is touched)."""
    lines = tl.minimum(k_start + tl.arange(0, BYTES // 128) * 128, k_end - 1)
    ptrs = w_ptr + tl.minimum(cols, N - 1).to(tl.int64)[:, None] * stride_wn + lines[None, :]
    tl.inline_asm_elementwise("prefetch.global.L2 [$1];\n mov.u32 $0, 0;", "=r,l", [ptrs], dtype=tl.int32,
                              is_pure=False, pack=1)


@triton.jit
def _store_out(acc, out_ptr, w_scale_ptr, x_scale_ptr, bias_ptr, cols, rows, M, N, stride_om, stride_ws,
               stride_xs, HAS_BIAS: tl.constexpr):
    """out[rows, cols] = acc^T times the weight's and the rows' scales (stride 0: one value), + bias."""
    col_ok, row_ok = cols < N, rows < M
    acc *= tl.load(w_scale_ptr + cols * stride_ws, mask=col_ok, other=0.0)[:, None]
    acc *= tl.load(x_scale_ptr + rows * stride_xs, mask=row_ok, other=0.0)[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[:, None]
    dst = out_ptr + rows.to(tl.int64)[None, :] * stride_om + cols[:, None]
    tl.store(dst, acc.to(out_ptr.dtype.element_ty), mask=col_ok[:, None] & row_ok[None, :])


def fp8_small_m_gemm(x_fp8: torch.Tensor, x_scale: torch.Tensor, weight_fp8: torch.Tensor,
                     weight_scale: torch.Tensor, bias: torch.Tensor | None = None, *, out_dtype: torch.dtype,
                     launch: SmallMLaunch | None = None) -> torch.Tensor:
    """``quant_gemm.fp8_gemm_quantized`` on the swap-AB kernel (module doc): ``x_fp8`` [M, K] e4m3 with
    ``x_scale`` [M, 1] per token or one static fp32 value, ``weight_fp8`` [N, K] e4m3 with a per-tensor or
    per-channel fp32 ``weight_scale``; [M, N] in ``out_dtype``. Any M (row tiles of at most 64)."""
    what = "fp8_small_m_gemm"
    kind = ref.fp8_scale_kind(weight_fp8, weight_scale, None, what)
    (n, k), m = weight_fp8.shape, x_fp8.shape[0] if x_fp8.dim() == 2 else -1
    ref.check_bias(bias, n, what)
    if x_fp8.dtype != torch.float8_e4m3fn or x_fp8.dim() != 2 or x_fp8.shape[1] != k:
        raise ValueError(f"{what}: x_fp8 must be float8_e4m3fn [M, {k}], got {x_fp8.dtype} {tuple(x_fp8.shape)}")
    if x_scale.dtype != torch.float32 or x_scale.numel() not in (1, m):
        raise ValueError(f"{what}: x_scale must be fp32, one value or one per row; got {x_scale.dtype} "
                         f"{tuple(x_scale.shape)} for {m} rows")
    launch = launch or SmallMLaunch.choose(m, n, k)
    if launch.block_m not in (16, 32, 64) or launch.block_n < 16 or launch.block_k < 32:
        raise ValueError(f"{what}: block_m must be 16, 32 or 64, block_n at least 16 and block_k at least 32; "
                         f"got {launch}")
    if launch.prefetch not in (0, 1, 2, 4, 8) or (launch.prefetch and launch.block_k < 128):
        raise ValueError(f"{what}: prefetch must be 0, 1, 2, 4 or 8 K tiles of at least 128 bytes; got {launch}")
    out = torch.empty((m, n), dtype=out_dtype, device=x_fp8.device)
    if m and n:
        _launch(x_fp8, x_scale, weight_fp8, weight_scale.reshape(-1), kind, bias, out, launch)
    return out


def _launch(x_fp8, x_scale, weight, weight_scale, kind: str, bias, out, launch: SmallMLaunch) -> None:
    (m, k), n = x_fp8.shape, weight.shape[0]
    grid = (triton.cdiv(n, launch.block_n), launch.split_k, triton.cdiv(m, launch.block_m))
    split = launch.split_k > 1
    partial = out.new_empty((launch.split_k, m, n), dtype=torch.float32) if split else out
    counters = split_counters(grid[0] * grid[2], out.device, owner="fp8_small_m") if split else out
    x = x_fp8 if x_fp8.stride(-1) == 1 else x_fp8.contiguous()
    options = pdl.launch_options(out.device)
    _fp8_small_m_kernel[grid](
        weight.view(torch.uint8), x.view(torch.uint8), weight_scale, x_scale, bias if bias is not None else out,
        out, partial, counters, m, n, k, weight.stride(0), x.stride(0), out.stride(0),
        weight_scale.stride(0) if kind == "channel" else 0,
        x_scale.reshape(-1).stride(0) if x_scale.numel() > 1 else 0,
        HAS_BIAS=bias is not None, SPLIT_K=launch.split_k, EVEN_K=k % launch.block_k == 0,
        BLOCK_N=launch.block_n,
        BLOCK_M=launch.block_m, BLOCK_K=launch.block_k, num_warps=launch.num_warps, num_stages=launch.num_stages,
        PREFETCH=launch.prefetch if options["PDL"] else 0, **options)
