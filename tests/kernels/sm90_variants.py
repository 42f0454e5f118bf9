"""The Triton kernel variants the runtime launches, as ``compile_sm90.py`` compiles them for sm_90: each
``(name, kernel, pointer types, constexprs, warps, stages[, compile options])``, the launch parameters chosen
by the same code the runtime uses (``AttentionLaunch``, ``decode_tuning``, ``GemvLaunch``...). Imported by
``compile_sm90.py`` after it has put a bare ``autodeploy`` package over the source tree (see there)."""

from __future__ import annotations

import triton

from autodeploy.kernels import activation, gemv, kv_cache_write, mla_attention, norm, paged_attention, rope
from autodeploy.kernels import fp8_quantize as fq
from autodeploy.kernels import fp8_small_m as sm
from autodeploy.kernels import fp8_tma_gemv as tg
from autodeploy.kernels import norm_quantize as nq
from autodeploy.kernels import nvfp4_gemv as nv
from autodeploy.kernels import quant_gemm as qm
from autodeploy.kernels import quant_gemv as qg
from autodeploy.kernels.attention_config import AttentionLaunch
from autodeploy.kernels.paged_attention_blocks import ROPE_HALF, ROPE_INTERLEAVED


def _attention(dtype="bf16", kv_fp8=False, **overrides):
    pointers = {n: f"*{dtype}" for n in ("out_ptr", "q_ptr", "k_ptr", "v_ptr", "cache_ptr", "sinks_ptr", "cos_ptr",
                                          "sin_ptr")}
    if kv_fp8:  # an FP8 KV cache is passed as its bytes
        pointers["cache_ptr"] = "*u8"
    pointers.update({n: "*fp32" for n in ("part_out_ptr", "part_lse_ptr", "alibi_ptr")})
    pointers["counters_ptr"] = "*i32"
    pointers["trace_ptr"] = "*i64"
    metadata = ("context_lens_ptr", "cu_seqlens_ptr", "block_table_ptr", "slot_ptr")
    pointers.update({n: "*i64" for n in metadata})
    const = dict(GROUP=4, GROUP_PAD=4, HEAD_DIM=128, BLOCK_D=128, BLOCK_Q=4, BLOCK_N=64, PAGE_SIZE=16, NUM_SPLITS=4,
                 SEARCH_BLOCK=paged_attention.SEARCH_BLOCK,
                 HAS_WINDOW=False, HAS_SOFTCAP=False, HAS_SINKS=False,
                 DOT_PRECISION="ieee" if dtype == "fp32" else "tf32", SPLIT_NEW_KEYS=False, ROPE=0, ROT_DIM=0,
                 PDL=False)
    const.update(overrides)
    if "BLOCK_N" not in overrides and const["NUM_SPLITS"] > 1 and not const["SPLIT_NEW_KEYS"]:
        const["BLOCK_N"] = 32  # as AttentionLaunch.choose: split decode grids are latency-bound ones
    const.setdefault("DIAG_BLOCK_N", const["BLOCK_N"])
    const.setdefault("TRIGGER", 0)
    const.setdefault("SECOND_EARLY", False)
    const.setdefault("TRACE", False)
    const.setdefault("HAS_CHUNK", False)
    const.setdefault("HAS_ALIBI", False)
    # as AttentionLaunch.choose: decode launches of a grid that needs splits preload, except in fp32
    const.setdefault("PRELOAD_KV", not const["SPLIT_NEW_KEYS"] and const["NUM_SPLITS"] > 1 and dtype != "fp32")
    const["SPLITS_PAD"] = triton.next_power_of_2(const["NUM_SPLITS"])
    const.setdefault("TOKEN_MERGE", paged_attention._token_merge_fits(const["NUM_SPLITS"], const["GROUP"],
                                                                      const["HEAD_DIM"]))
    return paged_attention._paged_attention_kernel, pointers, const


def _decode_tuning(block_n, rope=False, fp8_pool=False):
    """(diagonal block, stages, compile options) of a decode launch with ``block_n`` keys a block, as the kernel
    chooses them (``paged_attention.decode_tuning``)."""
    return paged_attention.decode_tuning(AttentionLaunch(16, block_n, decode=True), rope, fp8_pool)


