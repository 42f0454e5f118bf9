"""Linear layers of a few rows (decode) on FP8 or NVFP4 weights, dequantized inside the kernel.

``out[M, N] = prologue(x)[M, K] @ dequantize(W).T (+ bias)`` for M <= 4, x in bf16/fp16 (fp32 for tests),
the products accumulated in fp32; the activations stay unquantized (weight-only). The formats and their
references are in ``quant_reference.py``; ``quant_gemm.py`` has the same computation on the tensor
cores (``fp8_weight_only_gemm``, ``nvfp4_gemm``), for any number of rows. The prologue (a ``GemvPrologue``
of ``*_prologue_gemv``) is the bf16 GEMV's, applied as each tile of x loads (``gemv._operand``).

The structure is the bf16 GEMV's (``gemv.py``): one program computes ``BLOCK_N`` output features of
every row over the whole K on the CUDA cores, products accumulated per (row, feature, lane) and
reduced once after the loop, under PDL. A decode step costs its weight stream, so the tiles are
sized in bytes, and each program loads its next weight tile before the products of the current one
(the first before the PDL wait): a tile in flight while it computes.

- FP8 (e4m3): a per-tensor or per-channel scale multiplies each feature's sum once at the end; a
  block scale ``[ceil(N / bn), ceil(K / bk)]`` varies along K, so it multiplies the activations of
  each K block instead (every program's features lie in one row block: ``BLOCK_N`` divides bn).
- NVFP4: each byte holds elements 2j (low nibble) and 2j + 1; ``e2m1_to_fp16`` moves the code's bits
  into an fp16 (the value times 2**-14, exact; on the GPU ``E2M1_ASM`` does four bytes at a time: ``e2m1.py``);
  the products are summed per block of 16 and each sum multiplied by the block's e4m3 scale; the
  2**14 and the global scale multiply the sums at the end. The tensor-core path multiplies the fp16
  values by their scales instead (``nvfp4_block_dequantize``: exact in fp16, at most 8 significant
  bits and at least 2**-24). Hopper has no FP4 arithmetic, so this is the path of every GPU today;
  Blackwell's native FP4 GEMM (``torch._scaled_mm`` on float4_e2m1fn_x2 with swizzled scales) would
  be a second implementation behind ``nvfp4_gemv`` / ``nvfp4_gemm``, chosen by device.

- Prologues (a fused op of ``ops/quant_linear.py`` in one launch): x^2 summed ``SQUARES_FOLD`` lanes to a
  register, ``x + residual`` written before the weight loop (in it: 9 more registers). sm_90 registers at one
  row, none / RMSNorm / add + RMSNorm / gated: FP8 58 / 64 / 72 / 68 (8, 8, 7, 7 programs per SM); NVFP4's one
  row, ``nvfp4_gemv.py``'s word kernel (the same prologues in its ``load_operand``), 64 / 96 / 96 / 64.

SASS of sm_90 (``bench/probes/fp8_small_m.py --sass``: the main loop's instructions per weight byte, per
thread; no GPU needed): the FP8 GEMV's loop spends ~7 instructions per weight byte at one row, the
weight tile passing through shared memory to meet the bf16 activations' register layout, ~12 at four
rows. At one row its speed is bytes in flight, not issue: four adjacent products summed in the thread
(``fold``) shrink the accumulator to 58 registers, 8 programs per SM instead of 6 (docs/perf.md); the weight-only tensor-core GEMM ~5.8 per FP8 weight with 16-row tiles (4.4 with 64), ~7.8 per
NVFP4 element (decode, fp16 -> bf16, scale). At an H200's 4.2 TB/s a weight stream leaves ~8
instructions per FP8 byte (an H100's 3.0 TB/s ~11) and ~4 per NVFP4 element: the NVFP4 kernels are
expected issue-bound. One row of NVFP4 runs ``nvfp4_gemv.py``'s kernel instead of this one (4.95 per
element against 8.81 here: no layout conversion, the packed bytes read as words). With the activations
quantized to FP8 first, ``fp8_small_m.py`` (swap-AB, wgmma on e4m3 operands) spends ~1.0 per weight byte.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from enum import IntEnum

import torch
import triton
import triton.language as tl

from . import nvfp4_gemv as word_gemv
from . import pdl
from . import quant_reference as ref
from .activation import ACTIVATION_IDS
from .e2m1 import E2M1_UNIT, e2m1_pairs_to_fp16, e2m1_ptx
from .gemv import (MAX_ROWS, NO_PROLOGUE, GemvPrologue, Prologue, _accumulate, _inverse_rms, _normalize_rows,
                   _operand, operand_columns, two_pass, unit_stride)
from .pdl import Trigger

class WeightFormat(IntEnum):
    FP8 = 0
    NVFP4 = 1


FP8, NVFP4 = (tl.constexpr(f.value) for f in WeightFormat)
ADD_RMS_NORM = tl.constexpr(Prologue.ADD_RMS_NORM.value)
SQUARES_FOLD = tl.constexpr(8)  # adjacent x^2 summed in the thread: the RMSNorm's accumulator, 1/8 of the lanes
AFTER_LOOP = tl.constexpr(Trigger.AFTER_LOOP.value)


@triton.jit
def _tile_products(acc, w, x, scale_ptr, cols, col_ok, b0, K, stride_sn, stride_sk, block_row, scale_cols,
                   FORMAT: tl.constexpr, BLOCK_SCALED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_B: tl.constexpr, E2M1_PTX: tl.constexpr, FOLD: tl.constexpr):
    """acc += the products of one weight tile ``w`` [BLOCK_N, BLOCK_B] of bytes (uint8: masked lanes load
    as zeros, which no float8 ``other`` can say) from byte column ``b0`` with the operand ``x`` (fp32
    [BLOCK_M, the tile's elements], zero past K)."""
    bs = b0 + tl.arange(0, BLOCK_B)
    if FORMAT == FP8:
        if BLOCK_SCALED:  # the scale of (this program's row block, each column's K block)
            k_scale = tl.load(scale_ptr + block_row * stride_sn + (bs // scale_cols) * stride_sk, mask=bs < K,
                              other=0.0)
            x = x * k_scale[None, :]
        if FOLD == 1:
            acc = _accumulate(acc, w.to(tl.float8e4nv, bitcast=True), x, BLOCK_M)
        else:  # FOLD adjacent products summed in the thread first: a smaller accumulator per weight byte
            products = w.to(tl.float8e4nv, bitcast=True).to(tl.float32) * tl.sum(x, 0)[None, :]
            acc += tl.sum(tl.reshape(products, [BLOCK_N, BLOCK_B // FOLD, FOLD]), 2)
    else:
        # NVFP4: bytes -> elements in order (low nibble first), products summed per block of 16
        # elements, each sum times its block's e4m3 scale: one multiply and one accumulator per block
        w = e2m1_pairs_to_fp16(w, BLOCK_N, BLOCK_B, E2M1_PTX)
        blocks = b0 // 8 + tl.arange(0, BLOCK_B // 8)
        scale = tl.load(scale_ptr + cols[:, None] * stride_sn + blocks[None, :] * stride_sk,
                        mask=col_ok[:, None] & (blocks * 16 < K)[None, :], other=0.0).to(tl.float32)
        if BLOCK_M == 1:
            products = w.to(tl.float32) * tl.sum(x, 0)[None, :]
            acc += tl.sum(tl.reshape(products, [BLOCK_N, BLOCK_B // 8, 16]), 2) * scale
        else:
            products = x[:, None, :] * w.to(tl.float32)[None, :, :]
            acc += tl.sum(tl.reshape(products, [BLOCK_M, BLOCK_N, BLOCK_B // 8, 16]), 3) * scale[None]
    return acc


@triton.jit
def _store_features(acc, sumsq, out_scale_ptr, bias_ptr, out_ptr, rows, row_ok, cols, col_ok, K, stride_om,
                    stride_os, out_factor, eps, BLOCK_M: tl.constexpr, BLOCK_SCALED: tl.constexpr,
                    HAS_BIAS: tl.constexpr, PROLOGUE: tl.constexpr, TWO_PASS: tl.constexpr):
    """The features ``cols`` of every row from their accumulator: lanes summed, scaled (by the norm's
    1/rms too), bias added, stored."""
    out = tl.sum(acc, 1)[None, :] if BLOCK_M == 1 else tl.sum(acc, 2)
    out = _normalize_rows(out, sumsq, K, eps, PROLOGUE, TWO_PASS)
    if not BLOCK_SCALED:  # a per-tensor (stride 0) or per-channel FP8 scale, or the NVFP4 global scale
        out *= tl.load(out_scale_ptr + cols * stride_os, mask=col_ok, other=0.0)[None, :]
    out *= out_factor
    if HAS_BIAS:
        out += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    dst = out_ptr + rows[:, None] * stride_om + cols[None, :]
    tl.store(dst, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


@triton.jit(do_not_specialize=["M"])
def _quant_gemv_kernel(
    x_ptr, res_ptr, norm_w_ptr, w_ptr, scale_ptr, out_scale_ptr, bias_ptr, out_ptr, sum_ptr,
    M, N, K, row_bytes, stride_xm, stride_rm, stride_wn, stride_om, stride_sm, stride_sn, stride_sk, stride_os,
    scale_rows, scale_cols, out_factor, eps,
    FORMAT: tl.constexpr, BLOCK_SCALED: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_B: tl.constexpr,
    PDL: tl.constexpr, TRIGGER: tl.constexpr, PRELOAD: tl.constexpr, E2M1_PTX: tl.constexpr,
    FOLD: tl.constexpr = 1, PROLOGUE: tl.constexpr = 0, ACTIVATION: tl.constexpr = 0, TWO_PASS: tl.constexpr = False,
):
    tl.static_assert(FOLD == 1 or (BLOCK_M == 1 and FORMAT == FP8), "FOLD: FP8 at one row")
    pid = tl.program_id(0)
    cols = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    rows = tl.arange(0, BLOCK_M)
    row_ok = rows < M
    lanes = tl.arange(0, BLOCK_B)
    block_row = (pid * BLOCK_N) // scale_rows
    w_rows = w_ptr + cols.to(tl.int64)[:, None] * stride_wn
    # the next tile's bytes are loaded before the current tile's products: a tile in flight while
    # the program computes (the first one before the wait: no kernel of the step writes weights)
    w_next = pdl.load_around_wait(w_rows + lanes[None, :], col_ok[:, None] & (lanes < row_bytes)[None, :],
                                  tl.zeros([BLOCK_N, BLOCK_B], dtype=w_ptr.dtype.element_ty), PDL, TRIGGER, PRELOAD)
    lanes_acc: tl.constexpr = BLOCK_B // FOLD if FORMAT == FP8 else BLOCK_B // 8  # per byte / per NVFP4 block
    acc = tl.zeros([BLOCK_N, lanes_acc] if BLOCK_M == 1 else [BLOCK_M, BLOCK_N, lanes_acc], dtype=tl.float32)
    # the operand: one element per FP8 byte, two per NVFP4 byte, the prologue applied as gemv.py applies it
    ELEMENTS: tl.constexpr = BLOCK_B if FORMAT == FP8 else 2 * BLOCK_B
    elements = tl.arange(0, ELEMENTS)
    rstd = tl.zeros([BLOCK_M], dtype=tl.float32)
    if TWO_PASS:
        rstd = _inverse_rms(x_ptr, res_ptr, rows, row_ok, K, eps, stride_xm, stride_rm, PROLOGUE, BLOCK_M, ELEMENTS)
    # x^2 per (row, SQUARES_FOLD adjacent lanes): an accumulator of a register or two
    sumsq = tl.zeros([BLOCK_M, ELEMENTS // SQUARES_FOLD], dtype=tl.float32)
    if PROLOGUE == ADD_RMS_NORM:  # x + residual, written before the loop (in it: 9 more registers), a tile a program
        for k0 in range(pid * ELEMENTS, K, tl.num_programs(0) * ELEMENTS):
            ks = k0 + elements
            _operand(x_ptr, res_ptr, norm_w_ptr, sum_ptr, rows, ks, row_ok[:, None] & (ks < K)[None, :], K, rstd,
                     sumsq, True, stride_xm, stride_rm, stride_sm, PROLOGUE, ACTIVATION, TWO_PASS)
    for b0 in range(0, row_bytes, BLOCK_B):
        w = w_next
        bs = b0 + BLOCK_B + lanes  # past the row on the last iteration: masked, nothing read
        w_next = tl.load(w_rows + bs[None, :], mask=col_ok[:, None] & (bs < row_bytes)[None, :], other=0)
        ks = b0 * (ELEMENTS // BLOCK_B) + elements
        x, sumsq = _operand(x_ptr, res_ptr, norm_w_ptr, sum_ptr, rows, ks, row_ok[:, None] & (ks < K)[None, :], K,
                            rstd, sumsq, False, stride_xm, stride_rm, stride_sm, PROLOGUE, ACTIVATION, TWO_PASS)
        acc = _tile_products(acc, w, x.to(tl.float32), scale_ptr, cols, col_ok, b0, K, stride_sn, stride_sk,
                             block_row, scale_cols, FORMAT, BLOCK_SCALED, BLOCK_M, BLOCK_N, BLOCK_B, E2M1_PTX, FOLD)
    if TRIGGER == AFTER_LOOP:
        pdl.allow_dependents(PDL)
    _store_features(acc, sumsq, out_scale_ptr, bias_ptr, out_ptr, rows, row_ok, cols, col_ok, K, stride_om, stride_os,
                    out_factor, eps, BLOCK_M, BLOCK_SCALED, HAS_BIAS, PROLOGUE, TWO_PASS)


@dataclass(frozen=True)
class QuantGemvLaunch:
    """Tile sizes of one launch: ``block_n`` features x ``block_b`` weight bytes per row (shapes only);
    ``fold`` (FP8, one row): that many adjacent products summed in the thread before the accumulator,
    which then holds ``block_b / fold`` lanes per feature: fewer registers per weight byte in flight."""

    block_n: int
    block_b: int
    num_warps: int = 4
    trigger: Trigger = Trigger.AFTER_WAIT  # as the bf16 GEMV (gemv.GemvLaunch)
    preload: bool = True
    fold: int = 1

    @classmethod
    def choose(cls, fmt: WeightFormat, row_bytes: int, rows: int = 1, block_rows: int | None = None,
               nvfp4_words: bool = True) -> "QuantGemvLaunch":
        """One row: FP8 4 features x 1024 bytes, 4 products folded (the accumulator of 4 x 256 lanes: 58
        registers, 8 programs per SM; the fold of 1 took 80 and 6, and an 8B layer's linears 7% longer on an
        H100), NVFP4 4 x 1024 bytes on 2 warps (``nvfp4_gemv.py``: one thread a feature's 16 bytes, 64
        registers; ``nvfp4_words=False``, the byte kernel below: 4 x 512 on 4 warps); up to four rows: 16 x 128
        bytes. ``block_rows``: the weight rows of one FP8 scale block, which ``block_n`` must divide. ``FP8_GEMV_TILE`` (set from
        ``AUTODEPLOY_FP8_GEMV_TILE="block_n,block_b,num_warps,fold"``) replaces FP8's one-row tile: a
        measurement knob (``bench/probes/quant_kernels.py --sweep`` times candidates)."""
        one_row_fp8 = rows == 1 and fmt == WeightFormat.FP8
        if rows > 1:
            block_n, block_b, warps, fold = 16, 128, 4, 1
        else:
            nvfp4 = (4, 1024, 2, 1) if nvfp4_words else (4, 512, 4, 1)
            block_n, block_b, warps, fold = (4, 1024, 4, 4) if one_row_fp8 else nvfp4
        if one_row_fp8 and FP8_GEMV_TILE is not None and block_rows is None:
            block_n, block_b, warps, fold = FP8_GEMV_TILE
        if block_rows is not None:
            block_n = min(block_n, block_rows & -block_rows)  # the largest power of two dividing it
        block_b = min(block_b, max(16, triton.next_power_of_2(row_bytes)))  # a short row: one tile
        return cls(block_n, block_b, warps, fold=min(fold, block_b))

    def check(self, rows: int, what: str) -> None:
        if self.fold & (self.fold - 1) or self.block_b % self.fold:
            raise ValueError(f"{what}: fold {self.fold} must be a power of two dividing block_b {self.block_b}")
        if self.fold > 1 and rows > 1:
            raise ValueError(f"{what}: fold {self.fold} is for one row, got {rows}")


def tile_from_env(variable: str, fields: str, value: str | None = None) -> tuple[int, ...] | None:
    """A tile knob's integers (``fields`` names them: "block_n,block_b,num_warps,fold"), from ``value`` or else the
    environment variable; None where unset (the GEMV's ``AUTODEPLOY_FP8_GEMV_TILE``, the TMA GEMV's)."""
    value = os.environ.get(variable) if value is None else value
    if not value:
        return None
    try:
        numbers = tuple(int(v) for v in value.split(","))
    except ValueError:
        numbers = ()
    if len(numbers) != len(fields.split(",")):
        raise ValueError(f"{variable}={value!r}: expected {fields}")
    return numbers


FP8_GEMV_TILE = tile_from_env("AUTODEPLOY_FP8_GEMV_TILE", "block_n,block_b,num_warps,fold")
# one row of NVFP4 takes nvfp4_gemv.py's kernel (bytes read as words, no layout conversion; rows that do not start
# on a word keep the byte kernel below): the 8B shape's batch-1 linears 3.355 -> 2.327 ms (H100, 2026-12-07 22:24,
# bench/probes/quant_kernels.py, same run). AUTODEPLOY_NVFP4_WORD_GEMV=0 keeps the byte kernel
NVFP4_WORD_GEMV = os.environ.get("AUTODEPLOY_NVFP4_WORD_GEMV", "1") != "0"
# AUTODEPLOY_FP8_TMA_GEMV=1: one row of a wide FP8 weight (qkv, gate_up) takes fp8_tma_gemv.py's TMA-pipelined
# kernel (H100, 2026-12-08: gate_up 47.9 -> 44.4 µs, qkv 12.5 -> 11.6; off until the engine step is measured with it)
FP8_TMA_GEMV = os.environ.get("AUTODEPLOY_FP8_TMA_GEMV", "0") == "1"


@dataclass(frozen=True)
class ScaleLayout:
    """How the kernels read a weight's scales: block-scaled, ``scale[n // rows, k // cols]`` (strides
    ``stride_n``, ``stride_k``) multiplies each K block's products; otherwise ``out_scale[n *
    stride_out]`` (stride 0: one value) multiplies each output feature's sum; then ``factor``. NVFP4:
    ``scale`` holds the e4m3 block scales (per 16 elements, applied per block by the kernels' NVFP4
    path), ``out_scale`` the global scale (one, or one per row) and ``factor`` the 2**14 of
    ``e2m1_to_fp16``."""

    scale: torch.Tensor
    out_scale: torch.Tensor
    stride_n: int
    stride_k: int
    stride_out: int
    rows: int
    cols: int
    factor: float
    block_scaled: bool

    @classmethod
    def fp8(cls, weight: torch.Tensor, weight_scale: torch.Tensor, block_size, what: str) -> "ScaleLayout":
        kind = ref.fp8_scale_kind(weight, weight_scale, block_size, what)
        n, k = weight.shape
        if kind == "block":
            return cls(weight_scale, weight_scale, *weight_scale.stride(), 0, int(block_size[0]),
                       int(block_size[1]), 1.0, True)
        flat = weight_scale.reshape(-1)
        return cls(flat, flat, 0, 0, flat.stride(0) if kind == "channel" else 0, n, k, 1.0, False)

    @classmethod
    def nvfp4(cls, weight_packed, weight_scale, weight_scale_2, what: str) -> "ScaleLayout":
        n, _ = ref.check_nvfp4(weight_packed, weight_scale, weight_scale_2, what)
        per_row = weight_scale_2.numel() == n and weight_scale_2.dim() == 1
        global_scale = weight_scale_2 if per_row else weight_scale_2.reshape(1)
        return cls(weight_scale, global_scale, weight_scale.stride(0), weight_scale.stride(1),
                   global_scale.stride(0) if per_row else 0, n, ref.NVFP4_GROUP, E2M1_UNIT, False)

    def kernel_args(self) -> tuple:
        """The kernels' ``stride_sn, stride_sk, stride_os, scale_rows, scale_cols, out_factor``."""
        return self.stride_n, self.stride_k, self.stride_out, self.rows, self.cols, self.factor


def fp8_gemv(x: torch.Tensor, weight_fp8: torch.Tensor, weight_scale: torch.Tensor, block_size=None,
             bias: torch.Tensor | None = None, *, launch: QuantGemvLaunch | None = None) -> torch.Tensor:
    """``x @ dequantize(weight_fp8, weight_scale).T + bias`` for x [..., K] of at most 4 rows.

    ``weight_fp8`` float8_e4m3fn [N, K]; ``weight_scale`` fp32 per tensor, per channel ([N]) or per
    block ([ceil(N / bn), ceil(K / bk)] with ``block_size=(bn, bk)``); the result has x's dtype.
    """
    return fp8_prologue_gemv(x, weight_fp8, weight_scale, block_size, bias, launch=launch)[0]


def fp8_prologue_gemv(x: torch.Tensor, weight_fp8: torch.Tensor, weight_scale: torch.Tensor, block_size=None,
                      bias: torch.Tensor | None = None, *, prologue: GemvPrologue = NO_PROLOGUE,
                      launch: QuantGemvLaunch | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(fp8_gemv(prologue(x), ...), x + residual or None)``: x [..., 2K] for ``GATED``, else [..., K]."""
    scales = ScaleLayout.fp8(weight_fp8, weight_scale, block_size, "fp8_gemv")
    n, k = weight_fp8.shape
    rows = _rows(x, operand_columns(k, prologue.kind), bias, n, "fp8_gemv")
    if FP8_TMA_GEMV and rows.shape[0] == 1 and launch is None and prologue.kind == Prologue.NONE:
        from . import fp8_tma_gemv as tma  # (opt-in: its import chain is the FP8 GEMM's)

        if tma.takes(weight_fp8, scales):
            return tma.fp8_tma_gemv(x, weight_fp8, weight_scale, bias), None
    block_rows = scales.rows if scales.block_scaled else None
    launch = launch or QuantGemvLaunch.choose(WeightFormat.FP8, k, rows.shape[0], block_rows)
    launch.check(rows.shape[0], "fp8_gemv")
    if scales.block_scaled and scales.rows % launch.block_n:
        raise ValueError(f"fp8_gemv: block_n {launch.block_n} must divide the scale block's "
                         f"{scales.rows} rows")
    return _launch(x, rows, weight_fp8.view(torch.uint8), scales, bias, WeightFormat.FP8, k, launch, prologue,
                   "fp8_gemv")


def nvfp4_gemv(x: torch.Tensor, weight_packed: torch.Tensor, weight_scale: torch.Tensor,
               weight_scale_2: torch.Tensor, bias: torch.Tensor | None = None, *,
               launch: QuantGemvLaunch | None = None) -> torch.Tensor:
    """``x @ dequantize(W).T + bias`` for x [..., K] of at most 4 rows and a ModelOpt NVFP4 weight:
    ``weight_packed`` uint8 [N, K // 2], ``weight_scale`` float8_e4m3fn [N, K // 16],
    ``weight_scale_2`` fp32 (one value, or one per row: fused parts with their own global scales)."""
    return nvfp4_prologue_gemv(x, weight_packed, weight_scale, weight_scale_2, bias, launch=launch)[0]


def nvfp4_prologue_gemv(x: torch.Tensor, weight_packed: torch.Tensor, weight_scale: torch.Tensor,
                        weight_scale_2: torch.Tensor, bias: torch.Tensor | None = None, *,
                        prologue: GemvPrologue = NO_PROLOGUE,
                        launch: QuantGemvLaunch | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(nvfp4_gemv(prologue(x), ...), x + residual or None)``: x [..., 2K] for ``GATED``, else [..., K]."""
    scales = ScaleLayout.nvfp4(weight_packed, weight_scale, weight_scale_2, "nvfp4_gemv")
    n, row_bytes = weight_packed.shape
    rows = _rows(x, operand_columns(2 * row_bytes, prologue.kind), bias, n, "nvfp4_gemv")
    words = word_gemv.words_of(weight_packed) if rows.shape[0] == 1 and NVFP4_WORD_GEMV else None
    launch = launch or QuantGemvLaunch.choose(WeightFormat.NVFP4, row_bytes, rows.shape[0],
                                              nvfp4_words=words is not None)
    if launch.fold != 1:
        raise ValueError(f"nvfp4_gemv: fold is FP8's (its products are summed per block of 16), got {launch.fold}")
    if launch.block_b < 16:  # whole blocks of 16 elements, and 4 bytes per PTX decode
        raise ValueError(f"nvfp4_gemv: block_b must be at least 16 bytes, got {launch.block_b}")
    if words is not None:  # one row: nvfp4_gemv.py's kernel, every value where its thread needs it
        out, summed = word_gemv.launch_one_row(rows, words, scales, bias, launch, prologue)
        return out.view(*x.shape[:-1], n), None if summed is None else summed.view(x.shape)
    return _launch(x, rows, weight_packed, scales, bias, WeightFormat.NVFP4, 2 * row_bytes, launch, prologue,
                   "nvfp4_gemv")


def _rows(x: torch.Tensor, columns: int, bias, n: int, what: str) -> torch.Tensor:
    """x as [M, columns] rows with unit column stride, after the checks every GEMV shares."""
    ref.check_activations(x, columns, what)
    ref.check_bias(bias, n, what)
    rows = x.reshape(-1, columns)
    if rows.shape[0] > MAX_ROWS:
        raise ValueError(f"{what} takes at most {MAX_ROWS} rows, got {rows.shape[0]}")
    return unit_stride(rows)


def _launch(x, rows, weight, scales: ScaleLayout, bias, fmt: WeightFormat, k: int, launch: QuantGemvLaunch,
            prologue: GemvPrologue, what: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    m, n = rows.shape[0], weight.shape[0]
    res, norm_w, summed = prologue.tensors(rows, k, what)
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m and n:
        _quant_gemv_kernel[(triton.cdiv(n, launch.block_n),)](
            rows, res, norm_w, weight, scales.scale, scales.out_scale, bias if bias is not None else out, out, summed,
            m, n, k, weight.shape[1], rows.stride(0), res.stride(0), weight.stride(0), out.stride(0),
            summed.stride(0),
            *scales.kernel_args(), float(prologue.eps),
            FORMAT=int(fmt), BLOCK_SCALED=scales.block_scaled, HAS_BIAS=bias is not None,
            BLOCK_M=triton.next_power_of_2(m), BLOCK_N=launch.block_n, BLOCK_B=launch.block_b,
            TRIGGER=int(launch.trigger), PRELOAD=launch.preload, E2M1_PTX=e2m1_ptx(x.device), FOLD=launch.fold,
            PROLOGUE=int(prologue.kind), ACTIVATION=ACTIVATION_IDS[prologue.activation],
            TWO_PASS=two_pass(rows.dtype, prologue.kind), num_warps=launch.num_warps, num_stages=1,
            **pdl.launch_options(x.device),
        )
    if prologue.kind != Prologue.ADD_RMS_NORM:
        return out.view(*x.shape[:-1], n), None
    if not n:  # no program to write x + residual
        summed.copy_(rows.float() + res.float())
    return out.view(*x.shape[:-1], n), summed.view(x.shape)
