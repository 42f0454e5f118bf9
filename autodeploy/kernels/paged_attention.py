"""Triton paged attention over the shared KV pool, with the cache write fused in: one launch per layer.

Varlen prefill, chunked prefill and decode run in one kernel. Work decomposition (all of it derived
from tensor *shapes*, never from metadata values, so the launch never synchronises with the host and
can be captured in a CUDA graph):

- a *query tile* is ``BLOCK_Q`` consecutive query tokens of one sequence times the ``GROUP`` query
  heads that share one KV head (GQA/MQA): ``BLOCK_M = BLOCK_Q * GROUP_PAD`` rows, so every K/V tile
  serves all query heads of its group;
- the grid is ``(cdiv(T, BLOCK_Q) + B, num_kv_heads, num_splits)``. Sequence ``b`` owns tiles from
  ``cu_seqlens[b] // BLOCK_Q + b`` on (an upper bound that needs no prefix sum of tile counts); a
  program finds its sequence by counting and exits if its tile is past the sequence's queries.
  Tiles from ``cu_seqlens[B] // BLOCK_Q + B`` on belong to no sequence: tile ``B + i`` zeroes the
  output rows of the padding tokens (``t >= cu_seqlens[B]``, CUDA-graph padding) among tokens
  ``[i * BLOCK_Q, (i + 1) * BLOCK_Q)``, so no memset is launched;
- keys below ``context_lens[b]`` are read from the pool, the step's new keys from the ``k``/``v``
  inputs (row ``cu_seqlens[b] + j - context_lens[b]`` for position ``j``). One program per (tile,
  KV head), the last split, writes the tile's new K/V into the pool at ``slot_mapping`` (-1 = skip).
  Nobody reads a pool slot written in the same launch: no race, no second kernel;
- ``num_splits > 1`` is flash-decoding: each split walks one contiguous segment of whole key blocks
  and writes a partial output and its log2-sum-exp; the split that arrives last at its tile's
  counter merges them into ``out``, so there is no combine kernel either. Splits past the tile's
  keys (short contexts) take no part; one split with keys stores straight to ``out``; a tile of one
  query token (decodes) merges its group's rows of all splits in one load (``_merge_token``), of
  16-byte vectors (the partials' strides are padded to be specialized as multiples of 16).
- before the PDL wait a program reads only what no kernel of the step writes: the metadata (its
  sequence and lengths, in one round trip under ``SEARCH_BLOCK`` sequences), the new key's slot
  and, in grids that do not fill the GPU (``AttentionLaunch.preload_kv``), its first block of
  pooled keys;
- with a fused rotary embedding (``ROPE``, from ``fuse_rope_attention``), q is rotated when its tile
  is loaded and every new key when it is loaded from the inputs, for attention and for the cache
  write alike (pooled keys were rotated when they were written); decode launches walk the new keys
  in blocks of 16 under a register cap (``decode_tuning``);
- an FP8 pool's keys and values are widened from e4m3 to fp16 for the dots (one instruction a pair;
  to bf16 it takes one more a value): q goes in as fp16 too, scaled by a power of two that keeps
  its largest value in fp16's range (``_fp16_queries``), and the scale comes out of the scores.

Query ``i`` of sequence ``b`` sits at position ``context_lens[b] + i`` and sees keys ``j`` with
``j <= pos`` (and ``pos - j < sliding_window``; with ``chunk_size``, ``j >= pos // chunk_size *
chunk_size``: the keys of its own chunk). ALiBi adds ``slope[head] * (j - pos)`` to the scores.
Chunks and ALiBi are constexpr switches like the window: without them the kernel is unchanged.
Softmax runs in the log2 domain in fp32. The new
keys must be those ``slot_mapping`` stores at the sequence's next positions (as the engine builds
them); a real token with slot -1 would attend to its own k/v, where the reference op reads the pool.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from . import pdl, trace
from .pdl import Trigger
from .attention_config import AttentionLaunch
from .paged_attention_blocks import (
    LOG2E, MASK_FULL, MASK_TAIL, ROPE_HALF, ROPE_INTERLEAVED, ROPE_NONE, _attend_tile, _fp16_queries,
    _load_key_block, _load_pooled_block, _locate_tile, _merge_splits, _merge_token, _rotated, _row_limits,
    _softmax_step, _split_keys, _write_new_kv,
)

SEARCH_BLOCK = 256  # sequences whose first tiles one load fetches (see _locate_tile)
# _merge_token holds splits x group x head dim fp32 values at once: up to 64 per thread of a 4-warp
# program (8B: 16 x 4 x 128, SmolLM2: 32 x 4 x 64). Larger groups (MQA) merge split by split.
MAX_TOKEN_MERGE = 8192
START, AFTER_WAIT = tl.constexpr(Trigger.START.value), tl.constexpr(Trigger.AFTER_WAIT.value)

# Decode launches with a fused rotary embedding or over an FP8 pool (see decode_tuning)
DECODE_DIAGONAL_BLOCK = 16
# 96 (five programs per SM, 2 spill instructions in the key loop) was 6-8% faster at 480 sequences x
# 192-256 keys and 2-3% slower at 64 and 256 x 512 (H200, 2026-12-04, kernels_gpu.py --context-sweep)
ROPE_DECODE_MAX_REGISTERS = 128
# An FP8 pool's decode: 128 registers (four programs of 128 threads per SM, as bf16; uncapped ptxas
# takes 168: three) and three stages, two key blocks in flight per program: as many blocks as bf16
# keeps in flight at two stages, where each block is half the bytes. With RoPE too the kernel spills
# in its key loop under 128 (one local load a block) and runs uncapped (0; ptxas takes 168).
# (tests/kernels/compile_sm90.py; the A/B on the GPU: bench/probes/fp8_kv_decode.py --sweep, which sets
# these as the sweeps set ROPE_DECODE_MAX_REGISTERS.)
FP8_DECODE_MAX_REGISTERS = 128
FP8_ROPE_DECODE_MAX_REGISTERS = 0
FP8_DECODE_STAGES = 3


# Values that change from step to step: specializing on them (== 1, divisible by 16) would compile
# new kernels while an engine serves, so they are plain runtime integers. (The split partials' strides
# change with the step's tokens too, but ``_partials`` pads them to multiples of 16 elements: they
# are specialized as such, which lets the merge load partial rows 16 bytes at a time.)
_DYNAMIC_ARGS = ["num_seqs", "num_tokens", "stride_bt"]
# The step's metadata are views of one int64 buffer (kvcache/metadata.py) at offsets that follow its
# token and sequence counts: whether each starts 16-byte aligned changes from step to step, and a
# kernel specialized on it compiled while serving (8B on an H100: context_lens, block_table and
# slot_mapping met unaligned by mixed steps, four compiles after ready). Unspecialized, the variants
# of tests/kernels/compile_sm90.py keep their registers, spills and load widths (prefills: the same SASS).
METADATA_POINTERS = ["context_lens_ptr", "cu_seqlens_ptr", "block_table_ptr", "slot_ptr"]


@triton.jit(do_not_specialize=_DYNAMIC_ARGS, do_not_specialize_on_alignment=METADATA_POINTERS)
def _paged_attention_kernel(
    out_ptr, part_out_ptr, part_lse_ptr, counters_ptr, q_ptr, k_ptr, v_ptr, cache_ptr, sinks_ptr,
    cos_ptr, sin_ptr, context_lens_ptr, cu_seqlens_ptr, block_table_ptr, slot_ptr, trace_ptr, num_seqs, num_tokens,
    scale, softcap, window,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
    stride_cb, stride_ckv, stride_cs, stride_ch, stride_bt,
    stride_ps, stride_pt, stride_ph, stride_ls, stride_lt, stride_rt, alibi_ptr, chunk, k_scale, v_scale,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr,
    NUM_SPLITS: tl.constexpr, SPLITS_PAD: tl.constexpr, TOKEN_MERGE: tl.constexpr, SEARCH_BLOCK: tl.constexpr,
    HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_SINKS: tl.constexpr,
    DOT_PRECISION: tl.constexpr, SPLIT_NEW_KEYS: tl.constexpr, ROPE: tl.constexpr, ROT_DIM: tl.constexpr,
    DIAG_BLOCK_N: tl.constexpr, PRELOAD_KV: tl.constexpr, SECOND_EARLY: tl.constexpr, TRIGGER: tl.constexpr,
    PDL: tl.constexpr,
    TRACE: tl.constexpr = False, HAS_CHUNK: tl.constexpr = False, HAS_ALIBI: tl.constexpr = False,
):
    # trace events (kernels/trace.py): 1 start, 2 after the wait, 6 q loaded (and rotated), 7 the
    # preloaded key block attended, 3 every key attended, 4 arrived at the merge counter, (a decode token's
    # merge) 8 split weights loaded, 9 partials loaded, 5 output stored
    trace.stamp(trace_ptr, 1, tl.program_id(0), TRACE)
    if TRIGGER == START:
        pdl.allow_dependents(PDL)
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    KV_FP8: tl.constexpr = cache_ptr.dtype.element_ty == tl.uint8  # an FP8 pool, passed as its bytes
    if KV_FP8:  # keys are attended to as cached, k / k_scale: their scores scaled back
        scale = scale * k_scale
    # Before the PDL wait: what no kernel of this step writes. The step's metadata is copied in
    # before its first kernel, and the pool below each sequence's context length was written by
    # earlier steps (this launch writes only the new keys' slots, which it never reads back).
    seq, q_start, q_len, ctx_len = _locate_tile(cu_seqlens_ptr, context_lens_ptr, tile, num_seqs, BLOCK_Q,
                                                SEARCH_BLOCK)
    owned = seq < num_seqs

    BLOCK_M: tl.constexpr = BLOCK_Q * GROUP_PAD
    rows = tl.arange(0, BLOCK_M)
    head = kv_head * GROUP + rows % GROUP_PAD
    dims = tl.arange(0, BLOCK_D)
    dim_ok = dims < HEAD_DIM
    q_first = (tile - (q_start // BLOCK_Q + seq)) * BLOCK_Q
    token = q_first + rows // GROUP_PAD
    row_ok = (token < q_len) & (rows % GROUP_PAD < GROUP) & owned
    q_rows = (q_start + token).to(tl.int64)
    cache_head = cache_ptr + kv_head * stride_ch
    table = block_table_ptr + seq.to(tl.int64) * stride_bt
    kv_lo, kv_hi, active = _split_keys(q_first, q_len, ctx_len, split, window, chunk, BLOCK_Q, BLOCK_N,
                                       NUM_SPLITS, HAS_WINDOW, HAS_CHUNK)
    # the split with the fewest keys writes the tile's new K/V, once
    writes_new_kv = row_ok & (rows % GROUP_PAD == 0) & (split == NUM_SPLITS - 1)
    slot = tl.load(slot_ptr + q_rows, mask=writes_new_kv, other=-1)
    cached_hi = tl.minimum(kv_hi, ctx_len)  # the split's pooled keys are [kv_lo, cached_hi)
    if PRELOAD_KV:  # the split's first block of pooled keys: its table entry and its K/V rows
        first_keys = kv_lo + tl.arange(0, BLOCK_N)
        first_ok = (first_keys < cached_hi) & owned & (q_first < q_len)
        first_k, first_v = _load_key_block(
            first_keys, first_ok, table, cache_head, stride_cb, stride_cs, stride_ckv, k_ptr, v_ptr, 0,
            stride_kt, stride_vt, dims, dim_ok, cos_ptr, sin_ptr, stride_rt, PAGE_SIZE, True, ROPE_NONE, ROT_DIM,
            k_scale, v_scale)
        if SECOND_EARLY:  # the second block's table entries too: its K/V are fetched right after q
            second_keys = first_keys + BLOCK_N
            second_ok = (second_keys < cached_hi) & owned & (q_first < q_len)
            second_page = tl.load(table + second_keys // PAGE_SIZE, mask=second_ok, other=0)
    pdl.wait(PDL)  # everything below reads activations or writes (kernels/pdl.py)
    trace.stamp(trace_ptr, 2, tile, TRACE)
    if TRIGGER == AFTER_WAIT:  # (AFTER_LOOP: at the program's exit)
        pdl.allow_dependents(PDL)

    if seq >= num_seqs:  # a padding tile: q_start is cu_seqlens[B], the first padding token
        if split == 0:
            token = ((tile - num_seqs) * BLOCK_Q + rows // GROUP_PAD).to(tl.int64)
            pad_ok = (token >= q_start) & (token < num_tokens) & (rows % GROUP_PAD < GROUP)
            dst = out_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :]
            tl.store(dst, tl.zeros([BLOCK_M, BLOCK_D], dtype=out_ptr.dtype.element_ty),
                     mask=pad_ok[:, None] & dim_ok[None, :])
        return
    if q_first >= q_len:
        return

    k_head = k_ptr + kv_head * stride_kh
    v_head = v_ptr + kv_head * stride_vh
    if split == NUM_SPLITS - 1:
        _write_new_kv(k_head, v_head, slot, cache_head, q_rows, stride_kt, stride_vt, stride_cb, stride_cs,
                      stride_ckv, dims, dim_ok, cos_ptr, sin_ptr, stride_rt, PAGE_SIZE, ROPE, ROT_DIM, k_scale, v_scale)
    if split >= active:  # no key of this tile falls to this split: it takes no part in the merge
        return
    q = tl.load(q_ptr + q_rows[:, None] * stride_qt + head[:, None] * stride_qh + dims[None, :],
                mask=row_ok[:, None] & dim_ok[None, :], other=0.0)
    if ROPE != ROPE_NONE:
        q = _rotated(q, q_ptr + q_rows * stride_qt + head * stride_qh, q_rows, row_ok, dims, cos_ptr, sin_ptr,
                     stride_rt, ROPE, ROT_DIM, False)
    if KV_FP8:  # the dots in fp16, to which e4m3 widens in one instruction a pair
        q, scale = _fp16_queries(q, scale)
    if SECOND_EARLY:  # (with PRELOAD_KV) issued before the dots, so that DRAM's latency overlaps them
        second_k, second_v = _load_pooled_block(second_keys, second_ok, second_page, cache_head, stride_cb,
                                                stride_cs, stride_ckv, dims, dim_ok, PAGE_SIZE)
    trace.stamp(trace_ptr, 6, (tl.sum(q.to(tl.float32)) != 0).to(tl.int32), TRACE)
    pos = ctx_len + token
    chunk_lo, alibi = _row_limits(pos, head, row_ok, chunk, alibi_ptr, HAS_CHUNK, HAS_ALIBI)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    if HAS_SINKS:
        if split == 0:  # the sink is one virtual key: counted once, in the first split
            m_i = tl.load(sinks_ptr + head, mask=row_ok, other=0.0).to(tl.float32) * LOG2E
            l_i = tl.full([BLOCK_M], 1.0, dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    cached_lo = kv_lo
    if PRELOAD_KV:  # first, so that its registers are free for the rest
        PRELOAD_MASK: tl.constexpr = MASK_FULL if (HAS_WINDOW or HAS_CHUNK) else MASK_TAIL
        cached_lo = kv_lo + BLOCK_N
        if kv_lo < cached_hi:
            acc, m_i, l_i = _softmax_step(q, first_k, first_v, acc, m_i, l_i, first_keys, first_ok, pos, scale,
                                          softcap, window, chunk_lo, alibi, HAS_SOFTCAP, HAS_WINDOW, DOT_PRECISION,
                                          PRELOAD_MASK, HAS_CHUNK, HAS_ALIBI)
        if SECOND_EARLY:
            cached_lo = kv_lo + 2 * BLOCK_N
            if kv_lo + BLOCK_N < cached_hi:
                acc, m_i, l_i = _softmax_step(q, second_k, second_v, acc, m_i, l_i, second_keys, second_ok, pos,
                                              scale, softcap, window, chunk_lo, alibi, HAS_SOFTCAP, HAS_WINDOW,
                                              DOT_PRECISION, PRELOAD_MASK, HAS_CHUNK, HAS_ALIBI)
        trace.stamp(trace_ptr, 7, (tl.sum(l_i) > 0).to(tl.int32), TRACE)
    acc, m_i, l_i = _attend_tile(
        q, acc, m_i, l_i, pos, q_first, q_len, ctx_len, q_start, kv_lo, cached_lo, cached_hi, kv_hi,
        table, cache_head, stride_cb, stride_cs, stride_ckv,
        k_head, v_head, stride_kt, stride_vt, dims, dim_ok, scale, softcap, window, chunk_lo, alibi,
        cos_ptr, sin_ptr, stride_rt,
        BLOCK_N, PAGE_SIZE, HAS_WINDOW, HAS_SOFTCAP,
        DOT_PRECISION, SPLIT_NEW_KEYS, ROPE, ROT_DIM, DIAG_BLOCK_N, HAS_CHUNK, HAS_ALIBI, k_scale, v_scale)

    store_mask = row_ok[:, None] & dim_ok[None, :]
    normed = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    if KV_FP8:  # values were cached as v / v_scale (the split merge is linear: partials scale alike)
        normed = normed * v_scale
    trace.stamp(trace_ptr, 3, (tl.sum(l_i) > 0).to(tl.int32), TRACE)
    if NUM_SPLITS == 1:
        _store_rows(out_ptr, q_rows, head, dims, stride_ot, stride_oh, store_mask, normed)
        trace.stamp(trace_ptr, 5, tile, TRACE)
    elif active == 1:  # a context short enough for one split: nothing to merge
        _store_rows(out_ptr, q_rows, head, dims, stride_ot, stride_oh, store_mask, normed)
        trace.stamp(trace_ptr, 5, tile, TRACE)
    else:
        _store_rows(part_out_ptr + split * stride_ps, q_rows, head, dims, stride_pt, stride_ph, store_mask,
                    normed)
        lse = tl.where(l_i > 0, m_i + tl.log2(tl.where(l_i > 0, l_i, 1.0)), float("-inf"))
        tl.store(part_lse_ptr + split * stride_ls + q_rows * stride_lt + head, lse, mask=row_ok)
        counter = counters_ptr + tile * tl.num_programs(1) + kv_head
        arrived = _arrive(counter)
        trace.stamp(trace_ptr, 4, arrived, TRACE)
        if arrived == active - 1:  # the last split of this tile to arrive merges, then resets
            one_token = False
            if TOKEN_MERGE:  # all splits of a group in registers at once (see MAX_TOKEN_MERGE)
                one_token = q_len - q_first == 1
            if one_token:  # one query token (decodes): its GROUP rows, every split in one load
                token_out = _merge_token(part_out_ptr, part_lse_ptr, q_start + q_first, kv_head * GROUP, active,
                                         stride_ps, stride_pt, stride_ph, stride_ls, stride_lt, trace_ptr,
                                         GROUP, GROUP_PAD, HEAD_DIM, BLOCK_D, SPLITS_PAD, TRACE)
                group_rows = tl.arange(0, GROUP_PAD)
                dst = (out_ptr + (q_start + q_first).to(tl.int64) * stride_ot
                       + (kv_head * GROUP + group_rows)[:, None] * stride_oh + dims[None, :])
                tl.store(dst, token_out.to(out_ptr.dtype.element_ty),
                         mask=(group_rows < GROUP)[:, None] & dim_ok[None, :])
                trace.stamp(trace_ptr, 5, (tl.sum(token_out) != 0).to(tl.int32), TRACE)
            else:
                merged = _merge_splits(part_out_ptr, part_lse_ptr, q_rows, head, row_ok, dims, dim_ok, stride_ps,
                                       stride_pt, stride_ph, stride_ls, stride_lt, active, SPLITS_PAD)
                _store_rows(out_ptr, q_rows, head, dims, stride_ot, stride_oh, store_mask, merged)
                trace.stamp(trace_ptr, 5, (tl.sum(merged) != 0).to(tl.int32), TRACE)
            tl.atomic_xchg(counter, 0, sem="relaxed", scope="gpu")


@triton.jit
def _store_rows(dst_ptr, token, head, dims, stride_t, stride_h, mask, values):
    """values [BLOCK_M, BLOCK_D] into rows (token, head) of a [T, H, D]-strided tensor, in its dtype."""
    dst = dst_ptr + token[:, None] * stride_t + head[:, None] * stride_h + dims[None, :]
    tl.store(dst, values.to(dst_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _arrive(counter):
    """Count this split's arrival at its tile's counter, after its partials are stored; returns the
    number of splits that arrived before it.

    Memory ordering (PTX memory model): every thread stored its share of the partials before the
    barrier, and the barrier orders those stores before the one atomic that Triton issues from a
    single thread for a scalar; that atomic releases at GPU scope, and release is cumulative, so it
    publishes the stores of the whole CTA (CUDA's cooperative-groups grid sync relies on this same
    bar.sync + one-thread gpu-scope release; the sm_90 SASS is MEMBAR.ALL.GPU, ATOMG.ADD.STRONG.GPU,
    CCTL.IVALL on thread 0). The increments of one counter form one modification order, so the split
    that reads NUM_SPLITS - 1 acquires (GPU scope) after every other split's release; Triton
    broadcasts the atomic's result to the CTA through shared memory behind a barrier, which orders
    every thread's partial loads after that acquire, and those loads bypass L1 (``.cg``) so no stale
    line can be hit. The last split then resets the counter: nobody else touches it in this launch,
    and kernel boundaries order the reset before the next launch or replay.
    """
    tl.debug_barrier()
    return tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")


def paged_attention_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    cu_seqlens: torch.Tensor,
    context_lens: torch.Tensor,
    block_table: torch.Tensor,
    slot_mapping: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    logit_softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    rope_cos: torch.Tensor | None = None,
    rope_sin: torch.Tensor | None = None,
    rope_interleaved: bool = False,
    chunk_size: int | None = None,
    alibi_slopes: torch.Tensor | None = None,
    launch: AttentionLaunch | None = None,
    trace_buffer: torch.Tensor | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """Write k/v into ``kv_cache`` and run paged causal attention of q [T, Hq, D] in one launch;
    returns [T, Hq, D] (rows of padding tokens past ``cu_seqlens[-1]`` are zero).

    With ``rope_cos``/``rope_sin`` ([T, R] per token) q and k are rotated in the kernel first (the
    rotated keys are cached). ``chunk_size``: each token sees only keys of its own chunk;
    ``alibi_slopes`` [Hq]: ALiBi's per-head slopes. A ``float8_e4m3fn`` pool is an FP8 KV cache:
    the new k/v are stored as ``e4m3(k / k_scale)`` (and v), and read back times their scale.
    ``launch`` overrides the block sizes and split count chosen from the shapes (tests use it).
    ``trace_buffer`` ([programs, trace.EVENTS] int64, GPU only; programs = (cdiv(T, block_q) + B) x KV
    heads x splits) records each program's events (``kernels/trace.py``).
    """
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if num_tokens == 0:
        return out
    num_seqs = cu_seqlens.shape[0] - 1
    max_kv_len = block_table.shape[1] * kv_cache.shape[2]
    launch = launch or AttentionLaunch.choose(
        num_tokens, num_seqs, num_heads, num_kv_heads, head_dim, max_kv_len, q.device, q.element_size())
    group = num_heads // num_kv_heads
    block_q = launch.block_q(group)
    grid = (triton.cdiv(num_tokens, block_q) + num_seqs, num_kv_heads, launch.num_splits)
    part_out, part_lse = _partials(launch.num_splits, q)
    counters = split_counters(grid[0] * num_kv_heads, q.device) if launch.num_splits > 1 else part_lse
    rope = _RoPEArgs.of(rope_cos, rope_sin, rope_interleaved, q)
    fp8_pool = kv_cache.dtype == torch.float8_e4m3fn
    diagonal_block_n, num_stages, options = decode_tuning(launch, rope_cos is not None, fp8_pool)
    has_window = sliding_window is not None and sliding_window > 0
    has_chunk = chunk_size is not None and chunk_size > 0
    alibi = alibi_slopes.float().contiguous() if alibi_slopes is not None else q  # (q: an unused pointer)
    preload = launch.decode and launch.preload_kv
    pool = kv_cache.view(torch.uint8) if fp8_pool else kv_cache  # (FP8: its bytes)
    _paged_attention_kernel[grid](
        out, part_out, part_lse, counters, q, k, v, pool, sinks if sinks is not None else q, rope.cos, rope.sin,
        context_lens, cu_seqlens, block_table, slot_mapping,
        trace.kernel_pointer(trace_buffer, grid[0] * grid[1] * grid[2], out),
        num_seqs, num_tokens, float(scale), float(logit_softcap or 1.0), int(sliding_window) if has_window else 0,
        *q.stride()[:2], *k.stride()[:2], *v.stride()[:2], *out.stride()[:2],
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3), block_table.stride(0),
        *part_out.stride()[:3], *part_lse.stride()[:2], rope.stride, alibi, int(chunk_size) if has_chunk else 0,
        float(k_scale), float(v_scale),
        GROUP=group, GROUP_PAD=triton.next_power_of_2(group), HEAD_DIM=head_dim,
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)), BLOCK_Q=block_q, BLOCK_N=launch.block_n,
        PAGE_SIZE=kv_cache.shape[2], NUM_SPLITS=launch.num_splits,
        SPLITS_PAD=triton.next_power_of_2(launch.num_splits), SEARCH_BLOCK=SEARCH_BLOCK,
        TOKEN_MERGE=_token_merge_fits(launch.num_splits, group, head_dim),
        HAS_WINDOW=has_window, HAS_SOFTCAP=bool(logit_softcap), HAS_SINKS=sinks is not None,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32", SPLIT_NEW_KEYS=not launch.decode,
        ROPE=rope.mode, ROT_DIM=rope.rot_dim, DIAG_BLOCK_N=diagonal_block_n,
        PRELOAD_KV=preload, SECOND_EARLY=preload and launch.second_block_early, TRIGGER=int(launch.trigger),
        TRACE=trace_buffer is not None, HAS_CHUNK=has_chunk, HAS_ALIBI=alibi_slopes is not None,
        num_warps=launch.num_warps, num_stages=num_stages, **options,
        **pdl.launch_options(q.device),
    )
    return out


def _token_merge_fits(num_splits: int, group: int, head_dim: int) -> bool:
    pad = triton.next_power_of_2
    return pad(num_splits) * pad(group) * max(16, pad(head_dim)) <= MAX_TOKEN_MERGE


def decode_tuning(launch: AttentionLaunch, rope: bool, fp8_pool: bool) -> tuple[int, int, dict]:
    """(keys per block of the diagonal loop, pipeline stages, compile options) of a launch.

    A decode launch with a fused RoPE or over an FP8 pool rotates or quantizes the few new keys of its
    tiles in registers: blocks of 16 keep that cost small (at 64, an FP8 pool's kernel took 255
    registers). RoPE: a cap of 128 registers keeps 4 programs of 128 threads per SM, as without RoPE;
    ptxas then parks a few values outside the loops (tests/kernels/compile_sm90.py). An FP8 pool: see
    FP8_DECODE_MAX_REGISTERS. Other launches run as ``launch`` says."""
    if not launch.decode or not (rope or fp8_pool):
        return launch.block_n, launch.num_stages, {}
    diagonal = min(launch.block_n, DECODE_DIAGONAL_BLOCK)
    if not fp8_pool:
        return diagonal, launch.num_stages, {"maxnreg": ROPE_DECODE_MAX_REGISTERS}
    cap = FP8_ROPE_DECODE_MAX_REGISTERS if rope else FP8_DECODE_MAX_REGISTERS
    return diagonal, FP8_DECODE_STAGES, {"maxnreg": cap} if cap else {}


@dataclass(frozen=True)
class _RoPEArgs:
    """The kernel's rotary arguments: cos/sin [T, R] sharing one row stride, the mode and R."""

    cos: torch.Tensor
    sin: torch.Tensor
    stride: int
    mode: int
    rot_dim: int

    @classmethod
    def of(cls, cos: torch.Tensor | None, sin: torch.Tensor | None, interleaved: bool,
           q: torch.Tensor) -> "_RoPEArgs":
        if cos is None:  # unused pointers; the kernel compiles exactly as without these arguments
            return cls(q, q, 0, ROPE_NONE.value, 0)
        rot_dim = cos.shape[-1]
        per_token = cos.dim() == 2 and cos.shape[0] == q.shape[0]
        if cos.shape != sin.shape or not per_token or rot_dim % 2 or rot_dim > q.shape[-1]:
            raise ValueError(f"rope cos/sin must be [T={q.shape[0]}, R] with R even and <= {q.shape[-1]}, "
                             f"got {tuple(cos.shape)} and {tuple(sin.shape)}")
        if cos.stride() != sin.stride() or cos.stride(-1) != 1:
            cos, sin = cos.contiguous(), sin.contiguous()
        mode = ROPE_INTERLEAVED if interleaved else ROPE_HALF
        return cls(cos, sin, cos.stride(0), mode.value, rot_dim)


