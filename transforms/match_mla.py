"""match_mla: DeepSeek's multi-head latent attention -> ``autodeploy::mla`` (``autodeploy.ops.mla``).

The pattern starts where HF's ``DeepseekV2Attention`` / ``DeepseekV3Attention`` (DeepSeek-V2/V3,
Kimi K2, ...) meet the cache boundary: the query halves ``q_nope`` and ``q_pe`` (rotated), the
normalized latent ``c_kv`` viewed as one head, and the rotary key ``k_pe`` (rotated, one head)::

    query = cat(q_nope, q_pe)
    kv = kv_b_proj(c_kv).view(B, S, H, dn + dv).transpose(1, 2)
    k_nope, value = split(kv, [dn, dv])
    key = cat(k_nope, k_pe.expand(-1, H, -1, -1))     # HF fills a new tensor slice by slice:
                                                      # graph/slice_fill.py folds that into this cat
    out = softmax(query @ key^T * scale + mask) @ value   (or SDPA)

Whatever computed the inputs stays in the graph: the query projection (``q_proj``, or ``q_a_proj`` ->
``q_a_layernorm`` -> ``q_b_proj``), ``kv_a_proj_with_mqa`` and ``kv_a_layernorm``, and the rotary
embedding of the pe halves (DeepSeek-V3's interleaved pairs, V2's complex product: whatever
``canonicalize_rope`` makes of them). ``scale`` is captured as the model computed it, YaRN's mscale
included. Only causal attention is taken (no window, chunks or position bias): MLA layers have none.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from autodeploy.graph.matcher import Match, schema_values
from autodeploy.graph.rewrite import PatternSpec

from .match_attention import SCALE, AttentionRule

aten = torch.ops.aten
_IGNORED = {aten.split_with_sizes.default: {"split_sizes"}, aten.softmax.int: {"dtype"},
            aten.scaled_dot_product_attention.default: {"dropout_p", "is_causal", "scale", "enable_gqa"}}
NOPE, ROPE, V, RANK, HEADS = 16, 8, 12, 32, 4  # example sizes the patterns are traced with


def _expanded_kv(q_nope, q_pe, c_kv, k_pe, w_kv_b):
    """HF's expand_kv: the query, keys and values of every head from the latent."""
    batch, _, seq, _ = c_kv.shape
    query = torch.cat((q_nope, q_pe), dim=-1)
    kv = F.linear(c_kv, w_kv_b).view(batch, seq, -1, NOPE + V).transpose(1, 2)
    k_nope, value = torch.split(kv, [NOPE, V], dim=-1)
    key = torch.cat((k_nope, k_pe.expand(-1, k_nope.shape[1], -1, -1)), dim=-1)
    return query, key, value


def _eager_pattern(masked: bool):
    def pattern(q_nope, q_pe, c_kv, k_pe, w_kv_b, attn_mask=None, scale=None):
        query, key, value = _expanded_kv(q_nope, q_pe, c_kv, k_pe, w_kv_b)
        scores = torch.matmul(query, key.transpose(2, 3)) * scale
        if masked:
            scores = scores + attn_mask
        probs = F.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
        return torch.matmul(probs, value)

    return pattern


def _sdpa_pattern(masked: bool):
    def pattern(q_nope, q_pe, c_kv, k_pe, w_kv_b, attn_mask=None):
        query, key, value = _expanded_kv(q_nope, q_pe, c_kv, k_pe, w_kv_b)
        return F.scaled_dot_product_attention(query, key, value, attn_mask=attn_mask if masked else None,
                                              scale=SCALE)

    return pattern


def _example(masked: bool) -> dict[str, torch.Tensor]:
    inputs = {"q_nope": torch.randn(1, HEADS, 5, NOPE), "q_pe": torch.randn(1, HEADS, 5, ROPE),
              "c_kv": torch.randn(1, 1, 5, RANK), "k_pe": torch.randn(1, 1, 5, ROPE),
              "w_kv_b": torch.randn(HEADS * (NOPE + V), RANK)}
    if masked:
        inputs["attn_mask"] = torch.zeros(1, 1, 5, 5)
    return inputs


