"""The one-row NVFP4 GEMV (batch-1 decode): ``out[1, N] = x[1, K] @ dequantize(W).T (+ bias)``, what
``quant_gemv.nvfp4_gemv`` runs at one row (``AUTODEPLOY_NVFP4_WORD_GEMV=0`` keeps the byte kernel instead),
its semantics and checks (``quant_reference.py``'s NVFP4 format and reference: products in fp32, per block of 16
summed and times the block's e4m3 scale, the global scale last).

Every value is where its thread needs it, so no layout conversion, shared memory or barrier is left in the
loop: a thread owns 16 bytes (4 words of 8 codes: 32 elements, two scale blocks) of each of the program's
``BLOCK_N`` features at one K position, loaded as int32 words in the checkpoint's byte order; the activations of
those 32 elements (loaded once for the features: ``load_operand``, where the bf16 GEMV's prologues apply) and
the two scales of each feature sit in the same thread. Word q of group g holds element
``32 g + 8 q + i`` in its nibble i; ``E2M1_WORD_ASM`` decodes a word into its eight values (fp16 pairs by
shifts and masks, widened to fp32), and each block's 16 products are one FMA chain, then one FMA with its scale.
Threads span K (one group each), features repeat in the thread; the sum over K is one reduction at the end.

SASS of sm_90 (``python bench/probes/fp8_small_m.py --sass``; 4 x 1024 bytes on 2 warps): 4.95 instructions per
element in the loop, no barrier or shared-memory access, 64 registers; the byte kernel it replaced at one row
(``quant_gemv._tile_products``: nibbles interleaved by join + reshape, the tile moved through shared memory to
meet the activations) 8.81, 10 barriers, 48 registers. Of the 4.95: the decode 2.875 (15 integer ops a word and
8 fp16 -> fp32 widenings), the products 1.0, the rest activations (bf16 pairs widened by two ops), scales,
addresses and masks. The issue budget at the copy bandwidth is ~4.9 per element on an H100 and ~3.1 on an H200:
this kernel is near the H100's and ~60% of the H200's. On the CUDA cores the decode + widen + FMA floor is
~3.9 per element; below that is the tensor cores' work (``mma`` m16n8k16 on the decoded fp16/bf16 pairs with the
activations as the one useful column: no widening, no FMA, ~2.6 per element by count), left for later.

Prologues (``quant_gemv.nvfp4_prologue_gemv``): ``gemv._operand``'s, the operand kept in fp32 (no rounding to x's
dtype: fewer instructions, and no fp16 overflow, so no first pass for fp16 either); RMSNorm's 1/rms a factor of
each sum, from x^2 summed per thread; x + residual rounded to x's dtype and written before the loop. Per element
they add to the 4.95 (sm_90): RMSNorm 0.86 (96 registers), add + RMSNorm 1.94 (96), SiLU·mul 3.5 (64): on a loop
issue-bound already, which is why ``ops/quant_linear.py`` runs NVFP4's steps apart by default.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import pdl
from .activation import ACTIVATION_IDS, activate
from .e2m1 import e2m1_ptx, e2m1_to_fp16
from .gemv import GemvPrologue, Prologue, _operand
from .pdl import Trigger

AFTER_LOOP = tl.constexpr(Trigger.AFTER_LOOP.value)
NONE, RMS_NORM, ADD_RMS_NORM, GATED = (tl.constexpr(p.value) for p in Prologue)
GROUP_WORDS = tl.constexpr(4)  # one thread's 32-bit words of a feature: 32 elements, two scale blocks


# e2m1 -> fp32 for the eight codes of one 32-bit word (sm_80+ PTX; the interpreter runs e2m1_to_fp16):
# pair i holds codes i and i + 4 after a shift of 12 - 4i (nibble i at bits 12-15, nibble i + 4 at 28-31):
# the sign stays at bit 15 / 31 (and), the magnitude moves to bits 9-11 / 25-27 (shr 3, lop3 (t & m) | a),
# i.e. e2m1_to_fp16's fp16 pair; cvt widens each half. Out: the eight values in element order, times 2**-14.
def _e2m1_word_asm() -> str:
    lines = ["{", ".reg .b32 s, a, t, p;", ".reg .b16 lo, hi;"]
    for i in range(4):
        word = "$8" if i == 3 else "s"
        if i < 3:
            lines.append(f"shl.b32 s, $8, {12 - 4 * i};")
        lines += [f"and.b32 a, {word}, 0x80008000;", f"shr.b32 t, {word}, 3;",
                  "lop3.b32 p, t, 0x0E000E00, a, 0xEA;", "mov.b32 {lo, hi}, p;",
                  f"cvt.f32.f16 ${i}, lo;", f"cvt.f32.f16 ${i + 4}, hi;"]
    return "\n".join(lines + ["}"])


E2M1_WORD_ASM = tl.constexpr(_e2m1_word_asm())


@triton.jit
def load_activations(x_ptr, k0, groups, K, BLOCK_G: tl.constexpr, X_PAIRS: tl.constexpr):
    """The activations of the tile's groups as fp32 [BLOCK_G, 4, 8]: element ``k0 + 32 g + 8 q + i``, which
    word q of group g holds in its nibble i. ``X_PAIRS``: bf16 pairs read as 32-bit words and widened by two
    instructions (shl, and)."""
    words = tl.arange(0, 4)[None, :, None]
    if X_PAIRS:
        pairs = k0 // 2 + groups[:, None, None] * 16 + words * 4 + tl.arange(0, 4)[None, None, :]
        packed = tl.load(x_ptr.to(tl.pointer_type(tl.int32)) + pairs, mask=pairs < K // 2, other=0)
        low, high = tl.inline_asm_elementwise("shl.b32 $0, $2, 16; and.b32 $1, $2, 0xFFFF0000;", "=r,=r,r",
                                              [packed], dtype=(tl.float32, tl.float32), is_pure=True, pack=1)
        return tl.reshape(tl.join(low, high), [BLOCK_G, 4, 8])
    else:
        ks = k0 + groups[:, None, None] * 32 + words * 8 + tl.arange(0, 8)[None, None, :]
        return tl.load(x_ptr + ks, mask=ks < K, other=0.0).to(tl.float32)


@triton.jit
def load_operand(x_ptr, res_ptr, norm_w_ptr, k0, groups, K, sumsq, BLOCK_G: tl.constexpr, X_PAIRS: tl.constexpr,
                 RES_PAIRS: tl.constexpr, NORM_PAIRS: tl.constexpr, PROLOGUE: tl.constexpr, ACTIVATION: tl.constexpr):
    """``load_activations`` with the prologue applied as ``gemv._operand`` applies it, the operand kept in fp32
    (x + residual rounded to x's dtype, as the sum the op returns), and the running x^2 per group (``sumsq``
    [BLOCK_G]: the norms' 1/rms, applied to the sums at the end); ``*_PAIRS``: that tensor read as bf16 pairs."""
    x = load_activations(x_ptr, k0, groups, K, BLOCK_G, X_PAIRS)
    if PROLOGUE == NONE:
        return x, sumsq
    dtype: tl.constexpr = x_ptr.dtype.element_ty
    if PROLOGUE == GATED:  # x [2K]: gate then up
        up = load_activations(x_ptr + K, k0, groups, K, BLOCK_G, X_PAIRS)
        return activate(x, ACTIVATION) * up, sumsq
    if PROLOGUE == ADD_RMS_NORM:
        x = (x + load_activations(res_ptr, k0, groups, K, BLOCK_G, RES_PAIRS)).to(dtype).to(tl.float32)
    norm_w = load_activations(norm_w_ptr, k0, groups, K, BLOCK_G, NORM_PAIRS)
    return x * norm_w, sumsq + tl.sum(tl.sum(x * x, 2), 1)


@triton.jit
def _eighths(x):
    """x [A, B, 8] as eight [A, B] tensors, x[..., i] for i = 0..7 (in-thread splits)."""
    even, odd = tl.split(tl.reshape(x, [x.shape[0], x.shape[1], 2, 2, 2]))  # i = 4 b2 + 2 b1 + b0: b0 first
    x04, x26 = tl.split(even)
    x15, x37 = tl.split(odd)
    x0, x4 = tl.split(x04)
    x2, x6 = tl.split(x26)
    x1, x5 = tl.split(x15)
    x3, x7 = tl.split(x37)
    return x0, x1, x2, x3, x4, x5, x6, x7


@triton.jit
def _decode(w, E2M1_PTX: tl.constexpr):
    """The eight e2m1 values (times 2**-14, fp32) of each 32-bit word of ``w``, in element order."""
    if E2M1_PTX:
        return tl.inline_asm_elementwise(E2M1_WORD_ASM, "=f,=f,=f,=f,=f,=f,=f,=f,r", [w],
                                         dtype=(tl.float32,) * 8, is_pure=True, pack=1)
    else:
        return (e2m1_to_fp16(w & 0xF).to(tl.float32), e2m1_to_fp16((w >> 4) & 0xF).to(tl.float32),
                e2m1_to_fp16((w >> 8) & 0xF).to(tl.float32), e2m1_to_fp16((w >> 12) & 0xF).to(tl.float32),
                e2m1_to_fp16((w >> 16) & 0xF).to(tl.float32), e2m1_to_fp16((w >> 20) & 0xF).to(tl.float32),
                e2m1_to_fp16((w >> 24) & 0xF).to(tl.float32), e2m1_to_fp16((w >> 28) & 0xF).to(tl.float32))


@triton.jit
def _chain(s, w, x, E2M1_PTX: tl.constexpr):
    """s + the eight products of each word of ``w`` [G, N, B] with its activations ``x`` [G, B, 8]: one FMA
    chain a sum."""
    e0, e1, e2, e3, e4, e5, e6, e7 = _decode(w, E2M1_PTX)
    x0, x1, x2, x3, x4, x5, x6, x7 = _eighths(x)
    s += e0 * x0[:, None, :]
    s += e1 * x1[:, None, :]
    s += e2 * x2[:, None, :]
    s += e3 * x3[:, None, :]
    s += e4 * x4[:, None, :]
    s += e5 * x5[:, None, :]
    s += e6 * x6[:, None, :]
    s += e7 * x7[:, None, :]
    return s


@triton.jit
def _group_products(acc, w, x, scale_ptr, cols, col_ok, groups, w0, row_blocks, stride_sn, stride_sk,
                    BLOCK_N: tl.constexpr, BLOCK_G: tl.constexpr, E2M1_PTX: tl.constexpr):
    """acc [BLOCK_G, BLOCK_N] += the products of one tile ``w`` [BLOCK_G, BLOCK_N, 4] of words from word w0 with
    their activations ``x`` [BLOCK_G, 4, 8]: each block of 16 (words 0-1, 2-3 of a group) summed in one chain,
    times its e4m3 scale."""
    x_first, x_second = tl.split(tl.permute(tl.reshape(x, [BLOCK_G, 2, 2, 8]), (0, 1, 3, 2)))  # [G, 2, 8]
    w_first, w_second = tl.split(tl.reshape(w, [BLOCK_G, BLOCK_N, 2, 2]))  # [G, N, 2]: a block's two words
    sums = _chain(tl.zeros([BLOCK_G, BLOCK_N, 2], dtype=tl.float32), w_first, x_first, E2M1_PTX)
    sum_0, sum_1 = tl.split(_chain(sums, w_second, x_second, E2M1_PTX))
    block = w0 // 2 + groups[:, None, None] * 2 + tl.arange(0, 2)[None, None, :]
    scale = tl.load(scale_ptr + cols[None, :, None] * stride_sn + block * stride_sk,
                    mask=col_ok[None, :, None] & (block < row_blocks), other=0.0).to(tl.float32)
    scale_0, scale_1 = tl.split(scale)
    return acc + sum_0 * scale_0 + sum_1 * scale_1


@triton.jit
def _nvfp4_gemv_kernel(
    x_ptr, res_ptr, norm_w_ptr, w_ptr, scale_ptr, out_scale_ptr, bias_ptr, out_ptr, sum_ptr,
    N, K, row_words, stride_wn, stride_sn, stride_sk, stride_os, out_factor, eps,
    HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_G: tl.constexpr,
    PDL: tl.constexpr, TRIGGER: tl.constexpr, PRELOAD: tl.constexpr, E2M1_PTX: tl.constexpr,
    X_PAIRS: tl.constexpr = False, RES_PAIRS: tl.constexpr = False, NORM_PAIRS: tl.constexpr = False,
    PROLOGUE: tl.constexpr = 0, ACTIVATION: tl.constexpr = 0,
):
    """``w_ptr``: the packed weight as 32-bit words, ``stride_wn`` words a row; ``X_PAIRS``: x is bf16 on a
    4-byte boundary, read as pairs (``load_activations``); the prologue's arguments as ``quant_gemv``'s."""
    pid = tl.program_id(0)
    cols = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    groups = tl.arange(0, BLOCK_G)
    tile = groups[:, None, None] * GROUP_WORDS + tl.arange(0, GROUP_WORDS)[None, None, :]  # [G, 1, 4]
    w_rows = w_ptr + cols.to(tl.int64)[None, :, None] * stride_wn
    TILE_WORDS: tl.constexpr = BLOCK_G * GROUP_WORDS
    w_next = pdl.load_around_wait(w_rows + tile, col_ok[None, :, None] & (tile < row_words),
                                  tl.zeros([BLOCK_G, BLOCK_N, GROUP_WORDS], dtype=tl.int32), PDL, TRIGGER, PRELOAD)
    if PROLOGUE == ADD_RMS_NORM:
        _write_sum(x_ptr, res_ptr, sum_ptr, K, 8 * TILE_WORDS)
    sumsq = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_N], dtype=tl.float32)
    for w0 in range(0, row_words, TILE_WORDS):
        w = w_next
        ws = w0 + TILE_WORDS + tile
        w_next = tl.load(w_rows + ws, mask=col_ok[None, :, None] & (ws < row_words), other=0)
        x, sumsq = load_operand(x_ptr, res_ptr, norm_w_ptr, 8 * w0, groups, K, sumsq, BLOCK_G, X_PAIRS, RES_PAIRS,
                                NORM_PAIRS, PROLOGUE, ACTIVATION)
        acc = _group_products(acc, w, x, scale_ptr, cols, col_ok, groups, w0, row_words // 2, stride_sn,
                              stride_sk, BLOCK_N, BLOCK_G, E2M1_PTX)
    if TRIGGER == AFTER_LOOP:
        pdl.allow_dependents(PDL)
    out = tl.sum(acc, 0) * tl.load(out_scale_ptr + cols * stride_os, mask=col_ok, other=0.0) * out_factor
    if PROLOGUE == RMS_NORM or PROLOGUE == ADD_RMS_NORM:  # the norm's 1/rms, a factor of the dot
        out *= tl.rsqrt(tl.sum(sumsq, 0) / K + eps)
    if HAS_BIAS:
        out += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + cols, out.to(out_ptr.dtype.element_ty), mask=col_ok)