def _fp8_pool_variants(rope, prefill):
    """An FP8 (e4m3) KV cache: the decode launches of batch 64 (no split, 64 keys a block), of split grids
    (32 keys a block, the first preloaded) and batch 1, each without and with RoPE; a prefill. Decodes without
    RoPE: FP8_DECODE_MAX_REGISTERS (test_compile_sm90.py holds them to it)."""
    for block_n, label, shape in ((64, "(no split)", dict(NUM_SPLITS=1)), (32, "(split 4)", {}),
                                  (32, "b1 (s16, PDL)", dict(num_seqs=1, num_tokens=1, NUM_SPLITS=16, PDL=True))):
        for fused in (False, True):
            diagonal, stages, options = _decode_tuning(block_n, fused, fp8_pool=True)
            consts = {**(rope if fused else {}), **shape, "BLOCK_N": block_n, "DIAG_BLOCK_N": diagonal}
            name = f"attn fp8-kv {'rope ' if fused else ''}decode {label}"
            yield (name, *_attention(kv_fp8=True, **consts), 4, stages, {**options, "launch_pdl": True}
                   if shape.get("PDL") else options)
    yield ("attn fp8-kv prefill gqa4 d128 (BLOCK_M 128)", *_attention(kv_fp8=True, BLOCK_Q=32, **prefill), 8, 2)


def _gemv(dtype="bf16", prologue=gemv.Prologue.NONE, pdl=True, **overrides):
    names = ("x_ptr", "res_ptr", "norm_w_ptr", "w_ptr", "bias_ptr", "out_ptr", "sum_ptr")
    pointers = {n: f"*{dtype}" for n in names}
    pointers["trace_ptr"] = "*i64"
    const = dict(PROLOGUE=int(prologue), ACTIVATION=0, TWO_PASS=False, HAS_BIAS=False, BLOCK_M=1,
                 BLOCK_N=4, BLOCK_K=1024, PDL=pdl, TRIGGER=1, PRELOAD=True, TRACE=False)  # GemvLaunch.choose at one row
    const.update(overrides)
    return gemv._gemv_kernel, pointers, const


def _gemv_variants():
    """The decode GEMVs of the 8B shape (fused norm / add + norm / gated activation) at 1 and 4 rows."""
    pdl_on = {"launch_pdl": True}
    four = dict(BLOCK_M=4, BLOCK_N=16, BLOCK_K=128)
    yield ("gemv add+norm -> qkv (PDL)", *_gemv(prologue=gemv.Prologue.ADD_RMS_NORM), 4, 1, pdl_on)
    yield ("gemv norm -> qkv (PDL)", *_gemv(prologue=gemv.Prologue.RMS_NORM), 4, 1, pdl_on)
    yield ("gemv gated silu -> down (PDL)", *_gemv(prologue=gemv.Prologue.GATED), 4, 1, pdl_on)
    yield ("gemv plain, bias (PDL)", *_gemv(HAS_BIAS=True), 4, 1, pdl_on)
    yield ("gemv add+norm 16 x 512, late trigger, no preload (PDL)",
           *_gemv(prologue=gemv.Prologue.ADD_RMS_NORM, BLOCK_N=16, BLOCK_K=512, TRIGGER=2, PRELOAD=False), 4, 1, pdl_on)
    yield ("gemv gated silu 8 x 1024 (PDL)", *_gemv(prologue=gemv.Prologue.GATED, BLOCK_N=8), 4, 1, pdl_on)
    yield ("gemv add+norm, traced (PDL)", *_gemv(prologue=gemv.Prologue.ADD_RMS_NORM, TRACE=True), 4, 1, pdl_on)
    yield ("gemv add+norm (no PDL)", *_gemv(prologue=gemv.Prologue.ADD_RMS_NORM, pdl=False), 4, 1)
    yield ("gemv add+norm, 4 rows (PDL)", *_gemv(prologue=gemv.Prologue.ADD_RMS_NORM, **four), 4, 1, pdl_on)
    yield ("gemv gated silu, 4 rows (PDL)", *_gemv(prologue=gemv.Prologue.GATED, **four), 4, 1, pdl_on)
    two_pass = _gemv("fp16", prologue=gemv.Prologue.ADD_RMS_NORM, TWO_PASS=True)
    yield ("gemv fp16 add+norm two-pass", *two_pass, 4, 1, pdl_on)
    yield ("gemv fp32 norm", *_gemv("fp32", prologue=gemv.Prologue.RMS_NORM), 4, 1, pdl_on)


