"""Linear layers of any number of rows on FP8 or NVFP4 weights.

- ``fp8_gemm``: activations quantized (``fp8_quantize.py``: static with ``input_scale``, else dynamic per
  token), then a
  per-tensor / per-channel FP8 GEMM through ``torch._scaled_mm`` (cuBLASLt per tensor; rowwise scales
  on sm_89+) where it takes the shapes, a Triton tensor-core GEMM otherwise; block-scaled weights
  (``block_size=(bn, bk)``, DeepSeek-V3 / Qwen3) with activations per 1 x bk group through the
  Triton GEMM, which applies each K block's scales to that block's partial product (torch 2.9+ has
  blockwise ``_scaled_mm`` on sm_90 with cuBLAS 12.9; ``backend="scaled_mm"`` uses it where it fits,
  the benchmark compares both). ``fp8_gemm_quantized`` takes activations quantized already (by
  ``norm_quantize.py``, fused into the step before the linear). Up to 64 rows the GEMMs split K
  (``GemmLaunch.split_k``) where the output tiles alone would leave SMs idle. Its 16-row tiles are
  too small for sm_90's wgmma (64 rows a warpgroup): Triton runs them on mma.sync, converting both
  e4m3 operands to fp16 in the loop (~3.6 SASS instructions per weight byte); ``fp8_small_m.py``
  swaps the operands so that the weight's features fill wgmma's 64 (~1.0) for decode rows.
- ``nvfp4_gemm`` and ``fp8_weight_only_gemm``: weight-only, x stays in bf16/fp16; each weight tile
  is converted to x's dtype in registers (FP8 exactly; NVFP4 by ``e2m1.nvfp4_block_dequantize``,
  exact in fp16 and bf16) and multiplied on the tensor cores, one kernel for both
  (``_weight_only_gemm_kernel``, scales as ``quant_gemv.ScaleLayout`` describes them). At 16 rows this
  is the tensor-core alternative to the CUDA-core GEMVs of ``quant_gemv.py`` (the benchmark runs both).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from . import quant_reference as ref
from .e2m1 import e2m1_ptx, nvfp4_block_dequantize
from .fp8_quantize import fp8_quantize  # noqa: F401  (also this module's: the quantizer of fp8_gemm)
from .quant_gemv import FP8, ScaleLayout, WeightFormat

BACKENDS = ("auto", "triton", "scaled_mm")
# up to this many rows the split-K Triton GEMM beats cuBLASLt's rowwise FP8 GEMM, whose 128 x 128 tiles leave
# SMs idle at decode batches (64 rows, the 8B shapes, H100 2026-12-07: qkv + o + gate_up + down per layer
# 132 us against 146 us, the down projection 41.6 against 53.3)
SCALED_MM_MIN_ROWS = 64



@dataclass(frozen=True)
class GemmLaunch:
    """Tiles of one tensor-core GEMM launch (``block_k`` in elements), a function of the shapes only."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 3
    group_m: int = 8
    split_k: int = 1  # programs per output tile, each over a share of K (fp32 partials, then a reduction)

    @classmethod
    def choose(cls, m: int, n: int = 1 << 20, block_k: int = 128, block_scaled: bool = False,
               k: int = 0) -> "GemmLaunch":
        """16-row tiles for decode batches (mma.sync; 32 features where 64 would leave SMs of an H100
        idle: below 16384 features, e.g. 128 instead of 64 programs at N = 4096), 64 rows up to 64,
        then wgmma tiles of 128 x 128 (64 x 128 with block scales: their second accumulator spills
        registers at 128 x 128, sm_90). Up to 64 rows, K is split (``_split_k``) where the tiles alone
        leave the GPU idle."""
        if m <= 64:
            block_n = 64 if m > 16 or n >= 16384 else 32
            launch = cls(16 if m <= 16 else 64, block_n, block_k, num_warps=4, num_stages=4)
            return replace(launch, split_k=_split_k(triton.cdiv(m, launch.block_m) * triton.cdiv(n, block_n),
                                                    triton.cdiv(k, block_k)))
        if block_scaled:
            return cls(64, 128, block_k, num_warps=4, num_stages=3)
        return cls(128, 128, block_k, num_warps=8, num_stages=3)


