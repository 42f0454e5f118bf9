"""match_sink_attention: eager attention with learned sinks (gpt-oss) -> ``autodeploy::attention(sinks=...)``.

gpt-oss gives every head one learned logit that takes part in the softmax and contributes no value:
its eager code appends the head's sink to every row of the scores, softmaxes (after subtracting the
row maximum, or not), and drops the sink's column again::

    scores = q @ k^T * scale [+ mask]
    logits = cat([scores, sinks.reshape(1, -1, 1, 1).expand(B, -1, S, -1)], dim=-1)
    probs = softmax(logits [- logits.max(-1, keepdim=True).values])[..., :-1]
    out = probs @ v

which is the canonical attention with ``sinks`` (the row maximum cancels in the softmax). The mask
is classified like every attention rule's (``AttentionRule``): gpt-oss's sliding-window layers get
their window.
"""

from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F

from autodeploy.graph.matcher import Match
from autodeploy.graph.rewrite import PatternSpec

from .match_attention import _IGNORE_REPEATS, SCALE, AttentionRule, _example, attention_bnsd

aten = torch.ops.aten


def _sink_pattern(repeat: bool, masked: bool, stabilized: bool):
    def pattern(q, k, v, sinks, attn_mask=None, scale=None):
        if repeat:
            k, v = torch.ops.autodeploy.repeat_kv(k, 2), torch.ops.autodeploy.repeat_kv(v, 2)
        scores = torch.matmul(q, k.transpose(2, 3)) * scale
        if masked:
            scores = scores + attn_mask
        sink = sinks.reshape(1, -1, 1, 1).expand(q.shape[0], -1, q.shape[-2], -1)
        logits = torch.cat([scores, sink], dim=-1)
        if stabilized:
            logits = logits - logits.max(dim=-1, keepdim=True).values
        probs = F.softmax(logits, dim=-1, dtype=logits.dtype)[..., :-1]
        return torch.matmul(probs.to(v.dtype), v)

    return pattern


class MatchSinkAttention(AttentionRule):
    name = "match_sink_attention"
    required_ops = frozenset({aten.softmax.int, aten.matmul.default, aten.cat.default})

    def patterns(self) -> list[PatternSpec]:
        specs = []
        for masked, repeat, stabilized in itertools.product([True, False], repeat=3):
            inputs = {**_example(masked, repeat), "sinks": torch.randn(4)}
            name = f"sinks(repeat={repeat},mask={masked},max_subtracted={stabilized})"
            specs.append(PatternSpec(_sink_pattern(repeat, masked, stabilized), inputs, {"scale": SCALE},
                                     _IGNORE_REPEATS, name))
        return specs  # masked first: a pattern without the mask must not claim a masked attention's core

    def check(self, m: Match, gm) -> str | None:
        heads = m["q"].meta["val"].shape[1]
        sinks = m["sinks"].meta.get("val")
        if sinks is None or tuple(sinks.shape) != (heads,):
            return f"sinks of shape {None if sinks is None else tuple(sinks.shape)}, expected one per head ({heads})"
        return self.run_time_scalar(m, "scale")

    def replacement_kwargs(self, m: Match, gm) -> dict:
        variants = self.variant_kwargs(m, gm)
        variants["causal"] = variants["causal"] and "attn_mask" in m.bindings
        return {"q": m["q"], "k": m["k"], "v": m["v"], "sinks": m["sinks"], "scale": float(m["scale"]),
                "logit_softcap": None, **variants}

    def replacement(self, q, k, v, sinks, scale, causal, sliding_window, logit_softcap, chunk_size=None,
                    alibi_slopes=None):
        return attention_bnsd(q, k, v, scale, causal, sliding_window, logit_softcap, chunk_size, alibi_slopes,
                              sinks=sinks)