def _mla_variants():
    """MLA at DeepSeek-V3's shape (128 heads, latent 512 + rotary 64, bf16): the decode tile of 16 heads x 1
    token split 12 ways (batch 1 at 4096 keys on 132 SMs), a prefill tile (16 heads x 2 tokens), the merge."""
    pointers = {n: "*bf16" for n in ("out_ptr", "q_ptr", "qpe_ptr", "cache_ptr")}
    pointers.update({n: "*fp32" for n in ("part_out_ptr", "part_lse_ptr")})
    pointers.update({n: "*i64" for n in ("context_lens_ptr", "cu_seqlens_ptr", "block_table_ptr")})
    shape = dict(HEADS=128, RANK=512, BLOCK_R=512)
    const = dict(shape, ROPE_DIM=64, BLOCK_P=64, BLOCK_H=16, BLOCK_Q=1, BLOCK_N=32, PAGE_SIZE=16, NUM_SPLITS=12,
                 SEARCH_BLOCK=mla_attention.SEARCH_BLOCK, DOT_PRECISION="tf32")
    yield ("mla decode ds-v3 h128 r512 (split 12)", mla_attention._mla_kernel, pointers, const, 4, 2)
    yield ("mla prefill ds-v3 (16 heads x 2 tokens)", mla_attention._mla_kernel, pointers,
           dict(const, BLOCK_Q=2, NUM_SPLITS=1), 8, 2)
    merge = dict(shape, BLOCK_H=16, NUM_SPLITS=12, SPLITS_PAD=16)
    yield ("mla merge ds-v3 (12 splits)", mla_attention._merge_kernel, pointers, merge, 4, 2)


