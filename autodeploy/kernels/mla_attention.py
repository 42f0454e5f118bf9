"""Triton MLA attention over a latent paged cache, with the up-projections absorbed.

The cache holds one entry per token, ``cat(c_kv, k_pe)`` (latent rank R, then the rotary key DR;
``autodeploy.kvcache.pool``), shared by every head. With the query's no-position half already taken
onto the latent (``q_lat = q_nope @ W_UK`` per head, done by the op), head h's score against token j is
``q_lat[h] . c_kv[j] + q_pe[h] . k_pe[j]`` and its output ``sum_j p[h, j] c_kv[j]`` (the op applies
W_UV afterwards): attention of all heads against one shared key/value head, whose key is the whole
entry and whose value is its first R values. Every cached entry is read once per tile of heads.

Two launches per layer: ``_write_entries`` stores the step's new entries at their slots (-1 skips),
then ``_mla_kernel`` attends. Work decomposition (from tensor shapes only, so a CUDA graph can capture
it): a tile is ``BLOCK_Q`` consecutive query tokens of one sequence times ``BLOCK_H`` heads; the grid
is ``(head blocks, cdiv(T, BLOCK_Q) + B, splits)``, tiles found by ``_locate_tile`` as in the paged
attention kernel (``paged_attention.py``), head blocks fastest so the programs reading the same
entries run together. Tiles past every sequence zero the output rows of padding tokens. With
``num_splits > 1`` (flash-decoding, for grids that would not fill the GPU) each split attends to a
contiguous share of the keys and stores a partial output and its log2-sum-exp; ``_merge_kernel``
combines them (and zeroes padding rows). Softmax runs in the log2 domain in fp32.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .paged_attention_blocks import LOG2E, _locate_tile, _split_keys

SEARCH_BLOCK = 256  # sequences whose first tiles one load fetches (see _locate_tile)
MAX_SPLITS = 16
MIN_KEYS_PER_SPLIT = 64
DECODE_TOKENS_PER_SEQ = 4  # at most this many tokens per sequence on average: a decode launch
_DYNAMIC_ARGS = ["num_seqs", "num_tokens", "stride_bt"]


@dataclass(frozen=True)
class MLALaunch:
    """Heads and query tokens per tile (their product, the tile's rows, is at least 16 for the
    tensor cores), keys per step, flash-decoding splits, warps."""

    block_h: int
    block_q: int
    block_n: int = 32
    num_splits: int = 1
    num_warps: int = 4

    @classmethod
    def choose(cls, num_tokens: int, num_seqs: int, heads: int, max_kv_len: int, device: torch.device) -> "MLALaunch":
        """Decode steps: 16-row tiles (one token x 16 heads where there are that many), split when the
        tiles would give fewer programs than 1.5 per SM; prefill steps: 32-row tiles, no split."""
        block_h = min(16, triton.next_power_of_2(heads))
        decode = num_tokens <= DECODE_TOKENS_PER_SEQ * num_seqs
        block_q = max(1, (16 if decode else 32) // block_h)
        if not decode:
            return cls(block_h, block_q, num_warps=8)
        programs = (triton.cdiv(num_tokens, block_q) + num_seqs) * triton.cdiv(heads, block_h)
        wanted = 1.5 * _multiprocessors(device) if device.type == "cuda" else 12
        splits = min(MAX_SPLITS, max(1, max_kv_len // MIN_KEYS_PER_SPLIT), max(1, int(wanted // programs)))
        return cls(block_h, block_q, num_splits=splits)


@functools.lru_cache(maxsize=None)
def _multiprocessors(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


@triton.jit
def _write_entries(c_ptr, pe_ptr, cache_ptr, slot_ptr, stride_ct, stride_pt, stride_cb, stride_cs,
                   RANK: tl.constexpr, ROPE_DIM: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr,
                   PAGE_SIZE: tl.constexpr):
    """Token ``program_id(0)``'s ``cat(c_kv, k_pe)`` into its cache slot (none for slot -1)."""
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t)
    if slot >= 0:
        dst = cache_ptr + (slot // PAGE_SIZE) * stride_cb + (slot % PAGE_SIZE) * stride_cs
        r = tl.arange(0, BLOCK_R)
        latent = tl.load(c_ptr + t * stride_ct + r, mask=r < RANK)
        tl.store(dst + r, latent.to(cache_ptr.dtype.element_ty), mask=r < RANK)
        p = tl.arange(0, BLOCK_P)
        rotary = tl.load(pe_ptr + t * stride_pt + p, mask=p < ROPE_DIM)
        tl.store(dst + RANK + p, rotary.to(cache_ptr.dtype.element_ty), mask=p < ROPE_DIM)


@triton.jit(do_not_specialize=_DYNAMIC_ARGS)
def _mla_kernel(
    out_ptr, part_out_ptr, part_lse_ptr, q_ptr, qpe_ptr, cache_ptr, context_lens_ptr, cu_seqlens_ptr,
    block_table_ptr, num_seqs, num_tokens, scale,
    stride_qt, stride_qh, stride_pt, stride_ph, stride_ot, stride_oh, stride_cb, stride_cs, stride_bt,
    stride_ps, stride_pst, stride_psh, stride_ls, stride_lt,
    HEADS: tl.constexpr, RANK: tl.constexpr, ROPE_DIM: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr,
    NUM_SPLITS: tl.constexpr, SEARCH_BLOCK: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    head_block, tile, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    seq, q_start, q_len, ctx_len = _locate_tile(cu_seqlens_ptr, context_lens_ptr, tile, num_seqs, BLOCK_Q,
                                                SEARCH_BLOCK)
    BLOCK_M: tl.constexpr = BLOCK_Q * BLOCK_H
    rows = tl.arange(0, BLOCK_M)
    head = head_block * BLOCK_H + rows % BLOCK_H
    r = tl.arange(0, BLOCK_R)
    if seq >= num_seqs:  # a padding tile: zero the rows of padding tokens among its token block
        if NUM_SPLITS == 1 and split == 0:
            token = ((tile - num_seqs) * BLOCK_Q + rows // BLOCK_H).to(tl.int64)
            pad_ok = (token >= q_start) & (token < num_tokens) & (head < HEADS)
            dst = out_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh + r[None, :]
            tl.store(dst, tl.zeros([BLOCK_M, BLOCK_R], dtype=out_ptr.dtype.element_ty),
                     mask=pad_ok[:, None] & (r < RANK)[None, :])
        return
    q_first = (tile - (q_start // BLOCK_Q + seq)) * BLOCK_Q
    if q_first >= q_len:
        return
    token = q_first + rows // BLOCK_H
    row_ok = (token < q_len) & (head < HEADS)
    q_rows = (q_start + token).to(tl.int64)
    kv_lo, kv_hi, active = _split_keys(q_first, q_len, ctx_len, split, 0, 0, BLOCK_Q, BLOCK_N, NUM_SPLITS,
                                       False, False)
    acc, m_i, l_i = _attend(q_ptr, qpe_ptr, cache_ptr, block_table_ptr + seq.to(tl.int64) * stride_bt, q_rows,
                            head, row_ok, ctx_len + token, kv_lo, kv_hi, scale, stride_qt, stride_qh, stride_pt,
                            stride_ph, stride_cb, stride_cs, RANK, ROPE_DIM, BLOCK_R, BLOCK_P, BLOCK_M, BLOCK_N,
                            PAGE_SIZE, DOT_PRECISION)
    normed = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    mask = row_ok[:, None] & (r < RANK)[None, :]
    if NUM_SPLITS == 1:
        dst = out_ptr + q_rows[:, None] * stride_ot + head[:, None] * stride_oh + r[None, :]
        tl.store(dst, normed.to(out_ptr.dtype.element_ty), mask=mask)
    else:  # splits without keys (split >= active) store an empty partial: the merge weighs it 0
        dst = part_out_ptr + split * stride_ps + q_rows[:, None] * stride_pst + head[:, None] * stride_psh + r[None, :]
        tl.store(dst, normed, mask=mask & (split < active))
        lse = tl.where(l_i > 0, m_i + tl.log2(tl.where(l_i > 0, l_i, 1.0)), float("-inf"))
        tl.store(part_lse_ptr + split * stride_ls + q_rows * stride_lt + head, lse, mask=row_ok)


@triton.jit
def _attend(q_ptr, qpe_ptr, cache_ptr, table, q_rows, head, row_ok, pos, kv_lo, kv_hi, scale,
            stride_qt, stride_qh, stride_pt, stride_ph, stride_cb, stride_cs,
            RANK: tl.constexpr, ROPE_DIM: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr,
            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """Online softmax of the tile's rows (query at position ``pos``) over entries [kv_lo, kv_hi), causal:
    (unnormalized output on the latent [BLOCK_M, BLOCK_R], running max and sum, log2 domain)."""
    r, p = tl.arange(0, BLOCK_R), tl.arange(0, BLOCK_P)
    r_ok, p_ok = r < RANK, p < ROPE_DIM
    q = tl.load(q_ptr + q_rows[:, None] * stride_qt + head[:, None] * stride_qh + r[None, :],
                mask=row_ok[:, None] & r_ok[None, :], other=0.0)
    q_pe = tl.load(qpe_ptr + q_rows[:, None] * stride_pt + head[:, None] * stride_ph + p[None, :],
                   mask=row_ok[:, None] & p_ok[None, :], other=0.0)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_R], dtype=tl.float32)
    for start in range(kv_lo, kv_hi, BLOCK_N):
        keys = start + tl.arange(0, BLOCK_N)
        key_ok = keys < kv_hi
        page = tl.load(table + keys // PAGE_SIZE, mask=key_ok, other=0).to(tl.int64)
        entry = cache_ptr + page * stride_cb + (keys % PAGE_SIZE) * stride_cs
        latent = tl.load(entry[:, None] + r[None, :], mask=key_ok[:, None] & r_ok[None, :], other=0.0)
        rotary = tl.load(entry[:, None] + RANK + p[None, :], mask=key_ok[:, None] & p_ok[None, :], other=0.0)
        s = tl.dot(q, tl.trans(latent.to(q.dtype)), input_precision=DOT_PRECISION)
        s += tl.dot(q_pe, tl.trans(rotary.to(q_pe.dtype)), input_precision=DOT_PRECISION)
        s = s * (scale * LOG2E)
        s = tl.where(key_ok[None, :] & (keys[None, :] <= pos[:, None]), s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_use)
        weights = tl.exp2(s - m_use[:, None])
        l_i = l_i * alpha + tl.sum(weights, 1)
        acc = acc * alpha[:, None] + tl.dot(weights.to(latent.dtype), latent, input_precision=DOT_PRECISION)
        m_i = m_new
    return acc, m_i, l_i


@triton.jit
def _merge_kernel(out_ptr, part_out_ptr, part_lse_ptr, cu_seqlens_ptr, num_seqs,
                  stride_ot, stride_oh, stride_ps, stride_pst, stride_psh, stride_ls, stride_lt,
                  HEADS: tl.constexpr, RANK: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr,
                  NUM_SPLITS: tl.constexpr, SPLITS_PAD: tl.constexpr):
    """Token ``program_id(0)``, heads of block ``program_id(1)``: the splits' partials weighed by their
    sums (zero rows for padding tokens past ``cu_seqlens[num_seqs]``)."""
    t = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    r = tl.arange(0, BLOCK_R)
    real = t < tl.load(cu_seqlens_ptr + num_seqs)
    head_ok = (heads < HEADS) & real
    splits = tl.arange(0, SPLITS_PAD)
    lse = tl.load(part_lse_ptr + splits[:, None] * stride_ls + t * stride_lt + heads[None, :],
                  mask=(splits < NUM_SPLITS)[:, None] & head_ok[None, :], other=float("-inf"))
    top = tl.max(lse, 0)
    top = tl.where(top == float("-inf"), 0.0, top)
    total = tl.sum(tl.exp2(lse - top[None, :]), 0)
    acc = tl.zeros([BLOCK_H, BLOCK_R], dtype=tl.float32)
    for s in range(NUM_SPLITS):
        split_lse = tl.load(part_lse_ptr + s * stride_ls + t * stride_lt + heads, mask=head_ok, other=float("-inf"))
        weight = tl.exp2(split_lse - top)
        part = tl.load(part_out_ptr + s * stride_ps + t * stride_pst + heads[:, None] * stride_psh + r[None, :],
                       mask=(head_ok & (weight > 0))[:, None] & (r < RANK)[None, :], other=0.0)
        acc += tl.where(weight[:, None] > 0, part * weight[:, None], 0.0)
    merged = acc / tl.where(total > 0, total, 1.0)[:, None]
    dst = out_ptr + t * stride_ot + heads[:, None] * stride_oh + r[None, :]
    tl.store(dst, merged.to(out_ptr.dtype.element_ty), mask=(heads < HEADS)[:, None] & (r < RANK)[None, :])


def mla_attention_fwd(
    q_lat: torch.Tensor,
    q_pe: torch.Tensor,
    c_kv: torch.Tensor,
    k_pe: torch.Tensor,
    cache: torch.Tensor,
    cu_seqlens: torch.Tensor,
    context_lens: torch.Tensor,
    block_table: torch.Tensor,
    slot_mapping: torch.Tensor,
    scale: float,
    launch: MLALaunch | None = None,
) -> torch.Tensor:
    """Write the step's entries (c_kv [T, R], k_pe [T, DR]) into ``cache`` [blocks, page, R + DR], then
    attend with q_lat [T, H, R] and q_pe [T, H, DR]; returns the latent-weighted sums [T, H, R] in
    q_lat's dtype (zero rows for padding tokens past ``cu_seqlens[-1]``). ``launch`` overrides the tile
    sizes and splits chosen from the shapes (tests use it)."""
    num_tokens, heads, rank = q_lat.shape
    rope_dim = q_pe.shape[-1]
    if cache.shape[-1] != rank + rope_dim or c_kv.shape[-1] != rank or k_pe.shape[-1] != rope_dim:
        raise ValueError(f"latent cache entries of {cache.shape[-1]} values for latents {rank} + rotary {rope_dim}")
    out = torch.empty(q_lat.shape, dtype=q_lat.dtype, device=q_lat.device)
    if num_tokens == 0:
        return out
    q_lat, q_pe, c_kv, k_pe = (t if t.stride(-1) == 1 else t.contiguous() for t in (q_lat, q_pe, c_kv, k_pe))
    num_seqs, page = cu_seqlens.shape[0] - 1, cache.shape[1]
    block_r, block_p = max(16, triton.next_power_of_2(rank)), max(16, triton.next_power_of_2(rope_dim))
    _write_entries[(num_tokens,)](c_kv, k_pe, cache, slot_mapping, c_kv.stride(0), k_pe.stride(0), cache.stride(0),
                                  cache.stride(1), RANK=rank, ROPE_DIM=rope_dim, BLOCK_R=block_r, BLOCK_P=block_p,
                                  PAGE_SIZE=page)
    launch = launch or MLALaunch.choose(num_tokens, num_seqs, heads, block_table.shape[1] * page, q_lat.device)
    splits = launch.num_splits
    grid = (triton.cdiv(heads, launch.block_h), triton.cdiv(num_tokens, launch.block_q) + num_seqs, splits)
    part_out = torch.empty((splits, num_tokens, heads, rank) if splits > 1 else (1, 1, 1, 1), dtype=torch.float32,
                           device=q_lat.device)
    part_lse = torch.empty((splits, num_tokens, heads) if splits > 1 else (1, 1, 1), dtype=torch.float32,
                           device=q_lat.device)
    _mla_kernel[grid](
        out, part_out, part_lse, q_lat, q_pe, cache, context_lens, cu_seqlens, block_table, num_seqs, num_tokens,
        float(scale), *q_lat.stride()[:2], *q_pe.stride()[:2], *out.stride()[:2], cache.stride(0), cache.stride(1),
        block_table.stride(0), *part_out.stride()[:3], *part_lse.stride()[:2],
        HEADS=heads, RANK=rank, ROPE_DIM=rope_dim, BLOCK_R=block_r, BLOCK_P=block_p, BLOCK_H=launch.block_h,
        BLOCK_Q=launch.block_q, BLOCK_N=launch.block_n, PAGE_SIZE=page, NUM_SPLITS=splits,
        SEARCH_BLOCK=SEARCH_BLOCK, DOT_PRECISION="ieee" if q_lat.dtype == torch.float32 else "tf32",
        num_warps=launch.num_warps,
    )
    if splits > 1:
        merge_h = min(16, triton.next_power_of_2(heads))
        _merge_kernel[(num_tokens, triton.cdiv(heads, merge_h))](
            out, part_out, part_lse, cu_seqlens, num_seqs, *out.stride()[:2], *part_out.stride()[:3],
            *part_lse.stride()[:2], HEADS=heads, RANK=rank, BLOCK_R=block_r, BLOCK_H=merge_h, NUM_SPLITS=splits,
            SPLITS_PAD=triton.next_power_of_2(splits),
        )
    return out
