"""Triton paged attention over the shared KV pool: varlen prefill, chunked prefill and decode in one kernel.

Work decomposition (all of it derived from tensor *shapes*, never from metadata values, so the launch
never synchronises with the host and can be captured in a CUDA graph):

- a *query tile* is ``BLOCK_Q`` consecutive query tokens of one sequence times the ``GROUP`` query
  heads that share one KV head (GQA/MQA): ``BLOCK_M = BLOCK_Q * GROUP_PAD`` rows, so every K/V tile
  loaded from the cache serves all query heads of its group;
- the grid is ``(T // BLOCK_Q + B, num_kv_heads, num_splits)``. Sequence ``b`` owns tiles from
  ``cu_seqlens[b] // BLOCK_Q + b`` on (an upper bound that needs no prefix sum of tile counts); a
  program finds its sequence by binary search and exits if its tile is past the sequence's queries;
- ``num_splits > 1`` is flash-decoding: each split walks one contiguous segment of the visible keys
  and writes a partial output and its log-sum-exp; :func:`_combine_kernel` merges them.

Query ``i`` of sequence ``b`` sits at position ``context_lens[b] + i`` and sees cached keys ``j`` with
``j <= pos`` (and ``pos - j < sliding_window``). Softmax runs in the log2 domain in fp32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .attention_config import AttentionLaunch
from .kv_cache_write import write_kv_cache

@triton.jit
def _find_sequence(cu_seqlens_ptr, tile, num_seqs, BLOCK_Q: tl.constexpr):
    """Largest b with cu_seqlens[b] // BLOCK_Q + b <= tile (binary search over the sequences)."""
    # typed tensors: loop-carried values must keep one type (an int arg equal to 1 is a constexpr)
    lo = tl.zeros([], dtype=tl.int32)
    hi = tl.zeros([], dtype=tl.int32) + num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        first_tile = tl.load(cu_seqlens_ptr + mid) // BLOCK_Q + mid
        if first_tile <= tile:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _tanh(x):
    # tanh through exp; saturates correctly at +-inf in fp32
    return 1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)


@triton.jit
def _attend_keys(
    q, acc, m_i, l_i, start, kv_hi, pos, table, cache_head, stride_cb, stride_cs, stride_ckv,
    dims, dim_ok, scale, softcap, window,
    BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_WINDOW: tl.constexpr,
    DOT_PRECISION: tl.constexpr, MASKED: tl.constexpr,
):
    """One online-softmax step over keys [start, start + BLOCK_N) gathered from the paged cache."""
    keys = start + tl.arange(0, BLOCK_N)
    key_ok = keys < kv_hi
    page = tl.load(table + keys // PAGE_SIZE, mask=key_ok, other=0)
    slot = page * stride_cb + (keys % PAGE_SIZE) * stride_cs
    k_t = tl.load(cache_head + slot[None, :] + dims[:, None], mask=key_ok[None, :] & dim_ok[:, None], other=0.0)
    s = tl.dot(q, k_t.to(q.dtype), input_precision=DOT_PRECISION) * scale
    if HAS_SOFTCAP:
        s = softcap * _tanh(s / softcap)
    s = s * 1.4426950408889634  # log2(e): softmax in base 2
    if MASKED:
        visible = key_ok[None, :] & (keys[None, :] <= pos[:, None])
        if HAS_WINDOW:
            visible = visible & (pos[:, None] - keys[None, :] < window)
        s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_ref = m_new
    if MASKED:  # rows with nothing visible yet keep m = -inf; exponentiate against 0 instead
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_ref)
    p = tl.exp2(s - m_ref[:, None])
    v = tl.load(cache_head + stride_ckv + slot[:, None] + dims[None, :], mask=key_ok[:, None] & dim_ok[None, :],
                other=0.0)
    acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype), input_precision=DOT_PRECISION)
    return acc, m_new, l_i * alpha + tl.sum(p, 1)


