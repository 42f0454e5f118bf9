"""Test helpers: random paged batches and step schedules for the paged-attention backends."""

from __future__ import annotations

import torch

from autodeploy.kvcache.metadata import BatchMetadata, SequenceChunk


def random_cache(num_blocks: int, page: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> torch.Tensor:
    """A cache full of random values: stale entries must never leak into an output."""
    return torch.randn(num_blocks, 2, page, kv_heads, head_dim).to(dtype)


def cache_bits(cache: torch.Tensor) -> torch.Tensor:
    """A pool as comparable values: an FP8 pool's bytes (compared bit for bit), any other as it is."""
    return cache.view(torch.uint8) if cache.dtype == torch.float8_e4m3fn else cache


def shuffled_blocks(lengths: list[int], page: int, num_blocks: int, seed: int = 0) -> list[tuple[int, ...]]:
    """Non-contiguous, interleaved block ids for sequences of the given total lengths."""
    order = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed)).tolist()
    out, used = [], 0
    for n in lengths:
        count = -(-n // page)
        out.append(tuple(order[used: used + count]))
        used += count
    return out


def step_metadata(chunks: list[tuple[int, int, tuple[int, ...]]], page: int, pad_tokens: int = 0):
    """Metadata of one step from (context_len, query_len, block_ids) per sequence; ``pad_tokens``
    trailing tokens belong to no sequence and write nowhere (slot -1), as CUDA-graph padding does."""
    seqs = [SequenceChunk(tuple([0] * n), ctx, blocks) for ctx, n, blocks in chunks]
    meta = BatchMetadata.build(seqs, page, "cpu")
    slots = torch.cat([meta.slot_mapping, torch.full((pad_tokens,), -1, dtype=torch.int64)])
    return meta.query_lens, meta.context_lens, meta.cu_seqlens, meta.block_table, slots


def run_schedule(op, q, k, v, blocks, schedule, page, cache, scale, window=None, softcap=None, sinks=None,
                 rope=None, **variants):
    """Feed per-sequence q/k/v ([L, H, D] each) to ``op`` step by step; return per-sequence outputs.

    ``schedule`` is a list of steps, each a list of (sequence, tokens) pairs, run in order. ``rope``:
    (per-sequence cos, per-sequence sin ([L, R] each), interleaved), fed to the op's rotary inputs;
    ``variants``: the op's keyword-only features (``chunk_size``, ``alibi_slopes``).
    """
    done = [0] * len(q)
    outs = [torch.zeros_like(x) for x in q]
    for step in schedule:
        chunks = [(done[s], n, blocks[s]) for s, n in step]
        rows = [(s, done[s], done[s] + n) for s, n in step]
        take = lambda xs: torch.cat([xs[s][a:b] for s, a, b in rows])  # noqa: E731
        query_lens, context_lens, cu, table, slots = step_metadata(chunks, page)
        rotary = (take(rope[0]), take(rope[1]), rope[2]) if rope else ()
        out = op(take(q), take(k), take(v), cache, query_lens, context_lens, cu, table, slots, scale,
                 window, softcap, sinks, *rotary, **variants)
        offset = 0
        for s, a, b in rows:
            outs[s][a:b] = out[offset: offset + b - a]
            offset += b - a
            done[s] = b
    return outs
