"""match_bmm_attention: attention on [B * H, S, D] tensors with ``bmm`` -> ``autodeploy::attention``.

Two spellings, as the models write them:

- XGLM: ``bmm(q, k^T)`` (q scaled before), viewed as [B, H, S, S] to add the mask, clamped from
  below at the dtype's lowest value (``torch.max(scores, finfo.min)``: no finite score changes),
  viewed back, softmax, viewed there and back again, ``bmm`` with v;
- Bloom: ``baddbmm(alibi, q, k^T, beta=1, alpha=scale)`` (the ALiBi position bias, read as slopes by
  ``autodeploy.graph.position_bias``), viewed as [B, H, S, S] to add the mask, softmax in fp32,
  viewed back, ``bmm`` with v.

The compiler's export has one batch row (B = 1), so the [H, S, D] operands are [1, H, S, D] after an
``unsqueeze``; a match with more rows is rejected.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from autodeploy.graph.matcher import Match, strip_transparent
from autodeploy.graph.rewrite import PatternSpec

from .match_attention import SCALE, AttentionRule, attention_bnsd

aten = torch.ops.aten
FLOOR = -12345.678  # sentinel of the clamp's lower bound
_IGNORED = {aten.softmax.int: {"dtype"}, aten.full.default: {"dtype", "layout", "device", "pin_memory"}}


def xglm_attention(q, k, v, attn_mask, floor):
    scores = torch.bmm(q, k.transpose(1, 2)).view(1, 4, 5, 5) + attn_mask
    scores = torch.max(scores, torch.full((), floor))
    probs = F.softmax(scores.view(4, 5, 5), dim=-1)
    return torch.bmm(probs.view(1, 4, 5, 5).view(4, 5, 5), v)


def bloom_attention(q, k, v, position_bias, attn_mask, scale):
    scores = torch.baddbmm(position_bias, q, k.transpose(1, 2), beta=1.0, alpha=scale)
    probs = F.softmax(scores.view(1, 4, 5, 5) + attn_mask, dim=-1, dtype=torch.float32)
    return torch.bmm(probs.view(4, 5, 5).to(q.dtype), v)


def _example(biased: bool) -> dict[str, torch.Tensor]:
    inputs = {name: torch.randn(4, 5, 8) for name in ("q", "k", "v")}
    if biased:
        inputs["position_bias"] = torch.randn(4, 1, 5)
    inputs["attn_mask"] = torch.zeros(1, 1, 5, 5)
    return inputs


class MatchBmmAttention(AttentionRule):
    name = "match_bmm_attention"
    required_ops = frozenset({aten.softmax.int, aten.bmm.default})
    POSITION_BIAS = "position_bias"

    def patterns(self) -> list[PatternSpec]:
        return [
            PatternSpec(xglm_attention, _example(False), {"floor": FLOOR}, _IGNORED, "bmm(clamped, xglm)"),
            PatternSpec(bloom_attention, _example(True), {"scale": SCALE}, _IGNORED, "baddbmm(alibi, bloom)"),
        ]

    def check(self, m: Match, gm) -> str | None:
        q, k, v = (m[name].meta["val"] for name in ("q", "k", "v"))
        if not (q.shape[0] == k.shape[0] == v.shape[0]) or q.shape[-1] != k.shape[-1]:
            return "q, k and v differ in heads or head size"
        scores = _four_d_scores(m)
        if scores is None or scores.shape[0] != 1 or scores.shape[1] != q.shape[0]:
            return "scores are not viewed as [1, heads, S, S] (one batch row)"
        floor = m.bindings.get("floor")
        if floor is not None and not (isinstance(floor, float) and floor <= torch.finfo(scores.dtype).min):
            return f"scores are clamped at {floor}, above the dtype's lowest value: not attention"
        return self.run_time_scalar(m, "scale")

    def replacement_kwargs(self, m: Match, gm) -> dict:
        return self.scaled_kwargs(m, gm, num_heads=int(m["q"].meta["val"].shape[0]))

    def replacement(self, q, k, v, scale, causal, sliding_window, logit_softcap, chunk_size=None,
                    alibi_slopes=None):
        q, k, v = (aten.unsqueeze.default(t, 0) for t in (q, k, v))  # [H, S, D] -> [1, H, S, D]
        out = attention_bnsd(q, k, v, scale, causal, sliding_window, logit_softcap, chunk_size, alibi_slopes)
        return aten.squeeze.dim(out, 0)


def _four_d_scores(m: Match):
    """The [B, H, S, S] value the mask is added to (the anchor's 4-d view), if the match has one."""
    for node in m.nodes:
        val = node.meta.get("val")
        if node.target == aten.add.Tensor and isinstance(val, torch.Tensor) and val.dim() == 4:
            return strip_transparent(node)[0].meta["val"]
    return None
