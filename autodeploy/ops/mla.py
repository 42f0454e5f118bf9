"""Multi-head latent attention (MLA: DeepSeek-V2/V3, Kimi K2): the canonical op and its paged forms.

What HF's ``DeepseekV3Attention`` computes once the latent and the rotary key are known (the cache
boundary: ``c_kv`` is the normalized latent, ``kv_a_layernorm`` of the first ``r`` columns of
``kv_a_proj_with_mqa(x)``, and ``k_pe`` the rest after RoPE; one of each per token, shared by every
head)::

    kv = c_kv @ w_kv_b.T, viewed [..., H, dn + dv]          (kv_b_proj)
    k = cat(kv[..., :dn], k_pe broadcast over the heads)     v = kv[..., dn:]
    q = cat(q_nope, q_pe)
    out = causal softmax(q @ k.T * scale) @ v               [..., H, dv]

``mla(q_nope[B, S, H, dn], q_pe[B, S, H, dr], c_kv[B, S, r], k_pe[B, S, dr], w_kv_b[H * (dn + dv), r],
scale)`` is that on whole sequences (before the KV cache is inserted). The paged forms take one
flattened step (``[T, ...]``, batch metadata as in ``autodeploy.kvcache.metadata``) and the layer's
latent cache ``[num_blocks, block_size, r + dr]`` (``autodeploy.kvcache.pool``): they write each
token's ``cat(c_kv, k_pe)`` at its slot (``slot_mapping``; -1 skips), then attend over the sequence's
cached entries. ``paged_mla`` (the torch reference) expands k/v from the latent, HF's math;
``paged_mla_triton`` absorbs the up-projection instead (``kernels/mla_attention.py``): queries become
``q_nope @ W_UK`` per head, scored against the latent itself, and the latent-weighted sum goes through
``W_UV`` at the end, so every cached token is read once, as r + dr values, for all heads at once.
"""

from __future__ import annotations

import torch

from ..errors import ConfigError
from .attention import attention_reference, attention_scores_mask


