"""match_select_attention: eager attention that masks by selecting scores -> ``autodeploy::attention``.

Two spellings, as the models write them:

- GPT-Neo: unscaled ``q @ k^T`` (in fp32), ``where(causal_buffer_slice, scores, finfo.min)`` (the
  layer's own boolean mask, a sliding window on its local layers), then the model's additive mask;
- MPT: ``q @ k^T * scale`` plus the ALiBi position bias (read as slopes by
  ``autodeploy.graph.position_bias``), then ``masked_fill(blocked, finfo.min)``.

The selected-away scores must get a value softmax turns into 0 (at most half the dtype's lowest),
or the match is rejected: the selection is a mask, and the masks are classified like any other
(``autodeploy.graph.mask``: the boolean terms combined with the additive one).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from autodeploy.graph.mask import evaluate_for_length
from autodeploy.graph.matcher import Match
from autodeploy.graph.rewrite import PatternSpec

from .match_attention import SCALE, AttentionRule

aten = torch.ops.aten
FILL = -23456.789  # sentinel of masked_fill's value
_IGNORED = {aten.softmax.int: {"dtype"}}
_SELECTIONS = (aten.where.self, aten.masked_fill.Scalar)


def gpt_neo_attention(q, k, v, allowed, fill_value, attn_mask):
    scores = torch.where(allowed, torch.matmul(q, k.transpose(-1, -2)), fill_value)
    probs = F.softmax(scores + attn_mask, dim=-1)
    return torch.matmul(probs.to(v.dtype), v)


def mpt_attention(q, k, v, position_bias, blocked, scale, fill):
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale + position_bias
    probs = F.softmax(scores.masked_fill(blocked, fill).float(), dim=-1)
    return torch.matmul(probs.to(v.dtype), v)


def _qkv() -> dict[str, torch.Tensor]:
    return {name: torch.randn(1, 4, 5, 8) for name in ("q", "k", "v")}


class MatchSelectAttention(AttentionRule):
    name = "match_select_attention"
    required_ops = frozenset({aten.softmax.int, aten.matmul.default})
    MASK_TERMS = {"allowed": "allowed", "blocked": "blocked", "attn_mask": "additive"}
    POSITION_BIAS = "position_bias"

    def patterns(self) -> list[PatternSpec]:
        gpt_neo = {**_qkv(), "allowed": torch.ones(1, 1, 5, 5, dtype=torch.bool), "fill_value": torch.tensor(-1e9),
                   "attn_mask": torch.zeros(1, 1, 5, 5)}
        mpt = {**_qkv(), "position_bias": torch.randn(4, 1, 5), "blocked": torch.zeros(1, 1, 5, 5, dtype=torch.bool)}
        return [
            PatternSpec(gpt_neo_attention, gpt_neo, {}, _IGNORED, "where(mask, scores, min) + mask (gpt_neo)"),
            PatternSpec(mpt_attention, mpt, {"scale": SCALE, "fill": FILL}, _IGNORED,
                        "scores + alibi, masked_fill (mpt)"),
        ]

    def check(self, m: Match, gm) -> str | None:
        q, k = m["q"].meta["val"], m["k"].meta["val"]
        if q.dim() != 4 or k.dim() != 4 or q.shape[1] != k.shape[1]:
            return "q and k are not [B, H, S, D] with the same heads"
        fill = _fill_value(m, gm)
        (selection,) = [n for n in m.nodes if n.target in _SELECTIONS]
        if fill is None or fill > torch.finfo(selection.meta["val"].dtype).min / 2:
            return f"masked scores are set to {fill}, not to a value softmax ignores"
        return self.run_time_scalar(m, "scale")

    def replacement_kwargs(self, m: Match, gm) -> dict:
        return self.scaled_kwargs(m, gm, num_heads=int(m["q"].meta["val"].shape[1]))

    def evaluated_inputs(self) -> tuple[str, ...]:
        return (*super().evaluated_inputs(), "fill_value")


def _fill_value(m: Match, gm) -> float | None:
    """What the masked-out scores are set to (a literal, or a constant 0-d tensor)."""
    fill = m.bindings.get("fill")
    if fill is not None:
        return float(fill) if isinstance(fill, (int, float)) and not isinstance(fill, bool) else None
    value = evaluate_for_length(gm, m["fill_value"], 1)
    return float(value) if isinstance(value, torch.Tensor) and value.numel() == 1 else None
