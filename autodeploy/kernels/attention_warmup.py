"""Compile every launch variant of the Triton paged attention that an engine can meet, at start-up.

A launch config (tile shape, split count, decode or prefill loop structure) is a set of constexprs:
each distinct one is a Triton compile the first time a step needs it (1-2 s on the H200, while that
step's requests wait). Configs follow from shapes only (``AttentionLaunch.choose``): the query tile
count, the block-table width and whether the step is decode-like. So the configs an engine can
meet (its max batch, max tokens per step and max blocks per sequence) can be enumerated, and each
launched once on synthetic inputs that attend to their own new keys and write nothing to the cache.
Beyond the config, Triton keys a compile on what it specializes the other arguments on: the kernel
specializes on nothing that changes from step to step (``_DYNAMIC_ARGS``, ``METADATA_POINTERS`` in
``paged_attention.py``), so the synthetic tensors here stand for every step's
(tests/kernels/test_attention_warmup.py compares the keys of served step mixes with these).
"""

from __future__ import annotations

import torch

from .attention_config import DECODE_TOKENS_PER_SEQ, AttentionLaunch
from .paged_attention import paged_attention_fwd


def reachable_launches(
    num_heads: int, num_kv_heads: int, head_dim: int, page_size: int,
    max_batch: int, max_tokens: int, max_blocks: int, device: torch.device, element_size: int = 2,
) -> dict[AttentionLaunch, tuple[int, int, int]]:
    """Each launch config the engine can meet -> one step shape (tokens, sequences, table width) choosing it.

    The config depends on the shape through (decode-like or not, query tiles, table width) only, and
    the tile count is ``max(sequences, cdiv(tokens, tile tokens))``: one sequence sweeps every tile
    count of prefill-like steps, and sequence counts (then more tokens each) every count of
    decode-like ones.
    """
    widths = sorted({min(max_blocks, 1 << i) for i in range(max_blocks.bit_length() + 1)})
    found: dict[AttentionLaunch, tuple[int, int, int]] = {}
    for tokens, seqs in _decode_shapes(max_batch, max_tokens) + _prefill_shapes(max_tokens):
        for width in widths:
            launch = AttentionLaunch.choose(tokens, seqs, num_heads, num_kv_heads, head_dim, width * page_size,
                                            device, element_size)
            found.setdefault(launch, (tokens, seqs, width))
    return found


def _decode_shapes(max_batch: int, max_tokens: int) -> list[tuple[int, int]]:
    shapes = [(seqs, seqs) for seqs in range(1, min(max_batch, max_tokens) + 1)]
    seqs = shapes[-1][0]
    # tiles of a few tokens (large GQA groups): more tokens per sequence give more tiles
    shapes += [(t, seqs) for t in range(seqs + 1, min(DECODE_TOKENS_PER_SEQ * seqs, max_tokens) + 1)]
    return shapes


def _prefill_shapes(max_tokens: int) -> list[tuple[int, int]]:
    return [(t, 1) for t in range(DECODE_TOKENS_PER_SEQ + 1, max_tokens + 1)]


@torch.inference_mode()
def warm_up_launches(
    kv_cache: torch.Tensor, num_heads: int, dtype: torch.dtype, scale: float, sliding_window: int | None,
    logit_softcap: float | None, sinks: torch.Tensor | None, max_batch: int, max_tokens: int, max_blocks: int,
    rope: tuple[int, torch.dtype, bool] | None = None, chunk_size: int | None = None, alibi: bool = False,
) -> int:
    """Launch each reachable config once for one attention layer's settings; returns how many.

    ``rope``: (rotary dim, cos/sin dtype, interleaved) of a layer whose rotary embedding is fused;
    ``chunk_size``, ``alibi``: the layer's chunked attention and whether it has ALiBi slopes.
    """
    _, _, page_size, num_kv_heads, head_dim = kv_cache.shape
    device = kv_cache.device
    launches = reachable_launches(num_heads, num_kv_heads, head_dim, page_size, max_batch, max_tokens, max_blocks,
                                  device, dtype.itemsize)
    slopes = torch.zeros(num_heads, dtype=torch.float32, device=device) if alibi else None
    for launch, (tokens, seqs, width) in launches.items():
        q = torch.zeros(tokens, num_heads, head_dim, dtype=dtype, device=device)
        k = torch.zeros(tokens, num_kv_heads, head_dim, dtype=dtype, device=device)
        lens = torch.ones(seqs, dtype=torch.int64)
        lens[0] = tokens - seqs + 1  # the first sequence takes the extra tokens
        cu_seqlens = torch.cat([torch.zeros(1, dtype=torch.int64), lens.cumsum(0)]).to(device)
        paged_attention_fwd(
            q, k, torch.zeros_like(k), kv_cache, cu_seqlens, torch.zeros(seqs, dtype=torch.int64, device=device),
            torch.zeros(seqs, width, dtype=torch.int64, device=device),
            torch.full((tokens,), -1, dtype=torch.int64, device=device),  # slot -1: the cache is not written
            scale, sliding_window, logit_softcap, sinks, *_rotary(rope, tokens, device), chunk_size=chunk_size,
            alibi_slopes=slopes, launch=launch)
    return len(launches)


def _rotary(rope: tuple[int, torch.dtype, bool] | None, tokens: int, device: torch.device) -> tuple:
    """cos/sin [tokens, R] (zeros, contiguous like the graph's) and the layout flag, or nothing."""
    if rope is None:
        return ()
    rot_dim, dtype, interleaved = rope
    trig = torch.zeros(tokens, rot_dim, dtype=dtype, device=device)
    return trig, trig, interleaved
