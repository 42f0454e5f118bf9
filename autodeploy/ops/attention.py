"""Canonical dense attention (one sequence per batch row; used before the KV cache is inserted).

Layout "bsnd": q [B, S, Hq, D], k/v [B, S, Hkv, D]; Hq is a multiple of Hkv (GQA is native).
``sliding_window=w`` lets a query at position i see keys j with i - w < j <= i (HF semantics).
``chunk_size=c`` (Llama-4 chunked attention) lets it see only keys of its own chunk: i // c == j // c.
``logit_softcap=c`` applies ``c * tanh(s / c)`` to the scaled scores. ``alibi_slopes`` [Hq] (ALiBi,
fp32) add ``slope[h] * (j - i)`` to the (softcapped) scores of head h: the bias of the ALiBi paper;
HF's Bloom/MPT add ``slope * j`` (plus a per-query constant), which softmax cannot tell apart.
``sinks`` [Hq] are per-head logits of a virtual key that takes probability mass but contributes no
value (gpt-oss style).
"""

from __future__ import annotations

import torch


def attention_scores_mask(
    q_pos: torch.Tensor,
    k_pos: torch.Tensor,
    causal: bool,
    sliding_window: int | None,
    chunk_size: int | None = None,
) -> torch.Tensor:
    """Boolean [Sq, Sk] mask of allowed (query, key) pairs from absolute positions."""
    diff = q_pos[:, None] - k_pos[None, :]
    allowed = torch.ones_like(diff, dtype=torch.bool)
    if causal:
        allowed &= diff >= 0
    if sliding_window is not None and sliding_window > 0:
        allowed &= diff < sliding_window
    if chunk_size is not None and chunk_size > 0:
        allowed &= q_pos[:, None] // chunk_size == k_pos[None, :] // chunk_size
    return allowed


def alibi_bias(slopes: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
    """ALiBi's [H, Sq, Sk] score bias ``slope[h] * (key position - query position)``, fp32."""
    return slopes.float()[:, None, None] * (k_pos[None, None, :] - q_pos[None, :, None]).float()


def attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    allowed: torch.Tensor,
    scale: float,
    logit_softcap: float | None,
    sinks: torch.Tensor | None,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of q [Sq, Hq, D] over k/v [Sk, Hkv, D] with a boolean mask [Sq, Sk] and an optional
    score bias [Hq, Sq, Sk] (added after the softcap); fp32 math."""
    n_rep = q.shape[1] // k.shape[1]
    kf = k.float().repeat_interleave(n_rep, dim=1)
    vf = v.float().repeat_interleave(n_rep, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), kf) * scale
    if logit_softcap:
        scores = torch.tanh(scores / logit_softcap) * logit_softcap
    if bias is not None:
        scores = scores + bias
    scores = scores.masked_fill(~allowed[None], float("-inf"))
    if sinks is not None:
        sink = sinks.float()[:, None, None].expand(-1, scores.shape[1], 1)
        probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    else:
        probs = torch.softmax(scores, dim=-1)
    probs = torch.nan_to_num(probs)  # rows with no visible key (cannot happen when causal)
    return torch.einsum("hqk,khd->qhd", probs, vf).to(q.dtype)


@torch.library.custom_op("autodeploy::attention", mutates_args=())
def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    causal: bool = True,
    sliding_window: int | None = None,
    logit_softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    chunk_size: int | None = None,
    alibi_slopes: torch.Tensor | None = None,
) -> torch.Tensor:
    batch, sq, _, _ = q.shape
    sk = k.shape[1]
    # With a KV prefix (sk > sq) queries are the last sq positions.
    q_pos = torch.arange(sk - sq, sk, device=q.device)
    k_pos = torch.arange(sk, device=q.device)
    allowed = attention_scores_mask(q_pos, k_pos, causal, sliding_window, chunk_size)
    bias = alibi_bias(alibi_slopes, q_pos, k_pos) if alibi_slopes is not None else None
    outs = [attention_reference(q[b], k[b], v[b], allowed, scale, logit_softcap, sinks, bias) for b in range(batch)]
    return torch.stack(outs)


@attention.register_fake
def _(q, k, v, scale, causal=True, sliding_window=None, logit_softcap=None, sinks=None, chunk_size=None,
      alibi_slopes=None):
    return q.new_empty(*q.shape[:-1], v.shape[-1])


@torch.library.custom_op("autodeploy::repeat_kv", mutates_args=())
def repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """[B, Hkv, S, D] -> [B, Hkv * n_rep, S, D], each kv head repeated n_rep times (HF repeat_kv)."""
    return x.repeat_interleave(n_rep, dim=1)


@repeat_kv.register_fake
def _(x, n_rep):
    b, h, s, d = x.shape
    return x.new_empty(b, h * n_rep, s, d)