def _quant_variants():
    """The quantized linears' launches as chosen by default at the 8B shapes: the weight-only GEMVs (CUDA
    cores, 1 and 4 rows), the GEMMs at 1, 64 and 4096 rows, the activation quantizers."""
    def gemv_variant(fmt, rows, block_scaled=False, prologue=gemv.Prologue.NONE, dtype="bf16", nvfp4_words=True):
        launch = qg.QuantGemvLaunch.choose(fmt, 4096 if fmt == qg.WeightFormat.FP8 else 2048, rows,
                                           nvfp4_words=nvfp4_words)
        pointers = {n: f"*{dtype}" for n in ("x_ptr", "res_ptr", "norm_w_ptr", "bias_ptr", "out_ptr", "sum_ptr")}
        pointers.update({"w_ptr": "*u8", "out_scale_ptr": "*fp32",
                         "scale_ptr": "*fp32" if fmt == qg.WeightFormat.FP8 else "*fp8e4nv"})
        const = dict(FORMAT=int(fmt), BLOCK_SCALED=block_scaled, HAS_BIAS=rows > 1, BLOCK_M=rows,
                     BLOCK_N=launch.block_n, BLOCK_B=launch.block_b, PDL=True, TRIGGER=int(launch.trigger),
                     PRELOAD=launch.preload, E2M1_PTX=True, FOLD=launch.fold, PROLOGUE=int(prologue), ACTIVATION=0,
                     TWO_PASS=dtype == "fp16" and prologue in (gemv.Prologue.RMS_NORM, gemv.Prologue.ADD_RMS_NORM))
        name = f"{fmt.name.lower()}_gemv{STEP_NAMES[prologue]} {rows} row(s){' block' if block_scaled else ''}"
        name += f" {dtype}" if dtype != "bf16" else ""
        return name, qg._quant_gemv_kernel, pointers, const, launch.num_warps, 1, {"launch_pdl": True}

    def gemm_variant(fmt, rows, block_scaled=False, split=1):
        launch = qm.GemmLaunch.choose(rows, 4096, block_scaled=block_scaled)
        tiles = dict(HAS_BIAS=False, BLOCK_SCALED=block_scaled, BLOCK_M=launch.block_m,
                     BLOCK_N=launch.block_n, BLOCK_K=launch.block_k, GROUP_M=launch.group_m)
        if fmt is None:  # activations quantized: fp8_gemm's Triton GEMM
            pointers = {"a_ptr": "*u8", "b_ptr": "*u8", "a_scale_ptr": "*fp32", "b_scale_ptr": "*fp32",
                        "bias_ptr": "*bf16", "out_ptr": "*bf16"}
            kernel, const, name = qm._fp8_gemm_kernel, tiles, "fp8_gemm"
        else:
            pointers = {"x_ptr": "*bf16", "w_ptr": "*u8", "out_scale_ptr": "*fp32", "bias_ptr": "*bf16",
                        "out_ptr": "*bf16", "scale_ptr": "*fp32" if fmt == qg.WeightFormat.FP8 else "*fp8e4nv"}
            kernel, name = qm._weight_only_gemm_kernel, f"{fmt.name.lower()} weight-only"
            const = dict(tiles, FORMAT=int(fmt), DOT_PRECISION="tf32", E2M1_PTX=True)
        if "SPLIT_K" in kernel.arg_names:  # split-K GEMMs: each split's fp32 partial where K is split
            pointers["partial_ptr"] = "*fp32" if split > 1 else "*bf16"
            const = dict(const, SPLIT_K=split)
        name = f"{name} {rows} rows{' block' if block_scaled else ''}{f' split {split}' if split > 1 else ''}"
        return name, kernel, pointers, const, launch.num_warps, launch.num_stages

    yield ("nvfp4_gemv bytes 1 row (fallback)", *gemv_variant(qg.WeightFormat.NVFP4, 1, nvfp4_words=False)[1:])
    yield gemv_variant(qg.WeightFormat.FP8, 1, block_scaled=True)
    # the norm / activation folded into the operand loads (quant_linear's fused ops at the "gemv" path); NVFP4's
    # one row: nvfp4_gemv.py's word kernel
    for prologue in gemv.Prologue:
        yield _nvfp4_one_row_variant(prologue)
        for fmt in qg.WeightFormat:
            for rows in (1, 4) if fmt == qg.WeightFormat.FP8 else (4,):
                yield gemv_variant(fmt, rows, prologue=prologue)
    yield gemv_variant(qg.WeightFormat.FP8, 1, block_scaled=True, prologue=gemv.Prologue.ADD_RMS_NORM)
    yield gemv_variant(qg.WeightFormat.FP8, 1, prologue=gemv.Prologue.ADD_RMS_NORM, dtype="fp16")
    for rows in (1, 64, 4096):
        yield gemm_variant(qg.WeightFormat.NVFP4, rows)
        for fmt in (None, qg.WeightFormat.FP8):
            yield gemm_variant(fmt, rows)
            yield gemm_variant(fmt, rows, block_scaled=True)
    for rows in (16, 64):  # decode batches split K (GemmLaunch.choose: up to 4 ways)
        yield gemm_variant(None, rows, split=4)
        yield gemm_variant(qg.WeightFormat.FP8, rows, split=4)
        yield gemm_variant(qg.WeightFormat.NVFP4, rows, split=4)
    yield from _small_m_variants()
    quantize = {"x_ptr": "*bf16", "q_ptr": "*fp8e4nv", "scale_ptr": "*fp32"}
    for static in (False, True):
        yield (f"fp8_quantize rows static={static} (PDL)", fq._quantize_rows_kernel, quantize,
               dict(STATIC=static, BLOCK=4096, PDL=True), 4, 1, {"launch_pdl": True})
    yield ("fp8_quantize groups of 128", fq._quantize_groups_kernel, quantize, dict(GROUP_PAD=128, BLOCK_G=16), 4, 1)
    steps = {"x_ptr": "*bf16", "second_ptr": "*bf16", "weight_ptr": "*bf16", "q_ptr": "*fp8e4nv", "scale_ptr": "*fp32",
             "sum_ptr": "*bf16"}
    for step, block in ((nq.Step.ADD_RMS_NORM, 4096), (nq.Step.GATED, 16384)):  # the 8B shape's hidden and MLP
        yield (f"norm_quantize {step.name.lower()}", nq._step_quantize_kernel, steps,
               dict(STEP=int(step), ACTIVATION=0, STATIC=False, BLOCK=block, PDL=True), min(16, max(4, block // 1024)), 1)


STEP_NAMES = {gemv.Prologue.NONE: "", gemv.Prologue.RMS_NORM: " norm", gemv.Prologue.ADD_RMS_NORM: " add+norm",
              gemv.Prologue.GATED: " gated silu"}


def _nvfp4_one_row_variant(prologue=gemv.Prologue.NONE):
    """The one-row NVFP4 GEMV of ``nvfp4_gemv.py`` as ``nvfp4_prologue_gemv`` launches it at the 8B shapes (bf16
    tensors on 4-byte boundaries; scales with a K stride of 1: the JIT makes it a constant)."""
    launch = qg.QuantGemvLaunch.choose(qg.WeightFormat.NVFP4, 2048)
    pointers = {n: "*bf16" for n in ("x_ptr", "res_ptr", "norm_w_ptr", "bias_ptr", "out_ptr", "sum_ptr")}
    pointers.update({"w_ptr": "*i32", "scale_ptr": "*fp8e4nv", "out_scale_ptr": "*fp32"})
    const = dict(stride_sk=1, HAS_BIAS=False, BLOCK_N=launch.block_n, BLOCK_G=launch.block_b // 16, PDL=True,
                 TRIGGER=int(launch.trigger), PRELOAD=launch.preload, E2M1_PTX=True, X_PAIRS=True, RES_PAIRS=True,
                 NORM_PAIRS=True, PROLOGUE=int(prologue), ACTIVATION=0)
    return f"nvfp4_gemv{STEP_NAMES[prologue]} 1 row(s)", nv._nvfp4_gemv_kernel, pointers, const, launch.num_warps, 1, {"launch_pdl": True}


def _small_m_variants():
    """The swap-AB FP8 x FP8 GEMM of decode rows (``fp8_small_m.py``) as ``SmallMLaunch.choose`` launches it at
    the 8B shapes: o at 1 row (K split 8 ways), gate_up at 16 rows (unsplit), 64 rows with a bias."""
    pointers = {"w_ptr": "*u8", "x_ptr": "*u8", "w_scale_ptr": "*fp32", "x_scale_ptr": "*fp32", "bias_ptr": "*bf16",
                "out_ptr": "*bf16", "partial_ptr": "*fp32", "counters_ptr": "*i32"}
    for rows, n, k, bias in ((1, 4096, 4096, False), (16, 28672, 4096, False), (64, 4096, 14336, True)):
        launch = sm.SmallMLaunch.choose(rows, n, k)
        const = dict(HAS_BIAS=bias, SPLIT_K=launch.split_k, EVEN_K=True, BLOCK_N=launch.block_n,
                     BLOCK_M=launch.block_m, BLOCK_K=launch.block_k, PDL=True, PREFETCH=launch.prefetch)
        yield (f"fp8_small_m {rows} row(s) {n}x{k} split {launch.split_k}", sm._fp8_small_m_kernel, pointers, const,
               launch.num_warps, launch.num_stages, {"launch_pdl": True})


def _fp8_tma_gemv_variants():
    """The one-row FP8 GEMV on TMA (``fp8_tma_gemv.py``, opt-in: ``AUTODEPLOY_FP8_TMA_GEMV=1``) as ``fp8_tma_gemv``
    launches it on bf16 with per-channel scales (stride 1: the JIT makes it a constant) under PDL: the tiles
    ``TmaGemvLaunch.choose`` picks at the 8B shapes, then some of the probe's sweep candidates."""
    chosen = {tg.TmaGemvLaunch.choose(n, k): label for label, n, k in (("qkv", 6144, 4096), ("gate_up", 28672, 4096))}
    others = (tg.TmaGemvLaunch(8, 256, 4, 8), tg.TmaGemvLaunch(32, 128, 4, 6), tg.TmaGemvLaunch(16, 128, 4, 8),
              tg.TmaGemvLaunch(32, 256, 4, 4))
    for launch, label in [*chosen.items(), *((launch, "sweep") for launch in others if launch not in chosen)]:
        pointers = {n: "*bf16" for n in ("x_ptr", "bias_ptr", "out_ptr")}
        pointers.update({"w_ptr": "*u8", "scale_ptr": "*fp32",
                         "w_desc": f"tensordesc<u8[{launch.block_n}, {launch.block_k}]>"})
        const = dict(stride_s=1, HAS_BIAS=False, BLOCK_N=launch.block_n, BLOCK_K=launch.block_k,
                     NUM_STAGES=launch.num_stages, FOLD=tg.FOLD, PREFETCH=tg.prefetch_bytes(launch),
                     PDL=True)
        name = f"fp8_tma_gemv {launch.block_n}x{launch.block_k} s{launch.num_stages} ({label})"
        yield name, tg._fp8_tma_gemv_kernel, pointers, const, launch.num_warps, launch.num_stages, {"launch_pdl": True}


def variants():
    """(name, kernel, pointer types, constexprs, warps, stages[, options]) of the variants the runtime uses."""
    bf16_ptrs = lambda *names: {n: "*bf16" for n in names}  # noqa: E731
    yield ("attn decode gqa4 d128 (split 4)", *_attention(), 4, 2)
    yield ("attn decode gqa4 d128 (no split)", *_attention(NUM_SPLITS=1), 4, 2)
    yield ("attn decode mha d128", *_attention(GROUP=1, GROUP_PAD=1, BLOCK_Q=16), 4, 2)
    yield ("attn decode mqa group 32 d128 (split 16)", *_attention(GROUP=32, GROUP_PAD=32, BLOCK_Q=1,
                                                                   NUM_SPLITS=16), 4, 2)
    prefill = dict(NUM_SPLITS=1, SPLIT_NEW_KEYS=True)
    yield ("attn prefill gqa4 d128 (BLOCK_M 128)", *_attention(BLOCK_Q=32, **prefill), 8, 2)
    yield ("attn prefill gqa3 d64 window+softcap+sinks", *_attention(GROUP=3, GROUP_PAD=4, HEAD_DIM=64, BLOCK_D=64,
           BLOCK_Q=32, HAS_WINDOW=True, HAS_SOFTCAP=True, HAS_SINKS=True, **prefill), 8, 2)
    yield ("attn prefill gqa4 d128 chunked + alibi", *_attention(BLOCK_Q=32, HAS_CHUNK=True, HAS_ALIBI=True,
                                                                 **prefill), 8, 2)
    yield ("attn decode gqa4 d128 chunked + alibi (split 4)", *_attention(HAS_CHUNK=True, HAS_ALIBI=True), 4, 2)
    yield ("attn prefill mha d256 (BLOCK_M 64)", *_attention(GROUP=1, GROUP_PAD=1, HEAD_DIM=256, BLOCK_D=256,
           BLOCK_Q=64, BLOCK_N=32, **prefill), 8, 2)
    yield ("attn decode fp16 d256 (BLOCK_N 32)", *_attention("fp16", HEAD_DIM=256, BLOCK_D=256, BLOCK_N=32), 4, 2)
    yield ("attn decode fp32 d64", *_attention("fp32", HEAD_DIM=64, BLOCK_D=64), 4, 2)
    yield ("attn decode gqa4 d128 (split 32)", *_attention(NUM_SPLITS=32), 4, 2)
    # the JIT specialises integer arguments equal to 1 as constants: batch 1 is a variant of its own
    yield ("attn decode batch 1 (num_seqs = T = 1)", *_attention(num_seqs=1, num_tokens=1), 4, 2)
    yield ("attn decode gqa3 d64 (split 4, smollm2)", *_attention(GROUP=3, HEAD_DIM=64, BLOCK_D=64), 4, 2)
    # RoPE folded into the attention (fuse_rope_attention): q and the new keys rotated in the kernel
    diagonal, _, options = _decode_tuning(64, rope=True)
    half = dict(ROPE=ROPE_HALF.value, ROT_DIM=128, DIAG_BLOCK_N=diagonal)
    yield ("attn rope decode gqa4 d128 (split 4)", *_attention(**half), 4, 2, options)
    yield ("attn rope decode gqa4 d128 (no split)", *_attention(**dict(half, NUM_SPLITS=1)), 4, 2, options)
    yield ("attn rope decode batch 1", *_attention(num_seqs=1, num_tokens=1, **half), 4, 2, options)
    yield ("attn rope decode batch 1 (PDL)", *_attention(num_seqs=1, num_tokens=1, **dict(half, PDL=True)), 4, 2,
           {**options, "launch_pdl": True})
    # small grids (batch 1 and 8): 32 keys per block, one diagonal block of 16
    diagonal32, _, options32 = _decode_tuning(32, rope=True)
    half32 = dict(half, BLOCK_N=32, DIAG_BLOCK_N=diagonal32)
    yield ("attn rope decode b1 (32 keys, s16, PDL)",
           *_attention(num_seqs=1, num_tokens=1, **dict(half32, NUM_SPLITS=16, PDL=True)), 4, 2,
           {**options32, "launch_pdl": True})
    yield ("attn rope decode b1 (32 keys, s16, PDL), traced",
           *_attention(num_seqs=1, num_tokens=1, **dict(half32, NUM_SPLITS=16, PDL=True, TRACE=True)), 4, 2,
           {**options32, "launch_pdl": True})
    yield ("attn rope decode b1 (32 keys, s16, PDL), second block early",
           *_attention(num_seqs=1, num_tokens=1, **dict(half32, NUM_SPLITS=16, PDL=True, SECOND_EARLY=True)), 4, 2,
           {**options32, "launch_pdl": True})
    yield ("attn rope decode smollm2 (32 keys, s32)",
           *_attention(GROUP=3, HEAD_DIM=64, BLOCK_D=64, **dict(half32, ROT_DIM=64, NUM_SPLITS=32)), 4, 2, options32)
    yield ("attn rope decode mha d128", *_attention(GROUP=1, GROUP_PAD=1, BLOCK_Q=16, **half), 4, 2, options)
    yield ("attn rope decode gqa3 d64 (smollm2)", *_attention(GROUP=3, HEAD_DIM=64, BLOCK_D=64,
                                                              **dict(half, ROT_DIM=64)), 4, 2, options)
    yield ("attn rope decode interleaved, partial 64/128",
           *_attention(**dict(half, ROPE=ROPE_INTERLEAVED.value, ROT_DIM=64)), 4, 2, options)
    yield ("attn rope prefill gqa4 d128 (BLOCK_M 128)", *_attention(BLOCK_Q=32, **prefill, ROPE=ROPE_HALF.value,
                                                                    ROT_DIM=128), 8, 2)
    yield from _fp8_pool_variants(half, prefill)
    write_ptrs = {**bf16_ptrs("k_ptr", "v_ptr", "cache_ptr", "out_ptr"), "slot_ptr": "*i64", "cu_seqlens_ptr": "*i64"}
    write_const = dict(NUM_KV_HEADS=8, HEAD_DIM=128, PAGE_SIZE=16, BLOCK_H=8, BLOCK_D=128, OUT_ROW=4096, BLOCK_OUT=4096)
    yield ("kv cache write (8 heads x 128, flashinfer)", kv_cache_write._write_kv_kernel, write_ptrs, write_const, 4, 1)
    yield ("kv cache write fp8 (8 heads x 128, flashinfer)", kv_cache_write._write_kv_kernel,
           {**write_ptrs, "cache_ptr": "*u8"}, write_const, 4, 1)
    norm_ptrs = bf16_ptrs("x_ptr", "residual_ptr", "weight_ptr", "out_ptr", "sum_ptr")
    pdl_on = {"launch_pdl": True}
    yield ("rms_norm 4096 (PDL)", norm._rms_norm_kernel, norm_ptrs, dict(BLOCK=4096, HAS_RESIDUAL=False, PDL=True),
           8, 1, pdl_on)
    yield ("add + rms_norm 4096 (PDL)", norm._rms_norm_kernel, norm_ptrs,
           dict(BLOCK=4096, HAS_RESIDUAL=True, PDL=True), 8, 1, pdl_on)
    act_ptrs = bf16_ptrs("gate_ptr", "up_ptr", "out_ptr")
    for act, ident in activation.ACTIVATION_IDS.items():
        yield (f"act_mul {act} (PDL)", activation._act_mul_kernel, act_ptrs,
               dict(ACTIVATION=ident, BLOCK=1024, PDL=True), 4, 1, pdl_on)
    rope_ptrs = bf16_ptrs("x_ptr", "cos_ptr", "sin_ptr", "out_ptr")
    rope_const = dict(HEAD_DIM=128, ROT_DIM=128, BLOCK_ROWS=16, BLOCK_D=128)
    for interleaved in (False, True):
        yield (f"rope d128 {'interleaved' if interleaved else 'half'}", rope._rope_kernel, rope_ptrs,
               dict(rope_const, INTERLEAVED=interleaved), 4, 1)
    yield from _gemv_variants()
    yield from _mla_variants()
    qk_ptrs = bf16_ptrs(*(f"{t}{n}_ptr" for t in "qk" for n in ("", "cos", "sin", "out")))
    yield ("rope_qk d128 half", rope._rope_qk_kernel, qk_ptrs, dict(rope_const, INTERLEAVED=False), 4, 1)
    yield from _quant_variants()
    yield from _fp8_tma_gemv_variants()
