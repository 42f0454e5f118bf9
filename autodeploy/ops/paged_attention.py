"""Canonical paged-KV attention with the cache write fused in (torch reference backend).

``paged_attention(q[T, Hq, D], k[T, Hkv, D], v[T, Hkv, D], kv_cache, <batch metadata>, ...)``
first writes k/v of every token with ``slot_mapping >= 0`` into ``kv_cache``
([num_blocks, 2, block_size, Hkv, D], see ``autodeploy.kvcache.pool``), then lets each token
attend to the cached keys of its sequence up to and including its own position. Metadata is
described in ``autodeploy.kvcache.metadata``.

Optional rotary embedding (``fuse_rope_attention``): with ``rope_cos``/``rope_sin`` ([T, R] per
token, R even and <= D) the op first rotates q and k like ``autodeploy::rope`` on their first R
dims (half-rotate, or pairwise when ``rope_interleaved``), rounded back to q's and k's dtypes; the
rotated keys are what is cached and attended to. None (the default): no rotation.

``chunk_size`` and ``alibi_slopes`` (Llama-4 chunked attention, ALiBi) mean what they mean in
``autodeploy::attention``, with absolute positions (a token's position is its index in its sequence).

FP8 KV cache (a ``float8_e4m3fn`` pool): the write stores ``e4m3(clamp(k / k_scale, +-448))``
(rounded to nearest even, saturating; likewise v with ``v_scale``), and attention reads the cached
keys and values as ``e4m3 * scale`` in fp32. The step's own new keys are attended to as they were
cached, rounded through the pool's dtype like every other key. The scales are ignored for a pool in
a float dtype.
"""

from __future__ import annotations

import torch

from ..quantization.numerics import FP8_DTYPE, round_to_fp8
from .attention import alibi_bias, attention_reference, attention_scores_mask


def write_kv_cache(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
                   k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    block_size = kv_cache.shape[2]
    valid = slot_mapping >= 0
    slots = slot_mapping[valid]
    blocks, offsets = slots // block_size, slots % block_size
    kv_cache[blocks, 0, offsets] = to_cache_dtype(k[valid], kv_cache.dtype, k_scale)
    kv_cache[blocks, 1, offsets] = to_cache_dtype(v[valid], kv_cache.dtype, v_scale)


def to_cache_dtype(x: torch.Tensor, dtype: torch.dtype, scale: float) -> torch.Tensor:
    """``x`` as the pool stores it: FP8 ``e4m3(clamp(x / scale, +-448))``, else a plain cast."""
    if dtype == FP8_DTYPE:
        return round_to_fp8(x, torch.tensor(scale, dtype=torch.float32, device=x.device))
    return x.to(dtype)


def from_cache(x: torch.Tensor, dtype: torch.dtype, scale: float) -> torch.Tensor:
    """Cached keys or values as attention reads them: FP8 ``e4m3 * scale`` in fp32, else cast to ``dtype``."""
    if x.dtype == FP8_DTYPE:
        return x.float() * torch.tensor(scale, dtype=torch.float32, device=x.device)
    return x.to(dtype)


def gather_kv(kv_cache: torch.Tensor, block_ids: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The first ``length`` cached K and V of one sequence: each [length, Hkv, D]."""
    blocks = kv_cache[block_ids]  # [n, 2, bs, H, D]
    keys = blocks[:, 0].reshape(-1, *blocks.shape[-2:])[:length]
    values = blocks[:, 1].reshape(-1, *blocks.shape[-2:])[:length]
    return keys, values


def rotate_qk(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor | None, sin: torch.Tensor | None, interleaved: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, Hq, D] and k [T, Hkv, D] rotated by per-token cos/sin [T, R] (unchanged when cos is None),
    through ``autodeploy::rope_qk``: what the unfused graph computes, on every device."""
    if cos is None:
        return q, k
    q_rot, k_rot = torch.ops.autodeploy.rope_qk(q, k, cos[:, None], sin[:, None], interleaved)
    return q_rot.to(q.dtype), k_rot.to(k.dtype)


@torch.library.custom_op("autodeploy::paged_attention", mutates_args=("kv_cache",))
def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    query_lens: torch.Tensor,
    context_lens: torch.Tensor,
    cu_seqlens: torch.Tensor,
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
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    q, k = rotate_qk(q, k, rope_cos, rope_sin, rope_interleaved)
    write_kv_cache(k, v, kv_cache, slot_mapping, k_scale, v_scale)
    out = torch.zeros_like(q)
    block_size = kv_cache.shape[2]
    for b, (n_q, n_ctx, start) in enumerate(zip(query_lens.tolist(), context_lens.tolist(), cu_seqlens.tolist())):
        if n_q == 0:
            continue
        seq_len = n_ctx + n_q
        n_blocks = -(-seq_len // block_size)
        keys, values = gather_kv(kv_cache, block_table[b, :n_blocks], seq_len)
        q_pos, k_pos = torch.arange(n_ctx, seq_len, device=q.device), torch.arange(seq_len, device=q.device)
        allowed = attention_scores_mask(q_pos, k_pos, True, sliding_window, chunk_size)
        bias = alibi_bias(alibi_slopes, q_pos, k_pos) if alibi_slopes is not None else None
        out[start : start + n_q] = attention_reference(
            q[start : start + n_q], from_cache(keys, q.dtype, k_scale), from_cache(values, q.dtype, v_scale), allowed,
            scale, logit_softcap, sinks, bias,
        )
    return out


@paged_attention.register_fake
def paged_attention_fake(q, *args, **kwargs):
    """Shape of every paged-attention backend's output (they share this op's schema): q's."""
    return torch.empty_like(q)


def _torch_backend():
    from .attention_backends import AttentionBackend

    return AttentionBackend("torch", torch.ops.autodeploy.paged_attention.default)  # syncs (.tolist()): not capturable


TORCH_BACKEND = _torch_backend()