@triton.jit
def _paged_attention_kernel(
    out_ptr, part_out_ptr, part_lse_ptr, q_ptr, cache_ptr, sinks_ptr,
    context_lens_ptr, cu_seqlens_ptr, block_table_ptr, num_seqs,
    scale, softcap, window,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_cb, stride_ckv, stride_cs, stride_ch, stride_bt,
    stride_ps, stride_pt, stride_ph, stride_ls, stride_lt,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr, NUM_SPLITS: tl.constexpr,
    HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_SINKS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq = _find_sequence(cu_seqlens_ptr, tile, num_seqs, BLOCK_Q)
    q_start = tl.load(cu_seqlens_ptr + seq)
    q_len = tl.load(cu_seqlens_ptr + seq + 1) - q_start
    q_first = (tile - (q_start // BLOCK_Q + seq)) * BLOCK_Q
    if q_first >= q_len:
        return
    ctx_len = tl.load(context_lens_ptr + seq)

    BLOCK_M: tl.constexpr = BLOCK_Q * GROUP_PAD
    rows = tl.arange(0, BLOCK_M)
    token = q_first + rows // GROUP_PAD
    head = kv_head * GROUP + rows % GROUP_PAD
    row_ok = (token < q_len) & (rows % GROUP_PAD < GROUP)
    pos = ctx_len + token
    dims = tl.arange(0, BLOCK_D)
    dim_ok = dims < HEAD_DIM
    q_rows = (q_start + token).to(tl.int64)
    q = tl.load(q_ptr + q_rows[:, None] * stride_qt + head[:, None] * stride_qh + dims[None, :],
                mask=row_ok[:, None] & dim_ok[None, :], other=0.0)

    # keys visible to some row of this tile, then this split's share of them
    kv_hi = ctx_len + tl.minimum(q_first + BLOCK_Q, q_len)
    kv_lo = 0
    if HAS_WINDOW:
        kv_lo = tl.maximum(ctx_len + q_first - window + 1, 0)
    if NUM_SPLITS > 1:
        per_split = tl.cdiv(tl.cdiv(kv_hi - kv_lo, NUM_SPLITS), BLOCK_N) * BLOCK_N
        kv_lo = kv_lo + split * per_split
        kv_hi = tl.minimum(kv_hi, kv_lo + per_split)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    if HAS_SINKS:
        if split == 0:  # the sink is one virtual key: counted once, in the first split
            m_i = tl.load(sinks_ptr + head, mask=row_ok, other=0.0).to(tl.float32) * 1.4426950408889634
            l_i = tl.full([BLOCK_M], 1.0, dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    cache_head = cache_ptr + kv_head * stride_ch
    table = block_table_ptr + seq.to(tl.int64) * stride_bt
    # Whole key blocks that every row of the tile sees (at or before its first position) need no
    # mask; only the blocks on the diagonal (and, with a window, all of them) are masked.
    if HAS_WINDOW:
        unmasked_end = kv_lo
    else:
        seen_by_all = tl.minimum(kv_hi, ctx_len + q_first + 1)
        unmasked_end = kv_lo + tl.maximum(seen_by_all - kv_lo, 0) // BLOCK_N * BLOCK_N
    for start in range(kv_lo, unmasked_end, BLOCK_N):
        acc, m_i, l_i = _attend_keys(
            q, acc, m_i, l_i, start, kv_hi, pos, table, cache_head, stride_cb, stride_cs, stride_ckv,
            dims, dim_ok, scale, softcap, window, BLOCK_N, PAGE_SIZE, HAS_SOFTCAP, HAS_WINDOW, DOT_PRECISION, False)
    for start in range(unmasked_end, kv_hi, BLOCK_N):
        acc, m_i, l_i = _attend_keys(
            q, acc, m_i, l_i, start, kv_hi, pos, table, cache_head, stride_cb, stride_cs, stride_ckv,
            dims, dim_ok, scale, softcap, window, BLOCK_N, PAGE_SIZE, HAS_SOFTCAP, HAS_WINDOW, DOT_PRECISION, True)

    normed = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    store_mask = row_ok[:, None] & dim_ok[None, :]
    if NUM_SPLITS == 1:
        dst = out_ptr + q_rows[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :]
        tl.store(dst, normed.to(out_ptr.dtype.element_ty), mask=store_mask)
    else:
        part = part_out_ptr + split * stride_ps + q_rows[:, None] * stride_pt + head[:, None] * stride_ph
        tl.store(part + dims[None, :], normed, mask=store_mask)
        lse = tl.where(l_i > 0, m_i + tl.log2(tl.where(l_i > 0, l_i, 1.0)), float("-inf"))
        tl.store(part_lse_ptr + split * stride_ls + q_rows * stride_lt + head, lse, mask=row_ok)


@triton.jit
def _combine_kernel(
    out_ptr, part_out_ptr, part_lse_ptr, cu_seqlens_ptr, num_seqs,
    stride_ot, stride_oh, stride_ps, stride_pt, stride_ph, stride_ls, stride_lt,
    NUM_SPLITS: tl.constexpr, SPLITS_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """out[t, h] = sum_s w_s * partial_s with w_s proportional to 2^lse_s (tokens of some sequence only)."""
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    if token >= tl.load(cu_seqlens_ptr + num_seqs):
        return  # padding row, zeroed by the cache-write kernel
    splits = tl.arange(0, SPLITS_PAD)
    dims = tl.arange(0, BLOCK_D)
    lse = tl.load(part_lse_ptr + splits * stride_ls + token * stride_lt + head,
                  mask=splits < NUM_SPLITS, other=float("-inf"))
    m = tl.max(lse, 0)
    weight = tl.exp2(lse - tl.where(m == float("-inf"), 0.0, m))
    mask = (splits[:, None] < NUM_SPLITS) & (dims[None, :] < HEAD_DIM)
    parts = tl.load(part_out_ptr + splits[:, None] * stride_ps + token * stride_pt + head * stride_ph + dims[None, :],
                    mask=mask, other=0.0)
    total = tl.sum(weight, 0)
    merged = tl.sum(parts * weight[:, None], 0) / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + token * stride_ot + head * stride_oh + dims, merged.to(out_ptr.dtype.element_ty),
             mask=dims < HEAD_DIM)


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
    launch: AttentionLaunch | None = None,
) -> torch.Tensor:
    """Write k/v into ``kv_cache``, then paged causal attention of q [T, Hq, D]; returns [T, Hq, D].

    ``launch`` overrides the block sizes and split count chosen from the shapes (tests use it).
    """
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    write_kv_cache(k, v, kv_cache, slot_mapping, out, cu_seqlens)
    num_seqs = cu_seqlens.shape[0] - 1
    if num_tokens == 0 or num_seqs == 0:
        return out
    launch = launch or AttentionLaunch.choose(
        num_tokens, num_seqs, num_heads, num_kv_heads, head_dim, block_table.shape[1] * kv_cache.shape[2], q.device
    )
    group = num_heads // num_kv_heads
    block_q = launch.block_q(group)
    grid = (num_tokens // block_q + num_seqs, num_kv_heads, launch.num_splits)
    part_out, part_lse = _partials(launch.num_splits, q)
    has_window = sliding_window is not None and sliding_window > 0
    _paged_attention_kernel[grid](
        out, part_out, part_lse, q, kv_cache, sinks if sinks is not None else q,
        context_lens, cu_seqlens, block_table, num_seqs,
        float(scale), float(logit_softcap or 1.0), int(sliding_window) if has_window else 0,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3), block_table.stride(0),
        *part_out.stride()[:3], *part_lse.stride()[:2],
        GROUP=group, GROUP_PAD=triton.next_power_of_2(group), HEAD_DIM=head_dim,
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)), BLOCK_Q=block_q, BLOCK_N=launch.block_n,
        PAGE_SIZE=kv_cache.shape[2], NUM_SPLITS=launch.num_splits,
        HAS_WINDOW=has_window, HAS_SOFTCAP=bool(logit_softcap), HAS_SINKS=sinks is not None,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=launch.num_warps, num_stages=launch.num_stages,
    )
    if launch.num_splits > 1:
        _combine_kernel[(num_tokens, num_heads)](
            out, part_out, part_lse, cu_seqlens, num_seqs,
            out.stride(0), out.stride(1), *part_out.stride()[:3], *part_lse.stride()[:2],
            NUM_SPLITS=launch.num_splits, SPLITS_PAD=triton.next_power_of_2(launch.num_splits),
            HEAD_DIM=head_dim, BLOCK_D=triton.next_power_of_2(head_dim), num_warps=4,
        )
    return out


def _partials(num_splits: int, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 scratch for split partial outputs [S, T, Hq, D] and their log2-sum-exp [S, T, Hq]."""
    if num_splits == 1:
        dummy = torch.empty((1, 1, 1, 1), dtype=torch.float32, device=q.device)
        return dummy, dummy
    t, h, d = q.shape
    return (torch.empty((num_splits, t, h, d), dtype=torch.float32, device=q.device),
            torch.empty((num_splits, t, h), dtype=torch.float32, device=q.device))


