"""Building blocks (``@triton.jit`` helpers) of the paged-attention kernel in ``paged_attention.py``.

Keys come from two places: positions ``< context_len`` from the paged pool, the step's own new keys
(positions ``context_len ..``) straight from the ``k``/``v`` inputs. The kernel writes those new keys
into the pool in the same launch, so it must never read them back from there. With a fused rotary
embedding, q and every new key are rotated where they are loaded from the inputs (pooled keys were
rotated before they were cached), each one in fp32 and rounded to the input dtype, as the
``rope_qk`` kernel rounds them.

An FP8 pool is passed as its bytes (a ``uint8`` pointer: the interpreter reads e4m3 exactly only
that way); every helper tells it from the pointer's type, so the code of a pool in a float dtype is
unchanged. Pooled bytes are reinterpreted as e4m3; the step's new keys and values are quantized as
the pool stores them (``_to_e4m3``: ``x / scale`` rounded on the e4m3 grid, saturating) before they
are written or attended to. Attention takes e4m3 values as they are: the kernel folds ``k_scale``
into the score scale and ``v_scale`` into the output.
"""

from __future__ import annotations

import triton
import triton.language as tl

from . import trace
from .fp8_quantize import round_to_e4m3

LOG2E = tl.constexpr(1.4426950408889634)
# Masking of a key block's scores (constexpr): none (every row sees every key), only keys past the
# range's end (cached keys: no row's position is before them), or causal + window + end.
MASK_NONE = tl.constexpr(0)
MASK_TAIL = tl.constexpr(1)
MASK_FULL = tl.constexpr(2)
# Fused rotary embedding (constexpr): none, half-rotate (NeoX/Llama), interleaved pairs (GPT-J)
ROPE_NONE = tl.constexpr(0)
ROPE_HALF = tl.constexpr(1)
ROPE_INTERLEAVED = tl.constexpr(2)