def split_kv_b(w_kv_b: torch.Tensor, heads: int, nope_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``kv_b_proj``'s weight [H * (dn + dv), r] as W_UK [H, dn, r] and W_UV [H, dv, r] (views)."""
    per_head = w_kv_b.view(heads, -1, w_kv_b.shape[-1])
    return per_head[:, :nope_dim], per_head[:, nope_dim:]


def expand_latent(c_kv: torch.Tensor, k_pe: torch.Tensor, w_kv_b: torch.Tensor, heads: int,
                  nope_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys [L, H, dn + dr] and values [L, H, dv] of latents c_kv [L, r] and rotary keys k_pe [L, dr]."""
    kv = torch.nn.functional.linear(c_kv, w_kv_b).view(c_kv.shape[0], heads, -1)
    k_nope, v = kv[..., :nope_dim], kv[..., nope_dim:]
    return torch.cat([k_nope, k_pe[:, None].expand(-1, heads, -1).to(k_nope.dtype)], dim=-1), v


def _attend_expanded(q_nope, q_pe, c_kv, k_pe, w_kv_b, scale, q_pos, k_pos) -> torch.Tensor:
    """One sequence: queries [S, H, ...] at ``q_pos`` over latents [L, ...] at ``k_pos``, causal."""
    heads, nope_dim = q_nope.shape[1], q_nope.shape[2]
    k, v = expand_latent(c_kv, k_pe, w_kv_b, heads, nope_dim)
    q = torch.cat([q_nope, q_pe], dim=-1)
    allowed = attention_scores_mask(q_pos, k_pos, True, None)
    return attention_reference(q, k.to(q.dtype), v.to(q.dtype), allowed, scale, None, None)


def _out_shape(q_nope: torch.Tensor, w_kv_b: torch.Tensor) -> tuple[int, ...]:
    heads, nope_dim = q_nope.shape[-2], q_nope.shape[-1]
    return (*q_nope.shape[:-1], w_kv_b.shape[0] // heads - nope_dim)


@torch.library.custom_op("autodeploy::mla", mutates_args=())
def mla(q_nope: torch.Tensor, q_pe: torch.Tensor, c_kv: torch.Tensor, k_pe: torch.Tensor, w_kv_b: torch.Tensor,
        scale: float) -> torch.Tensor:
    seq = q_nope.shape[1]
    pos = torch.arange(seq, device=q_nope.device)
    outs = [_attend_expanded(q_nope[b], q_pe[b], c_kv[b], k_pe[b], w_kv_b, scale, pos, pos)
            for b in range(q_nope.shape[0])]
    return torch.stack(outs)


@mla.register_fake
def _(q_nope, q_pe, c_kv, k_pe, w_kv_b, scale):
    return q_nope.new_empty(_out_shape(q_nope, w_kv_b))


def write_latent_cache(c_kv: torch.Tensor, k_pe: torch.Tensor, cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Each token's ``cat(c_kv, k_pe)`` into ``cache`` [num_blocks, block_size, r + dr] at its slot (-1: none)."""
    valid = slot_mapping >= 0
    slots = slot_mapping[valid]
    entries = torch.cat([c_kv[valid], k_pe[valid].to(c_kv.dtype)], dim=-1)
    cache[slots // cache.shape[1], slots % cache.shape[1]] = entries.to(cache.dtype)


@torch.library.custom_op("autodeploy::paged_mla", mutates_args=("mla_cache",))
def paged_mla(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    c_kv: torch.Tensor,
    k_pe: torch.Tensor,
    w_kv_b: torch.Tensor,
    mla_cache: torch.Tensor,
    query_lens: torch.Tensor,
    context_lens: torch.Tensor,
    cu_seqlens: torch.Tensor,
    block_table: torch.Tensor,
    slot_mapping: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    write_latent_cache(c_kv, k_pe, mla_cache, slot_mapping)
    out = q_nope.new_zeros(_out_shape(q_nope, w_kv_b))
    rank, block_size = c_kv.shape[-1], mla_cache.shape[1]
    for b, (n_q, n_ctx, start) in enumerate(zip(query_lens.tolist(), context_lens.tolist(), cu_seqlens.tolist())):
        if n_q == 0:
            continue
        seq_len = n_ctx + n_q
        entries = mla_cache[block_table[b, : -(-seq_len // block_size)]].reshape(-1, mla_cache.shape[-1])[:seq_len]
        rows = slice(start, start + n_q)
        q_pos, k_pos = torch.arange(n_ctx, seq_len, device=q_nope.device), torch.arange(seq_len, device=q_nope.device)
        out[rows] = _attend_expanded(q_nope[rows], q_pe[rows], entries[:, :rank].to(c_kv.dtype),
                                     entries[:, rank:].to(k_pe.dtype), w_kv_b, scale, q_pos, k_pos)
    return out


def paged_mla_fake(q_nope, q_pe, c_kv, k_pe, w_kv_b, *args, **kwargs):
    """Shape of every paged MLA op's output: [T, H, dv]."""
    return q_nope.new_empty(_out_shape(q_nope, w_kv_b))


paged_mla.register_fake(paged_mla_fake)


@torch.library.custom_op("autodeploy::paged_mla_triton", mutates_args=("mla_cache",))
def paged_mla_triton(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    c_kv: torch.Tensor,
    k_pe: torch.Tensor,
    w_kv_b: torch.Tensor,
    mla_cache: torch.Tensor,
    query_lens: torch.Tensor,
    context_lens: torch.Tensor,
    cu_seqlens: torch.Tensor,
    block_table: torch.Tensor,
    slot_mapping: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    from ..kernels.mla_attention import mla_attention_fwd

    heads, nope_dim = q_nope.shape[1], q_nope.shape[2]
    w_uk, w_uv = split_kv_b(w_kv_b.to(q_nope.dtype), heads, nope_dim)
    q_lat = torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)  # [T, H, r]: queries on the latent
    out_lat = mla_attention_fwd(q_lat, q_pe, c_kv, k_pe, mla_cache, cu_seqlens, context_lens, block_table,
                                slot_mapping, scale)
    return torch.bmm(out_lat.transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1).contiguous()


paged_mla_triton.register_fake(paged_mla_fake)

# attention backend name -> the paged MLA op it runs (insert_kv_cache); the triton op never syncs
# with the host (CUDA-graph capturable), the reference does (.tolist())
MLA_OPS = {"torch": torch.ops.autodeploy.paged_mla.default, "triton": torch.ops.autodeploy.paged_mla_triton.default}


def mla_op_for(backend: str, where: str):
    """The paged MLA op of attention backend ``backend``, or a ConfigError naming the ones that have one."""
    if backend not in MLA_OPS:
        raise ConfigError(f"{where}: attention backend '{backend}' has no MLA (latent attention) kernel; "
                          f"use attention_backend={' or '.join(MLA_OPS)}")
    return MLA_OPS[backend]