# Split-K for decode-sized GEMMs (bench: probe sweep at 16 and 64 rows over the 8B shapes, H100, 2026-12-07):
# splits of K until about 512 programs run, each with at least 8 K tiles, at most 4. At 64 rows the o and down
# projections (64 tiles of 64 features) ran 15.3 and 41.6 us split 4 ways against 18.4 and 59.1 unsplit;
# gate_up's 448 tiles are enough alone (split 2: 54.8 -> 66.7 us).
SPLIT_K_PROGRAMS, SPLIT_K_MIN_TILES, SPLIT_K_MAX = 512, 8, 4


def _split_k(tiles: int, k_tiles: int) -> int:
    split = 1
    while (split * 2 <= SPLIT_K_MAX and tiles * split * 2 <= SPLIT_K_PROGRAMS
           and k_tiles // (split * 2) >= SPLIT_K_MIN_TILES):
        split *= 2
    return split


@triton.jit
def _tile_coordinates(M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """(row tile, column tile) of this program, ``GROUP_M`` row tiles walking the columns together
    so that their weight tiles are read from L2."""
    pid = tl.program_id(0)
    tiles_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * tiles_n
    first_m = (pid // per_group) * GROUP_M
    group_rows = tl.minimum(tl.cdiv(M, BLOCK_M) - first_m, GROUP_M)
    return first_m + (pid % per_group) % group_rows, (pid % per_group) // group_rows


@triton.jit
def _split_range(K, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr):
    """[start, end) of K this program's split covers: whole ``BLOCK_K`` tiles, shared out evenly."""
    per_split = tl.cdiv(tl.cdiv(K, BLOCK_K), SPLIT_K) * BLOCK_K
    start = tl.program_id(1) * per_split
    return start, tl.minimum(start + per_split, K)


@triton.jit
def _store_result(out_ptr, partial_ptr, bias_ptr, acc, rows, cols, M, N, stride_om, HAS_BIAS: tl.constexpr,
                  SPLIT_K: tl.constexpr):
    """The tile's result, or with ``SPLIT_K`` > 1 this split's fp32 partial (``partial[split, M, N]``,
    summed with the bias by ``_sum_partials_kernel``)."""
    if SPLIT_K == 1:
        _store_tile(out_ptr, bias_ptr, acc, rows, cols, M, N, stride_om, HAS_BIAS)
    else:
        mask = (rows < M)[:, None] & (cols < N)[None, :]
        dst = partial_ptr + (tl.program_id(1) * M + rows.to(tl.int64))[:, None] * N + cols[None, :]
        tl.store(dst, acc, mask=mask)


@triton.jit
def _sum_partials_kernel(partial_ptr, bias_ptr, out_ptr, M, N, stride_om, HAS_BIAS: tl.constexpr,
                         SPLIT_K: tl.constexpr, BLOCK: tl.constexpr):
    """out[M, N] = the sum of ``SPLIT_K`` fp32 partials (+ bias), rounded once to out's dtype."""
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offsets < M * N
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for split in tl.static_range(SPLIT_K):
        acc += tl.load(partial_ptr + split * M * N + offsets, mask=ok, other=0.0)
    cols = offsets % N
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + (offsets // N).to(tl.int64) * stride_om + cols, acc.to(out_ptr.dtype.element_ty), mask=ok)


def _launch_gemm(kernel, launch: "GemmLaunch", m: int, n: int, out: torch.Tensor, bias, args: tuple, **meta):
    """Run one tensor-core GEMM kernel over its (tile, split) grid; with ``split_k`` > 1 through fp32
    partials and their reduction (bias added there)."""
    split = launch.split_k
    partial = out.new_empty((split, m, n), dtype=torch.float32) if split > 1 else out
    grid = (triton.cdiv(m, launch.block_m) * triton.cdiv(n, launch.block_n), split)
    kernel[grid](*args, partial, HAS_BIAS=bias is not None and split == 1, SPLIT_K=split,
                 BLOCK_M=launch.block_m, BLOCK_N=launch.block_n, BLOCK_K=launch.block_k, GROUP_M=launch.group_m,
                 num_warps=launch.num_warps, num_stages=launch.num_stages, **meta)
    if split > 1:
        block = 1024
        _sum_partials_kernel[(triton.cdiv(m * n, block),)](
            partial, bias if bias is not None else out, out, m, n, out.stride(0), HAS_BIAS=bias is not None,
            SPLIT_K=split, BLOCK=block)


@triton.jit
def _store_tile(out_ptr, bias_ptr, acc, rows, cols, M, N, stride_om, HAS_BIAS: tl.constexpr):
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
    mask = (rows < M)[:, None] & (cols < N)[None, :]
    dst = out_ptr + rows.to(tl.int64)[:, None] * stride_om + cols[None, :]
    tl.store(dst, acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _fp8_gemm_kernel(
    a_ptr, b_ptr, a_scale_ptr, b_scale_ptr, bias_ptr, out_ptr, M, N, K,
    stride_am, stride_bn, stride_om, stride_asm, stride_ask, stride_bsn, stride_bsk, scale_rows, scale_cols,
    partial_ptr, BLOCK_SCALED: tl.constexpr, HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    """e4m3 a [M, K] (bytes) times e4m3 b [N, K] (bytes), transposed: row scales of a times column
    scales of b after the loop, or (``BLOCK_SCALED``) the scales of each K block of ``scale_cols``
    columns on that block's partial product."""
    tile_m, tile_n = _tile_coordinates(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    rows = tile_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    a_tile = a_ptr + rows.to(tl.int64)[:, None] * stride_am + ks[None, :]
    b_tile = b_ptr + cols.to(tl.int64)[:, None] * stride_bn + ks[None, :]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    k_start, k_end = _split_range(K, BLOCK_K, SPLIT_K)
    for k0 in range(k_start, k_end, BLOCK_K):
        k_ok = (k0 + ks < k_end)[None, :]
        a = tl.load(a_tile + k0, mask=(rows < M)[:, None] & k_ok, other=0).to(tl.float8e4nv, bitcast=True)
        b = tl.load(b_tile + k0, mask=(cols < N)[:, None] & k_ok, other=0).to(tl.float8e4nv, bitcast=True)
        if BLOCK_SCALED:
            block = k0 // scale_cols
            a_scale = tl.load(a_scale_ptr + rows * stride_asm + block * stride_ask, mask=rows < M, other=0.0)
            b_scale = tl.load(b_scale_ptr + (cols // scale_rows) * stride_bsn + block * stride_bsk,
                              mask=cols < N, other=0.0)
            acc += tl.dot(a, tl.trans(b)) * a_scale[:, None] * b_scale[None, :]
        else:
            acc = tl.dot(a, tl.trans(b), acc)
    if not BLOCK_SCALED:
        acc *= tl.load(a_scale_ptr + rows * stride_asm, mask=rows < M, other=0.0)[:, None]
        acc *= tl.load(b_scale_ptr + cols * stride_bsn, mask=cols < N, other=0.0)[None, :]
    _store_result(out_ptr, partial_ptr, bias_ptr, acc, rows, cols, M, N, stride_om, HAS_BIAS, SPLIT_K)


@triton.jit
def _weight_only_gemm_kernel(
    x_ptr, w_ptr, scale_ptr, out_scale_ptr, bias_ptr, out_ptr, M, N, K, stride_xm, stride_wn, stride_om,
    stride_sn, stride_sk, stride_os, scale_rows, scale_cols, out_factor, partial_ptr,
    FORMAT: tl.constexpr, BLOCK_SCALED: tl.constexpr, HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    DOT_PRECISION: tl.constexpr, E2M1_PTX: tl.constexpr,
):
    """x [M, K] times a quantized weight [N, K] transposed (scales read as ``quant_gemv.ScaleLayout``
    says), each weight tile converted to x's dtype in registers for the tensor cores: FP8 exactly,
    NVFP4 through ``nvfp4_block_dequantize`` (exact in fp16 and bf16); block-scaled FP8 multiplies
    each K tile's product by its scales (``BLOCK_K`` divides the scale block)."""
    tile_m, tile_n = _tile_coordinates(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    rows = tile_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    w_bytes: tl.constexpr = BLOCK_K if FORMAT == FP8 else BLOCK_K // 2
    bs = tl.arange(0, w_bytes)
    x_tile = x_ptr + rows.to(tl.int64)[:, None] * stride_xm + ks[None, :]
    w_tile = w_ptr + cols.to(tl.int64)[:, None] * stride_wn + bs[None, :]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    k_start, k_end = _split_range(K, BLOCK_K, SPLIT_K)
    for k0 in range(k_start, k_end, BLOCK_K):
        x = tl.load(x_tile + k0, mask=(rows < M)[:, None] & (k0 + ks < K)[None, :], other=0.0)
        b0 = k0 * w_bytes // BLOCK_K  # the tile's first byte
        w_mask = (cols < N)[:, None] & (b0 + bs < K * w_bytes // BLOCK_K)[None, :]
        w = tl.load(w_tile + b0, mask=w_mask, other=0)
        if FORMAT == FP8:
            w = w.to(tl.float8e4nv, bitcast=True).to(x.dtype)
            if BLOCK_SCALED:
                scale = tl.load(scale_ptr + (cols // scale_rows) * stride_sn + (k0 // scale_cols) * stride_sk,
                                mask=cols < N, other=0.0)
                acc += tl.dot(x, tl.trans(w), input_precision=DOT_PRECISION) * scale[None, :]
            else:
                acc = tl.dot(x, tl.trans(w), acc, input_precision=DOT_PRECISION)
        else:
            blocks = k0 // 16 + tl.arange(0, BLOCK_K // 16)
            scale = tl.load(scale_ptr + cols.to(tl.int64)[:, None] * stride_sn + blocks[None, :] * stride_sk,
                            mask=(cols < N)[:, None] & (blocks * 16 < K)[None, :], other=0.0)
            w = tl.reshape(nvfp4_block_dequantize(w, scale, BLOCK_N, BLOCK_K, E2M1_PTX), [BLOCK_N, BLOCK_K])
            acc = tl.dot(x, tl.trans(w.to(x.dtype)), acc, input_precision=DOT_PRECISION)
    if not BLOCK_SCALED:
        acc *= tl.load(out_scale_ptr + cols * stride_os, mask=cols < N, other=0.0)[None, :]
    _store_result(out_ptr, partial_ptr, bias_ptr, acc * out_factor, rows, cols, M, N, stride_om, HAS_BIAS,
                  SPLIT_K)


def fp8_gemm(x: torch.Tensor, weight_fp8: torch.Tensor, weight_scale: torch.Tensor,
             input_scale: torch.Tensor | None = None, block_size=None, bias: torch.Tensor | None = None, *,
             backend: str = "auto", launch: GemmLaunch | None = None) -> torch.Tensor:
    """``quantize(x) @ dequantize(weight_fp8, weight_scale).T + bias`` for x [..., K], in x's dtype.

    Activations: static per tensor with ``input_scale`` (one fp32 value), per 1 x bk group with
    ``block_size=(bn, bk)`` (then ``weight_scale`` is [ceil(N / bn), ceil(K / bk)]), else dynamic per
    token. ``backend``: ``"auto"`` (``torch._scaled_mm`` for per-tensor / per-channel scales where it
    takes the shapes and there are more than ``SCALED_MM_MIN_ROWS`` rows, Triton otherwise),
    ``"triton"`` or ``"scaled_mm"``.
    """
    kind = ref.fp8_scale_kind(weight_fp8, weight_scale, block_size, "fp8_gemm")
    n, k = weight_fp8.shape
    ref.check_activations(x, k, "fp8_gemm")
    ref.check_bias(bias, n, "fp8_gemm")
    if input_scale is not None and kind == "block":
        raise ValueError("fp8_gemm: block-scaled weights take activations quantized per 1 x bk group; "
                         "input_scale must be None")
    rows = x.reshape(-1, k)
    x_fp8, x_scale = fp8_quantize(rows, input_scale, int(block_size[1]) if kind == "block" else None)
    out = _fp8_gemm_of_quantized(x_fp8, x_scale, weight_fp8, weight_scale, kind, block_size, bias, x.dtype, backend,
                                 launch)
    return out.view(*x.shape[:-1], n)


def fp8_gemm_quantized(x_fp8: torch.Tensor, x_scale: torch.Tensor, weight_fp8: torch.Tensor,
                       weight_scale: torch.Tensor, bias: torch.Tensor | None = None, *, out_dtype: torch.dtype,
                       backend: str = "auto", launch: GemmLaunch | None = None) -> torch.Tensor:
    """``fp8_gemm`` of activations quantized already (``norm_quantize``: the step before the linear and
    the quantizer in one kernel): ``x_fp8`` [M, K] e4m3, ``x_scale`` [M, 1] per token or one static fp32
    value; per-tensor or per-channel weight scales. [M, N] in ``out_dtype``."""
    kind = ref.fp8_scale_kind(weight_fp8, weight_scale, None, "fp8_gemm_quantized")
    n, k = weight_fp8.shape
    ref.check_bias(bias, n, "fp8_gemm_quantized")
    if x_fp8.dtype != torch.float8_e4m3fn or x_fp8.dim() != 2 or x_fp8.shape[1] != k:
        raise ValueError(f"fp8_gemm_quantized: x_fp8 must be float8_e4m3fn [M, {k}], got {x_fp8.dtype} "
                         f"{tuple(x_fp8.shape)}")
    if x_scale.numel() not in (1, x_fp8.shape[0]) or x_scale.dtype != torch.float32:
        raise ValueError(f"fp8_gemm_quantized: x_scale must be fp32, one value or one per row; got {x_scale.dtype} "
                         f"{tuple(x_scale.shape)} for {x_fp8.shape[0]} rows")
    return _fp8_gemm_of_quantized(x_fp8, x_scale, weight_fp8, weight_scale, kind, None, bias, out_dtype, backend,
                                  launch)


def _fp8_gemm_of_quantized(x_fp8, x_scale, weight_fp8, weight_scale, kind: str, block_size, bias, out_dtype,
                           backend: str, launch: GemmLaunch | None) -> torch.Tensor:
    if backend not in BACKENDS:
        raise ValueError(f"fp8_gemm: backend must be one of {BACKENDS}, got {backend!r}")
    (m, k), n = x_fp8.shape, weight_fp8.shape[0]
    auto_scaled_mm = (backend == "auto" and kind != "block" and m > SCALED_MM_MIN_ROWS
                      and _scaled_mm_fits(x_fp8, out_dtype, n, k))
    if backend == "scaled_mm" or auto_scaled_mm:
        return _scaled_mm(x_fp8, x_scale, weight_fp8, weight_scale, kind, bias, out_dtype)
    launch = _gemm_launch(m, n, k, kind, block_size, launch)
    return _fp8_gemm_triton(x_fp8, x_scale, weight_fp8, weight_scale, kind, block_size, bias, out_dtype, launch)


def _gemm_launch(m: int, n: int, k: int, kind: str, block_size, launch: GemmLaunch | None,
                 what: str = "fp8_gemm") -> GemmLaunch:
    """The Triton GEMM's tiles; with block scales, K tiles that never straddle a scale block."""
    if kind != "block":
        return launch or GemmLaunch.choose(m, n, k=k)
    scale_cols = int(block_size[1])
    block_k = min(128, scale_cols & -scale_cols)  # the largest power of two dividing it
    if block_k < 16:
        raise ValueError(f"{what}: a scale block of {scale_cols} columns is not a multiple of 16")
    launch = launch or GemmLaunch.choose(m, n, block_k, block_scaled=True, k=k)
    if scale_cols % launch.block_k:
        raise ValueError(f"{what}: block_k {launch.block_k} must divide the scale block's {scale_cols} "
                         f"columns")
    return launch


def _scaled_mm_fits(x: torch.Tensor, out_dtype: torch.dtype, n: int, k: int) -> bool:
    """Where ``torch._scaled_mm`` takes the GEMM: CUDA sm_89+, bf16 output (its rowwise kernel's
    dtype on every torch we allow), K and N multiples of 16."""
    return (x.is_cuda and out_dtype == torch.bfloat16 and k % 16 == 0 and n % 16 == 0
            and torch.cuda.get_device_capability(x.device) >= (8, 9))


def _scaled_mm(x_fp8, x_scale, weight, weight_scale, kind: str, bias, out_dtype) -> torch.Tensor:
    m, n = x_fp8.shape[0], weight.shape[0]
    if kind == "block":  # cuBLASLt 1 x 128 activations x 128 x 128 weights; scales K-block-major
        scale_a, scale_b = x_scale, weight_scale.t()
    elif kind == "tensor" and x_scale.numel() == 1:
        scale_a, scale_b = x_scale.reshape(()), weight_scale.reshape(())
    else:  # rowwise: a per-tensor scale on either side repeats along its dimension
        scale_a = x_scale.reshape(-1, 1).expand(m, 1).contiguous()
        scale_b = weight_scale.reshape(1, -1).expand(1, n).contiguous()
    fused_bias = bias if bias is not None and bias.dtype == out_dtype and kind != "block" else None
    out = torch._scaled_mm(x_fp8, weight.t(), scale_a, scale_b, bias=fused_bias, out_dtype=out_dtype)
    return out if bias is None or fused_bias is not None else (out.float() + bias.float()).to(out_dtype)


def _fp8_gemm_triton(x_fp8, x_scale, weight, weight_scale, kind: str, block_size, bias, out_dtype,
                     launch: GemmLaunch) -> torch.Tensor:
    m, (n, k) = x_fp8.shape[0], weight.shape
    if kind == "block":
        scale_rows, scale_cols = int(block_size[0]), int(block_size[1])
        a_strides, b_strides = x_scale.stride(), weight_scale.stride()
    else:
        scale_rows, scale_cols = 1, k
        a_strides = (x_scale.stride(0) if x_scale.numel() > 1 else 0, 0)
        b_strides = (weight_scale.reshape(-1).stride(0) if kind == "channel" else 0, 0)
        weight_scale = weight_scale.reshape(-1)
    out = torch.empty((m, n), dtype=out_dtype, device=x_fp8.device)
    if m and n:
        _launch_gemm(_fp8_gemm_kernel, launch, m, n, out, bias, (
            x_fp8.view(torch.uint8), weight.view(torch.uint8), x_scale, weight_scale,
            bias if bias is not None else out, out, m, n, k, x_fp8.stride(0), weight.stride(0), out.stride(0),
            *a_strides, *b_strides, scale_rows, scale_cols), BLOCK_SCALED=kind == "block")
    return out


def nvfp4_gemm(x: torch.Tensor, weight_packed: torch.Tensor, weight_scale: torch.Tensor,
               weight_scale_2: torch.Tensor, bias: torch.Tensor | None = None, *,
               launch: GemmLaunch | None = None) -> torch.Tensor:
    """``x @ dequantize(W).T + bias`` for x [..., K] (bf16/fp16; fp32 for tests) and a ModelOpt NVFP4
    weight (``quant_reference``), weight-only: the tensor cores multiply x by dequantized tiles."""
    scales = ScaleLayout.nvfp4(weight_packed, weight_scale, weight_scale_2, "nvfp4_gemm")
    if launch is not None and (launch.block_k % 16 or launch.block_k < 32):
        raise ValueError(f"nvfp4_gemm: block_k must be a multiple of 16 of at least 32, got {launch.block_k}")
    return _weight_only(x, weight_packed, 2 * weight_packed.shape[1], scales, WeightFormat.NVFP4, bias,
                        launch, "nvfp4_gemm")


def fp8_weight_only_gemm(x: torch.Tensor, weight_fp8: torch.Tensor, weight_scale: torch.Tensor,
                         block_size=None, bias: torch.Tensor | None = None, *,
                         launch: GemmLaunch | None = None) -> torch.Tensor:
    """What ``fp8_gemv`` computes (x unquantized times the dequantized FP8 weight), for any number of
    rows, on the tensor cores: each weight tile converted to x's dtype in registers (decode batches
    stream the weight once; x is not quantized, unlike ``fp8_gemm``)."""
    scales = ScaleLayout.fp8(weight_fp8, weight_scale, block_size, "fp8_weight_only_gemm")
    if scales.block_scaled:
        rows = x.numel() // max(x.shape[-1], 1)
        launch = _gemm_launch(rows, *weight_fp8.shape, "block", block_size, launch, "fp8_weight_only_gemm")
    return _weight_only(x, weight_fp8.view(torch.uint8), weight_fp8.shape[1], scales, WeightFormat.FP8, bias,
                        launch, "fp8_weight_only_gemm")


def _weight_only(x, weight, k: int, scales: ScaleLayout, fmt: WeightFormat, bias, launch: GemmLaunch | None,
                 what: str) -> torch.Tensor:
    n = weight.shape[0]
    ref.check_activations(x, k, what)
    ref.check_bias(bias, n, what)
    rows = x.reshape(-1, k)
    rows = rows if rows.stride(-1) == 1 else rows.contiguous()
    m = rows.shape[0]
    launch = launch or GemmLaunch.choose(m, n, k=k)
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m and n:
        _launch_gemm(_weight_only_gemm_kernel, launch, m, n, out, bias, (
            rows, weight, scales.scale, scales.out_scale, bias if bias is not None else out, out, m, n, k,
            rows.stride(0), weight.stride(0), out.stride(0), *scales.kernel_args()),
            FORMAT=int(fmt), BLOCK_SCALED=scales.block_scaled,
            DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32", E2M1_PTX=e2m1_ptx(x.device))
    return out.view(*x.shape[:-1], n)