@triton.jit
def _locate_tile(cu_seqlens_ptr, context_lens_ptr, tile, num_seqs, BLOCK_Q: tl.constexpr,
                 SEARCH_BLOCK: tl.constexpr):
    """(b, q_start, q_len, ctx_len) of the sequence b owning ``tile``: the largest b <= num_seqs with
    cu_seqlens[b] // BLOCK_Q + b <= tile (``num_seqs`` for a tile past every sequence's, one that
    zeroes padding rows; its q_start is cu_seqlens[num_seqs] and its ctx_len 0).

    The first tiles are nondecreasing in b, so b is a count, taken over blocks of SEARCH_BLOCK
    sequences whose loads are independent (a binary search needs log2(B) dependent round trips).
    Under SEARCH_BLOCK sequences, the lengths come out of the same loads: one memory round trip.
    """
    b = tl.arange(0, SEARCH_BLOCK)
    starts = tl.load(cu_seqlens_ptr + b, mask=b <= num_seqs, other=0)
    ends = tl.load(cu_seqlens_ptr + b + 1, mask=b < num_seqs, other=0)
    contexts = tl.load(context_lens_ptr + b, mask=b < num_seqs, other=0)
    count = tl.sum(((starts // BLOCK_Q + b <= tile) & (b <= num_seqs)).to(tl.int32), 0)
    for first in range(SEARCH_BLOCK, num_seqs + 1, SEARCH_BLOCK):  # only batches of SEARCH_BLOCK or more
        more = first + b
        inside = more <= num_seqs
        more_starts = tl.load(cu_seqlens_ptr + more, mask=inside, other=0)
        count += tl.sum(((more_starts // BLOCK_Q + more <= tile) & inside).to(tl.int32), 0)
    seq = count - 1
    if num_seqs < SEARCH_BLOCK:
        picked = b == seq
        q_start = tl.sum(tl.where(picked, starts, 0), 0)
        q_end = tl.sum(tl.where(picked, ends, 0), 0)
        ctx_len = tl.sum(tl.where(picked, contexts, 0), 0)
    else:
        owned = seq < num_seqs
        q_start = tl.load(cu_seqlens_ptr + seq)
        q_end = tl.load(cu_seqlens_ptr + seq + 1, mask=owned, other=0)
        ctx_len = tl.load(context_lens_ptr + seq, mask=owned, other=0)
    return seq, q_start, q_end - q_start, ctx_len


@triton.jit
def _tanh(x):
    # tanh through exp; saturates correctly at +-inf in fp32
    return 1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)


@triton.jit
def _rotated(x, src, rope_rows, row_ok, dims, cos_ptr, sin_ptr, stride_rt,
             ROPE: tl.constexpr, ROT_DIM: tl.constexpr, TRANSPOSED: tl.constexpr):
    """x rotated like ``autodeploy::rope``: x holds rows of head vectors loaded from ``src`` (one pointer
    per row) + dims, as [rows, BLOCK_D], or [BLOCK_D, rows] when TRANSPOSED; row i takes the cos/sin
    of token row ``rope_rows[i]``. Column j becomes x[j] cos[j] + sign(j) x[partner(j)] sin[j] for
    j < ROT_DIM: the partner half comes from a second load of the same (cached) lines."""
    if ROPE == ROPE_INTERLEAVED:
        partner = dims ^ 1
        sign = tl.where(dims % 2 == 0, -1.0, 1.0)
    else:
        half: tl.constexpr = ROT_DIM // 2
        partner = tl.where(dims < half, dims + half, dims - half)
        sign = tl.where(dims < half, -1.0, 1.0)
    rotated = dims < ROT_DIM
    trig_row = rope_rows.to(tl.int64) * stride_rt
    if TRANSPOSED:
        mask = row_ok[None, :] & rotated[:, None]
        partner_src, trig, sign = src[None, :] + partner[:, None], trig_row[None, :] + dims[:, None], sign[:, None]
    else:
        mask = row_ok[:, None] & rotated[None, :]
        partner_src, trig, sign = src[:, None] + partner[None, :], trig_row[:, None] + dims[None, :], sign[None, :]
    x_partner = tl.load(partner_src, mask=mask, other=0.0).to(tl.float32)
    cos = tl.load(cos_ptr + trig, mask=mask, other=1.0).to(tl.float32)
    sin = tl.load(sin_ptr + trig, mask=mask, other=0.0).to(tl.float32)
    return (x.to(tl.float32) * cos + sign * x_partner * sin).to(x.dtype)


@triton.jit
def _load_key_block(
    keys, key_ok, table, cache_head, stride_cb, stride_cs, stride_ckv, k_head, v_head, new_row0,
    stride_kt, stride_vt, dims, dim_ok, cos_ptr, sin_ptr, stride_rt,
    PAGE_SIZE: tl.constexpr, FROM_POOL: tl.constexpr, ROPE: tl.constexpr, ROT_DIM: tl.constexpr, k_scale, v_scale,
):
    """K^T [BLOCK_D, BLOCK_N] and V [BLOCK_N, BLOCK_D] of ``keys`` (masked-out keys read as 0), from the
    pool or from the step's inputs; new keys are rotated (ROPE) and rounded through the pool's dtype
    (an FP8 pool's: quantized with ``k_scale``/``v_scale``), as the reference reads them back from the pool."""
    if FROM_POOL:
        page = tl.load(table + keys // PAGE_SIZE, mask=key_ok, other=0)
        k_t, v = _load_pooled_block(keys, key_ok, page, cache_head, stride_cb, stride_cs, stride_ckv, dims, dim_ok,
                                    PAGE_SIZE)
    else:
        row = (keys + new_row0).to(tl.int64)  # input row of key j: cu_seqlens[b] + j - context_len
        k_src = k_head + row * stride_kt
        k_t, v = _load_kv_rows(k_src, v_head + row * stride_vt, key_ok, dims, dim_ok)
        if ROPE != ROPE_NONE:
            k_t = _rotated(k_t, k_src, row, key_ok, dims, cos_ptr, sin_ptr, stride_rt, ROPE, ROT_DIM, True)
        k_t, v = _as_cached(k_t, cache_head, k_scale), _as_cached(v, cache_head, v_scale)
    return k_t, v


@triton.jit
def _load_pooled_block(keys, key_ok, page, cache_head, stride_cb, stride_cs, stride_ckv, dims, dim_ok,
                       PAGE_SIZE: tl.constexpr):
    """K^T [BLOCK_D, BLOCK_N] and V [BLOCK_N, BLOCK_D] of pooled ``keys`` whose block-table entries
    (``page``, one per key) are already loaded."""
    k_src = cache_head + page * stride_cb + (keys % PAGE_SIZE) * stride_cs
    k_t, v = _load_kv_rows(k_src, k_src + stride_ckv, key_ok, dims, dim_ok)
    if cache_head.dtype.element_ty == tl.uint8:  # an FP8 pool's bytes
        k_t, v = k_t.to(tl.float8e4nv, bitcast=True), v.to(tl.float8e4nv, bitcast=True)
    return k_t, v


@triton.jit
def _fp16_queries(q, scale):
    """A 16-bit q tile as fp16 times 2**shift, the shift putting its largest magnitude in [2**14, 2**15)
    (bf16 has 8 significant bits, fp16 11: every value then converts exactly but those 2**25 times
    smaller than the largest, which round as fp16 subnormals), and ``scale`` times 2**-shift: the
    scores are unchanged. An fp32 q stays as it is (its dots run in fp32)."""
    if q.dtype.primitive_bitwidth == 16:
        amax = tl.max(tl.max(tl.abs(q.to(tl.float32)), 1), 0)
        exponent = ((amax.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
        shift = tl.minimum(tl.maximum(14 - exponent, -64), 64)  # (an all-zero tile: any shift)
        q = (q.to(tl.float32) * ((127 + shift) << 23).to(tl.float32, bitcast=True)).to(tl.float16)
        scale = scale * ((127 - shift) << 23).to(tl.float32, bitcast=True)
    return q, scale


@triton.jit
def _to_e4m3(x, scale):
    """``x / scale`` as an FP8 pool stores it: rounded to the nearest e4m3 value (ties to even), saturating."""
    return round_to_e4m3(tl.math.div_rn(x.to(tl.float32), scale)).to(tl.float8e4nv)


@triton.jit
def _as_cached(x, cache_head, scale):
    """``x`` rounded through the pool's dtype as it is attended to (an FP8 pool: e4m3 of ``x / scale``)."""
    if cache_head.dtype.element_ty == tl.uint8:  # (one return: the compiler types every return statement)
        cached = _to_e4m3(x, scale)
    else:
        cached = x.to(cache_head.dtype.element_ty)
    return cached


@triton.jit
def _load_kv_rows(k_src, v_src, key_ok, dims, dim_ok):
    """K^T [BLOCK_D, BLOCK_N] and V [BLOCK_N, BLOCK_D] from one row pointer per key (masked-out keys 0).

    V is issued right after K, not after the K dot: both loads are in flight together."""
    k_t = tl.load(k_src[None, :] + dims[:, None], mask=key_ok[None, :] & dim_ok[:, None], other=0.0)
    v = tl.load(v_src[:, None] + dims[None, :], mask=key_ok[:, None] & dim_ok[None, :], other=0.0)
    return k_t, v


@triton.jit
def _softmax_step(
    q, k_t, v, acc, m_i, l_i, keys, key_ok, pos, scale, softcap, window, chunk_lo, alibi,
    HAS_SOFTCAP: tl.constexpr, HAS_WINDOW: tl.constexpr, DOT_PRECISION: tl.constexpr, MASK: tl.constexpr,
    HAS_CHUNK: tl.constexpr, HAS_ALIBI: tl.constexpr,
):
    """One online-softmax update (log2 domain, fp32) of acc/m_i/l_i with one block of keys.

    ``chunk_lo`` (HAS_CHUNK): each row's first visible key, the start of its chunk; ``alibi``
    (HAS_ALIBI): each row's ALiBi slope times log2(e), the bias being slope * (key - pos)."""
    s = tl.dot(q, k_t.to(q.dtype), input_precision=DOT_PRECISION) * scale
    if HAS_SOFTCAP:
        s = softcap * _tanh(s / softcap)
    s = s * LOG2E
    if HAS_ALIBI:
        s += alibi[:, None] * (keys[None, :] - pos[:, None]).to(tl.float32)
    if MASK == MASK_TAIL:
        s = tl.where(key_ok[None, :], s, float("-inf"))
    elif MASK == MASK_FULL:
        visible = key_ok[None, :] & (keys[None, :] <= pos[:, None])
        if HAS_WINDOW:
            visible = visible & (pos[:, None] - keys[None, :] < window)
        if HAS_CHUNK:
            visible = visible & (keys[None, :] >= chunk_lo[:, None])
        s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_ref = m_new
    if MASK == MASK_FULL:  # rows with nothing visible yet keep m = -inf; exponentiate against 0 instead
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_ref)
    p = tl.exp2(s - m_ref[:, None])
    acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype), input_precision=DOT_PRECISION)
    return acc, m_new, l_i * alpha + tl.sum(p, 1)


@triton.jit
def _attend_range(
    q, acc, m_i, l_i, lo, hi, kv_hi, pos, table, cache_head, stride_cb, stride_cs, stride_ckv,
    k_head, v_head, new_row0, stride_kt, stride_vt, dims, dim_ok, scale, softcap, window, chunk_lo, alibi,
    cos_ptr, sin_ptr, stride_rt,
    BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_WINDOW: tl.constexpr,
    DOT_PRECISION: tl.constexpr, FROM_POOL: tl.constexpr, MASK: tl.constexpr, ROPE: tl.constexpr,
    ROT_DIM: tl.constexpr, HAS_CHUNK: tl.constexpr, HAS_ALIBI: tl.constexpr, k_scale, v_scale,
):
    """Attend to the key blocks starting at lo, lo + BLOCK_N, ... below hi (keys >= kv_hi masked out).

    Pooled keys: each block's block-table entries are loaded one iteration ahead, so that the
    pipelined K/V copies of the next block need no table round trip of their own."""
    if FROM_POOL:
        page = _block_pages(table, lo, kv_hi, BLOCK_N, PAGE_SIZE, HAS_WINDOW or HAS_CHUNK)
        for start in range(lo, hi, BLOCK_N):
            keys = start + tl.arange(0, BLOCK_N)
            key_ok = keys < kv_hi
            next_page = _block_pages(table, start + BLOCK_N, kv_hi, BLOCK_N, PAGE_SIZE, HAS_WINDOW or HAS_CHUNK)
            k_t, v = _load_pooled_block(keys, key_ok, page, cache_head, stride_cb, stride_cs, stride_ckv, dims,
                                        dim_ok, PAGE_SIZE)
            acc, m_i, l_i = _softmax_step(q, k_t, v, acc, m_i, l_i, keys, key_ok, pos, scale, softcap, window,
                                          chunk_lo, alibi, HAS_SOFTCAP, HAS_WINDOW, DOT_PRECISION, MASK, HAS_CHUNK,
                                          HAS_ALIBI)
            page = next_page
    else:
        for start in range(lo, hi, BLOCK_N):
            keys = start + tl.arange(0, BLOCK_N)
            key_ok = keys < kv_hi
            k_t, v = _load_key_block(keys, key_ok, table, cache_head, stride_cb, stride_cs, stride_ckv, k_head,
                                     v_head, new_row0, stride_kt, stride_vt, dims, dim_ok, cos_ptr, sin_ptr,
                                     stride_rt, PAGE_SIZE, FROM_POOL, ROPE, ROT_DIM, k_scale, v_scale)
            acc, m_i, l_i = _softmax_step(q, k_t, v, acc, m_i, l_i, keys, key_ok, pos, scale, softcap, window,
                                          chunk_lo, alibi, HAS_SOFTCAP, HAS_WINDOW, DOT_PRECISION, MASK, HAS_CHUNK,
                                          HAS_ALIBI)
    return acc, m_i, l_i


@triton.jit
def _block_pages(table, start, kv_hi, BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr, UNALIGNED: tl.constexpr):
    """The block-table entry of each key start, start + 1, ... of a block (0 past kv_hi), as int32.

    Where a block spans whole pages, one entry per page is loaded and repeated for its keys: a few
    values to keep across an iteration of the key loop instead of one per key. Blocks start at
    multiples of BLOCK_N unless a sliding window or a chunk starts them (``_split_keys``: UNALIGNED)."""
    if BLOCK_N % PAGE_SIZE == 0 and BLOCK_N > PAGE_SIZE and not UNALIGNED:
        PAGES: tl.constexpr = BLOCK_N // PAGE_SIZE
        first = start // PAGE_SIZE + tl.arange(0, PAGES)
        pages = tl.load(table + first, mask=first * PAGE_SIZE < kv_hi, other=0).to(tl.int32)
        return tl.reshape(tl.broadcast_to(pages[:, None], (PAGES, PAGE_SIZE)), (BLOCK_N,))
    keys = start + tl.arange(0, BLOCK_N)
    return tl.load(table + keys // PAGE_SIZE, mask=keys < kv_hi, other=0).to(tl.int32)


@triton.jit
def _split_keys(q_first, q_len, ctx_len, split, window, chunk, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr,
                NUM_SPLITS: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_CHUNK: tl.constexpr):
    """[kv_lo, kv_hi): this split's share of the keys visible to some row of the tile, in whole
    blocks, and ``active``: how many splits have a share (the later ones have none). The tile's first
    row sees the earliest keys: its window's or its chunk's first."""
    kv_hi = ctx_len + tl.minimum(q_first + BLOCK_Q, q_len)
    kv_lo = 0
    if HAS_WINDOW:
        kv_lo = tl.maximum(ctx_len + q_first - window + 1, 0)
    if HAS_CHUNK:
        kv_lo = tl.maximum(kv_lo, (ctx_len + q_first) // chunk * chunk)
    active = 1
    if NUM_SPLITS > 1:
        per_split = tl.cdiv(tl.cdiv(kv_hi - kv_lo, NUM_SPLITS), BLOCK_N) * BLOCK_N
        active = tl.maximum(tl.cdiv(kv_hi - kv_lo, tl.maximum(per_split, 1)), 1)
        kv_lo = kv_lo + split * per_split
        kv_hi = tl.minimum(kv_hi, kv_lo + per_split)
    return kv_lo, kv_hi, active


@triton.jit
def _attend_tile(
    q, acc, m_i, l_i, pos, q_first, q_len, ctx_len, q_start, kv_lo, cached_lo, cached_hi, kv_hi, table, cache_head,
    stride_cb, stride_cs, stride_ckv, k_head, v_head, stride_kt, stride_vt, dims, dim_ok, scale, softcap, window,
    chunk_lo, alibi, cos_ptr, sin_ptr, stride_rt,
    BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
    DOT_PRECISION: tl.constexpr, SPLIT_NEW_KEYS: tl.constexpr, ROPE: tl.constexpr, ROT_DIM: tl.constexpr,
    DIAG_BLOCK_N: tl.constexpr, HAS_CHUNK: tl.constexpr, HAS_ALIBI: tl.constexpr, k_scale, v_scale,
):
    """acc/m_i/l_i (unnormalised output, running max and sum, log2 domain) of one tile updated with the
    split's keys [kv_lo, kv_hi), except the pooled ones below ``cached_lo`` (already attended); the
    pooled ones end at ``cached_hi``."""
    new_row0 = q_start - ctx_len  # input row of key j: q_start + j - ctx_len
    # The step's new keys [new_lo, kv_hi) first, from the inputs: whole blocks every row sees
    # (unmasked; only worth a loop of its own when tiles have many new keys), then the diagonal.
    # Their loads need no block table: a decode's single new-key block is fetched in the same
    # round trip as q. Then the cached keys [cached_lo, ctx_len), from the pool, masked only past
    # their end (and outside a window or a chunk: rows of one tile then see different first keys).
    new_lo = tl.maximum(kv_lo, ctx_len)
    diag_lo = new_lo
    if SPLIT_NEW_KEYS and not (HAS_WINDOW or HAS_CHUNK):
        seen_by_all = tl.minimum(kv_hi, ctx_len + q_first + 1)
        diag_lo = new_lo + tl.maximum(seen_by_all - new_lo, 0) // BLOCK_N * BLOCK_N
        acc, m_i, l_i = _attend_range(
            q, acc, m_i, l_i, new_lo, diag_lo, kv_hi, pos, table, cache_head, stride_cb, stride_cs,
            stride_ckv, k_head, v_head, new_row0, stride_kt, stride_vt, dims, dim_ok, scale, softcap, window,
            chunk_lo, alibi, cos_ptr, sin_ptr, stride_rt, BLOCK_N, PAGE_SIZE, HAS_SOFTCAP, HAS_WINDOW,
            DOT_PRECISION, False, MASK_NONE, ROPE, ROT_DIM, HAS_CHUNK, HAS_ALIBI, k_scale, v_scale)
    acc, m_i, l_i = _attend_range(
        q, acc, m_i, l_i, diag_lo, kv_hi, kv_hi, pos, table, cache_head, stride_cb, stride_cs, stride_ckv,
        k_head, v_head, new_row0, stride_kt, stride_vt, dims, dim_ok, scale, softcap, window,
        chunk_lo, alibi, cos_ptr, sin_ptr, stride_rt, DIAG_BLOCK_N, PAGE_SIZE, HAS_SOFTCAP, HAS_WINDOW,
        DOT_PRECISION, False, MASK_FULL, ROPE, ROT_DIM, HAS_CHUNK, HAS_ALIBI, k_scale, v_scale)
    CACHED_MASK: tl.constexpr = MASK_FULL if (HAS_WINDOW or HAS_CHUNK) else MASK_TAIL
    acc, m_i, l_i = _attend_range(
        q, acc, m_i, l_i, cached_lo, cached_hi, cached_hi, pos, table, cache_head, stride_cb, stride_cs,
        stride_ckv, k_head, v_head, new_row0, stride_kt, stride_vt, dims, dim_ok, scale, softcap, window,
        chunk_lo, alibi, cos_ptr, sin_ptr, stride_rt, BLOCK_N, PAGE_SIZE, HAS_SOFTCAP, HAS_WINDOW,
        DOT_PRECISION, True, CACHED_MASK, ROPE_NONE, ROT_DIM, HAS_CHUNK,
        HAS_ALIBI, k_scale, v_scale)  # pooled keys were rotated before they were cached
    return acc, m_i, l_i


@triton.jit
def _row_limits(pos, head, row_ok, chunk, alibi_ptr, HAS_CHUNK: tl.constexpr, HAS_ALIBI: tl.constexpr):
    """Per row of a tile: the first key of its chunk (HAS_CHUNK; else its position, unused) and its
    head's ALiBi slope times log2(e) (HAS_ALIBI; else 0, unused)."""
    chunk_lo = pos
    if HAS_CHUNK:
        chunk_lo = pos // chunk * chunk
    alibi = tl.zeros(pos.shape, dtype=tl.float32)
    if HAS_ALIBI:
        alibi = tl.load(alibi_ptr + head, mask=row_ok, other=0.0).to(tl.float32) * LOG2E
    return chunk_lo, alibi


@triton.jit
def _write_new_kv(
    k_head, v_head, slot, cache_head, q_rows, stride_kt, stride_vt,
    stride_cb, stride_cs, stride_ckv, dims, dim_ok, cos_ptr, sin_ptr, stride_rt,
    PAGE_SIZE: tl.constexpr, ROPE: tl.constexpr, ROT_DIM: tl.constexpr, k_scale, v_scale,
):
    """Write the tile's new K/V rows of one KV head into the pool at their ``slot`` (-1 = skip), the
    keys rotated (ROPE) exactly as ``_load_key_block`` rotates them for attention (an FP8 pool: the
    bytes of ``_to_e4m3``).

    Rows follow the tile's [token x query head] layout; ``slot`` is -1 on all but one row per token.
    """
    ok = (slot >= 0)[:, None] & dim_ok[None, :]
    dst = cache_head + (slot // PAGE_SIZE) * stride_cb + (slot % PAGE_SIZE) * stride_cs
    cache_ty = cache_head.dtype.element_ty
    key = tl.load(k_head + q_rows[:, None] * stride_kt + dims[None, :], mask=ok)
    value = tl.load(v_head + q_rows[:, None] * stride_vt + dims[None, :], mask=ok)
    if ROPE != ROPE_NONE:
        key = _rotated(key, k_head + q_rows * stride_kt, q_rows, slot >= 0, dims, cos_ptr, sin_ptr, stride_rt,
                       ROPE, ROT_DIM, False)
    if cache_ty == tl.uint8:  # an FP8 pool's bytes
        key = _to_e4m3(key, k_scale).to(tl.uint8, bitcast=True)
        value = _to_e4m3(value, v_scale).to(tl.uint8, bitcast=True)
    tl.store(dst[:, None] + dims[None, :], key.to(cache_ty), mask=ok)
    tl.store(dst[:, None] + stride_ckv + dims[None, :], value.to(cache_ty), mask=ok)


@triton.jit
def _merge_splits(
    part_out_ptr, part_lse_ptr, q_rows, head, row_ok, dims, dim_ok,
    stride_ps, stride_pt, stride_ph, stride_ls, stride_lt, active, SPLITS_PAD: tl.constexpr,
):
    """sum_s w_s * partial_s over the ``active`` splits, w_s proportional to 2^lse_s, for the rows of one
    tile, one split at a time (one memory round trip each; see ``_merge_token`` for decodes).

    Loads bypass L1 (``.cg``): the partials were written by other SMs, L2 is the coherent copy.
    """
    splits = tl.arange(0, SPLITS_PAD)
    lse_rows = part_lse_ptr + q_rows * stride_lt + head
    lse_mask = (splits < active)[:, None] & row_ok[None, :]
    lse = tl.load(lse_rows[None, :] + splits[:, None] * stride_ls, mask=lse_mask, other=float("-inf"),
                  cache_modifier=".cg")
    m = tl.max(lse, 0)
    m = tl.where(m == float("-inf"), 0.0, m)
    total = tl.sum(tl.exp2(lse - m[None, :]), 0)
    parts = part_out_ptr + q_rows[:, None] * stride_pt + head[:, None] * stride_ph + dims[None, :]
    mask = row_ok[:, None] & dim_ok[None, :]
    merged = tl.zeros(parts.shape, dtype=tl.float32)
    for s in range(active):
        lse_s = tl.load(lse_rows + s * stride_ls, mask=row_ok, other=float("-inf"), cache_modifier=".cg")
        weight = tl.exp2(lse_s - m)
        merged += weight[:, None] * tl.load(parts + s * stride_ps, mask=mask, other=0.0, cache_modifier=".cg")
    return merged / tl.where(total > 0, total, 1.0)[:, None]


@triton.jit
def _merge_token(
    part_out_ptr, part_lse_ptr, row, head0, active, stride_ps, stride_pt, stride_ph, stride_ls, stride_lt, trace_ptr,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    SPLITS_PAD: tl.constexpr, TRACE: tl.constexpr,
):
    """``_merge_splits`` for the GROUP query heads (from ``head0``) of a single token ``row``: only those
    rows are real in a decode's tile, so all splits fit one load of [GROUP_PAD, SPLITS_PAD, BLOCK_D]
    and the merge is one memory round trip instead of one per split (about 0.35 us each, H200).

    With the split axis in the middle the compiler puts the warps on the group axis, so every
    reduction over splits stays inside a thread: after the last split arrives, the 8B shape's merge
    takes 1.1-1.5 us to its store instead of ~4.5 ([splits, group, dims], and the partials' strides
    not specialized; H200, bench/probes/layer_chain.py --timeline, 2026-12-03)."""
    heads = tl.arange(0, GROUP_PAD)
    splits = tl.arange(0, SPLITS_PAD)
    dims = tl.arange(0, BLOCK_D)
    live = (heads < GROUP)[:, None] & (splits < active)[None, :]
    row64 = row.to(tl.int64)
    lse = tl.load(part_lse_ptr + splits[None, :] * stride_ls + row64 * stride_lt + head0 + heads[:, None],
                  mask=live, other=float("-inf"), cache_modifier=".cg")
    parts = (part_out_ptr + splits[None, :, None] * stride_ps + row64 * stride_pt
             + (head0 + heads)[:, None, None] * stride_ph + dims[None, None, :])
    part = tl.load(parts, mask=live[:, :, None] & (dims < HEAD_DIM)[None, None, :], other=0.0, cache_modifier=".cg")
    trace.stamp(trace_ptr, 8, (tl.sum(lse) != 0).to(tl.int32), TRACE)  # (trace events: paged_attention.py)
    trace.stamp(trace_ptr, 9, (tl.sum(part) != 0).to(tl.int32), TRACE)
    m = tl.max(lse, 1)
    m = tl.where(m == float("-inf"), 0.0, m)
    weight = tl.exp2(lse - m[:, None])
    total = tl.sum(weight, 1)
    merged = tl.sum(weight[:, :, None] * part, 1)
    return merged / tl.where(total > 0, total, 1.0)[:, None]