def _partials(num_splits: int, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 scratch for split partial outputs [S, T, Hq, D] and their log2-sum-exp [S, T, Hq].

    Every stride but the last is a multiple of 16 elements, whatever the step's T (see _DYNAMIC_ARGS):
    the merge's loads of a partial row are then 16-byte vectors.
    """
    if num_splits == 1:
        dummy = torch.empty((1, 1, 1, 1), dtype=torch.float32, device=q.device)
        return dummy, dummy
    t, h, d = q.shape
    out = _padded_scratch((num_splits, t, h, d), q.device)
    lse = _padded_scratch((num_splits, t, h), q.device)
    return out, lse


def _padded_scratch(shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """An fp32 tensor of ``shape`` whose strides (but the last) are multiples of 16 elements: its
    last dimension padded."""
    storage = torch.empty((*shape[:-1], -(-shape[-1] // 16) * 16), dtype=torch.float32, device=device)
    return storage[..., :shape[-1]]


_COUNTERS: dict[tuple[torch.device, str], torch.Tensor] = {}
_RETIRED_COUNTERS: list[torch.Tensor] = []  # never freed: a captured CUDA graph may still use them


def split_counters(size: int, device: torch.device, owner: str = "attention") -> torch.Tensor:
    """At least ``size`` int32 arrival counters of the split merge on ``device``, all zero (one buffer
    per ``owner``: each kernel that merges splits this way keeps its own).

    Persistent and zeroed once, not per call: every launch leaves its counters at zero again. A
    buffer is replaced (by one of the next power of two) only when too small; the old one stays
    alive for the graphs captured with it. Launches that share a device share the counters, so two
    split launches must not run concurrently on different streams of one device.
    """
    buffer = _COUNTERS.get((device, owner))
    if buffer is None or buffer.numel() < size:
        if buffer is not None:
            _RETIRED_COUNTERS.append(buffer)
        # Outside a capture this is a one-time memset; inside one (a size the warm-up did not
        # allocate) the memset is captured too and re-zeroes the fresh buffer on every replay.
        buffer = torch.zeros(triton.next_power_of_2(size), dtype=torch.int32, device=device)
        _COUNTERS[(device, owner)] = buffer
    return buffer