class MatchMLA(AttentionRule):
    name = "match_mla"
    required_ops = frozenset({aten.linear.default, aten.cat.default, aten.split_with_sizes.default})

    def patterns(self) -> list[PatternSpec]:
        specs = [PatternSpec(_eager_pattern(masked), _example(masked), {"scale": SCALE}, _IGNORED,
                             f"mla_eager(mask={masked})") for masked in (True, False)]
        specs += [PatternSpec(_sdpa_pattern(masked), _example(masked), {}, _IGNORED, f"mla_sdpa(mask={masked})")
                  for masked in (True, False)]
        return specs

    def check(self, m: Match, gm) -> str | None:
        reason = self.run_time_scalar(m, "scale") or _shape_mismatch(m)
        if reason is not None:
            return reason
        kwargs = self.replacement_kwargs(m, gm)
        if not kwargs.pop("causal") or any(v is not None for k, v in kwargs.items() if k in _VARIANTS):
            return "MLA is taken with a plain causal mask only (no window, chunks or position bias)"
        return None

    def replacement_kwargs(self, m: Match, gm) -> dict:
        variants = self.variant_kwargs(m, gm)
        if m.anchor.target == aten.scaled_dot_product_attention.default:
            flags = dict(schema_values(m.anchor))
            if "attn_mask" not in m.bindings:
                variants["causal"] = bool(flags["is_causal"])
            scale = flags["scale"] if flags["scale"] is not None else _head_dim(m) ** -0.5
        else:
            variants["causal"] = variants["causal"] and "attn_mask" in m.bindings
            scale = m["scale"]
        names = ("q_nope", "q_pe", "c_kv", "k_pe", "w_kv_b")
        return {**{n: m[n] for n in names}, "scale": float(scale), **variants}

    def replacement(self, q_nope, q_pe, c_kv, k_pe, w_kv_b, scale, causal=True, sliding_window=None,
                    chunk_size=None, alibi_slopes=None):
        t = aten.transpose.int
        out = torch.ops.autodeploy.mla.default(t(q_nope, 1, 2), t(q_pe, 1, 2), aten.squeeze.dim(c_kv, 1),
                                               aten.squeeze.dim(k_pe, 1), w_kv_b, scale)
        return t(out, 1, 2)


_VARIANTS = ("sliding_window", "chunk_size", "alibi_slopes")


def _head_dim(m: Match) -> int:
    return m["q_nope"].meta["val"].shape[-1] + m["q_pe"].meta["val"].shape[-1]


def _shape_mismatch(m: Match) -> str | None:
    """Why the bound tensors are not one MLA layer's (one latent head, consistent widths), or None."""
    q_nope, q_pe, c_kv, k_pe, w = (m[n].meta["val"] for n in ("q_nope", "q_pe", "c_kv", "k_pe", "w_kv_b"))
    split = next(n for n in m.nodes if n.target == aten.split_with_sizes.default)
    nope, v = dict(schema_values(split))["split_sizes"]
    heads = q_nope.shape[1]
    if c_kv.dim() != 4 or c_kv.shape[1] != 1 or k_pe.dim() != 4 or k_pe.shape[1] != 1:
        return f"latent {tuple(c_kv.shape)} and rotary key {tuple(k_pe.shape)} are not single-head [B, 1, S, d]"
    if nope != q_nope.shape[-1] or q_pe.shape[-1] != k_pe.shape[-1]:
        return f"query halves {q_nope.shape[-1]} + {q_pe.shape[-1]} against key halves {nope} + {k_pe.shape[-1]}"
    if tuple(w.shape) != (heads * (nope + v), c_kv.shape[-1]):
        return f"kv_b weight {tuple(w.shape)} is not [{heads} x ({nope} + {v}), {c_kv.shape[-1]}]"
    return None