@triton.jit
def _write_sum(x_ptr, res_ptr, sum_ptr, K, BLOCK_K: tl.constexpr):
    """x + residual written before the loop, a tile a program (``gemv._operand``'s rounding)."""
    row = tl.arange(0, 1)
    for k0 in range(tl.program_id(0) * BLOCK_K, K, tl.num_programs(0) * BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        _operand(x_ptr, res_ptr, x_ptr, sum_ptr, row, ks, (ks < K)[None, :], K, row.to(tl.float32),
                 tl.zeros([1, BLOCK_K], dtype=tl.float32), True, 0, 0, 0, ADD_RMS_NORM, 0, True)


def words_of(weight_packed: torch.Tensor) -> torch.Tensor | None:
    """The packed weight as int32 words (4 bytes: 8 codes), or None where its strides or offset do not allow
    the view (a row whose bytes do not start on a word)."""
    try:
        return weight_packed.view(torch.int32)
    except RuntimeError:
        return None


def launch_one_row(x_row: torch.Tensor, words: torch.Tensor, scales, bias, launch, prologue: GemvPrologue):
    """``(prologue(x_row) [1, K] @ dequantize(W).T (+ bias), x + residual or None)``: ``words`` int32
    [N, K // 8], ``scales`` a ``quant_gemv.ScaleLayout`` of the weight, ``launch`` a ``QuantGemvLaunch`` (its
    ``block_b // 16`` groups a tile; the inputs already checked by ``nvfp4_prologue_gemv``)."""
    n, k = words.shape[0], words.shape[1] * 8
    res, norm_w, summed = prologue.tensors(x_row, k, "nvfp4_gemv")
    out = torch.empty((1, n), dtype=x_row.dtype, device=x_row.device)
    if n:
        _nvfp4_gemv_kernel[(triton.cdiv(n, launch.block_n),)](
            x_row, res, norm_w, words, scales.scale, scales.out_scale, bias if bias is not None else out, out,
            summed, n, k, words.shape[1], words.stride(0), scales.stride_n, scales.stride_k, scales.stride_out,
            scales.factor, float(prologue.eps), HAS_BIAS=bias is not None, BLOCK_N=launch.block_n,
            BLOCK_G=launch.block_b // 16, TRIGGER=int(launch.trigger), PRELOAD=launch.preload,
            E2M1_PTX=e2m1_ptx(x_row.device), X_PAIRS=_pairs(x_row), RES_PAIRS=_pairs(res), NORM_PAIRS=_pairs(norm_w),
            PROLOGUE=int(prologue.kind), ACTIVATION=ACTIVATION_IDS[prologue.activation],
            num_warps=launch.num_warps, num_stages=1,
            **pdl.launch_options(x_row.device),
        )
    if prologue.kind != Prologue.ADD_RMS_NORM:
        return out, None
    if not n:  # no program to write x + residual
        summed.copy_(x_row.float() + res.float())
    return out, summed


def _pairs(t: torch.Tensor) -> bool:
    """Whether the kernel reads ``t`` as bf16 pairs (compiled for a GPU, bf16, on a 4-byte boundary)."""
    return e2m1_ptx(t.device) and t.dtype == torch.bfloat16 and t.data_ptr() % 4 == 0
