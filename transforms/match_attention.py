"""match_eager_attention / match_sdpa_attention: attention -> ``autodeploy::attention``.

Eager attention is matched in the spellings HF models use: ``softmax(q @ k^T [* scale | / divisor]
[softcapped] [+ mask]) @ v`` with or without ``repeat_kv`` on k/v. SDPA is matched as the op itself. The mask is
not matched structurally: it is evaluated and classified (causal / sliding window / chunked) by
``autodeploy.graph.mask``; the canonical op carries the result as flags. ``AttentionRule`` is the base
of every attention rule (this file's, ``match_bmm_attention``, ``match_select_attention``): mask
terms and ALiBi position biases are evaluated the same way for all of them.

Both rules replace a [B, H, S, D] ("bnsd") computation, so the replacement transposes into and out
of the canonical [B, S, H, D] layout; the transposes cancel against the model's own later.
"""

from __future__ import annotations

import itertools
import math

import torch
import torch.nn.functional as F

from autodeploy.graph.mask import MaskKind, MaskTerm, classify_mask, evaluate_for_length
from autodeploy.graph.matcher import Match, schema_values
from autodeploy.graph.meta import concrete_shape
from autodeploy.graph.position_bias import alibi_slopes, slopes_node
from autodeploy.graph.rewrite import PatternSpec, RewriteRule

aten = torch.ops.aten
SCALE = 0.0123456  # sentinels the patterns are traced with
DIVISOR = 81.0123
SOFTCAP = 43.21
_SCALINGS = (None, "mul", "div")  # scores not scaled, multiplied by a scale, divided by sqrt(d)
_IGNORE_REPEATS = {torch.ops.autodeploy.repeat_kv.default: {"n_rep"}, aten.softmax.int: {"dtype"}}


def attention_bnsd(q, k, v, scale, causal, sliding_window, logit_softcap, chunk_size=None, alibi_slopes=None,
                   sinks=None):
    """Canonical attention on [B, H, S, D] tensors (the layout HF computes attention in)."""
    t = aten.transpose.int
    variants = {"chunk_size": chunk_size, "alibi_slopes": alibi_slopes, "sinks": sinks}  # passed only when used
    out = torch.ops.autodeploy.attention.default(
        t(q, 1, 2), t(k, 1, 2), t(v, 1, 2), scale, causal, sliding_window, logit_softcap,
        **{name: value for name, value in variants.items() if value is not None},
    )
    return t(out, 1, 2)


def _example(masked: bool, repeat: bool) -> dict[str, torch.Tensor]:
    kv_heads = 2 if repeat else 4
    inputs = {"q": torch.randn(1, 4, 5, 8), "k": torch.randn(1, kv_heads, 5, 8), "v": torch.randn(1, kv_heads, 5, 8)}
    if masked:
        inputs["attn_mask"] = torch.zeros(1, 1, 5, 5)
    return inputs


def _eager_pattern(repeat: bool, scaling: str | None, softcapped: bool, masked: bool, mask_first: bool):
    def pattern(q, k, v, attn_mask=None, scale=None, divisor=None, softcap=None):
        if repeat:
            k, v = torch.ops.autodeploy.repeat_kv(k, 2), torch.ops.autodeploy.repeat_kv(v, 2)
        scores = torch.matmul(q, k.transpose(2, 3))
        if mask_first:  # CodeGen masks before scaling
            scores = scores + attn_mask
        if scaling == "mul":
            scores = scores * scale
        elif scaling == "div":
            scores = scores / divisor
        if softcapped:
            scores = torch.tanh(scores / softcap) * softcap
        if masked and not mask_first:
            scores = scores + attn_mask
        probs = F.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        return torch.matmul(probs, v)

    return pattern


def _eager_variants():
    """(repeat, scaling, softcapped, masked, mask_first) of every eager spelling matched."""
    for repeat, scaling, softcapped, masked in itertools.product([True, False], _SCALINGS, [True, False],
                                                                 [True, False]):
        yield repeat, scaling, softcapped, masked, False
        if masked and scaling and not softcapped:
            yield repeat, scaling, softcapped, masked, True


class AttentionRule(RewriteRule):
    """What every attention rule shares: its mask terms classified, its position bias read as ALiBi
    slopes, and those inputs given their real values (not random ones) when a match is verified.

    ``MASK_TERMS`` maps pattern inputs to their mask form; ``POSITION_BIAS`` names the input holding
    an additive position bias (ALiBi), if any. Subclasses build ``replacement_kwargs`` from
    :meth:`variant_kwargs`."""

    MASK_TERMS: dict[str, str] = {"attn_mask": "additive"}
    POSITION_BIAS: str | None = None

    def mask_kind(self, m: Match, gm) -> MaskKind:
        terms = [MaskTerm(m[name], form) for name, form in self.MASK_TERMS.items()
                 if isinstance(m.bindings.get(name), torch.fx.Node)]
        return classify_mask(gm, terms)

    def variant_kwargs(self, m: Match, gm, num_heads: int | None = None) -> dict:
        """The mask's flags (causal, window, chunk) and the ALiBi slopes (a buffer; the rule's
        ``POSITION_BIAS`` for ``num_heads`` query heads) of a match."""
        kind = self.mask_kind(m, gm)
        slopes = None
        if self.POSITION_BIAS and self.POSITION_BIAS in m.bindings:
            slopes = slopes_node(gm, alibi_slopes(gm, m[self.POSITION_BIAS], num_heads))
        return {"causal": kind.causal, "sliding_window": kind.sliding_window, "chunk_size": kind.chunk_size,
                "alibi_slopes": slopes}

    def verification_inputs(self, m: Match, values: dict) -> None:
        for name in (*self.MASK_TERMS, *self.evaluated_inputs()):
            node = m.bindings.get(name)
            val = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
            if isinstance(val, torch.Tensor) and node in values:
                n = concrete_shape(val)[-1] if val.dim() else 1
                real = evaluate_for_length(node.graph.owning_module, node, n)
                values[node] = real.reshape(values[node].shape) if real.numel() == values[node].numel() else real

    def evaluated_inputs(self) -> tuple[str, ...]:
        """Pattern inputs computed from positions or constants (besides the mask terms)."""
        return (self.POSITION_BIAS,) if self.POSITION_BIAS else ()

    @staticmethod
    def run_time_scalar(m: Match, *names: str) -> str | None:
        """Why the match cannot be taken if one of the captured scalars ``names`` is not a constant."""
        for name in names:
            value = m.bindings.get(name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
                return f"{name} is computed at run time ({value}), not a constant"
        return None

    def scaled_kwargs(self, m: Match, gm, num_heads: int) -> dict:
        """``replacement`` arguments of a match whose scores are scaled by its ``scale`` (1 if unbound),
        without softcap."""
        return {"q": m["q"], "k": m["k"], "v": m["v"], "scale": float(m.bindings.get("scale", 1.0)),
                "logit_softcap": None, **self.variant_kwargs(m, gm, num_heads)}

    def replacement(self, q, k, v, scale, causal, sliding_window, logit_softcap, chunk_size=None,
                    alibi_slopes=None):
        return attention_bnsd(q, k, v, scale, causal, sliding_window, logit_softcap, chunk_size, alibi_slopes)


class MatchEagerAttention(AttentionRule):
    name = "match_eager_attention"
    required_ops = frozenset({aten.softmax.int, aten.matmul.default})

    def patterns(self) -> list[PatternSpec]:
        specs = []
        for repeat, scaling, softcapped, masked, mask_first in _eager_variants():
            scalars = {}
            if scaling == "mul":
                scalars["scale"] = SCALE
            if scaling == "div":
                scalars["divisor"] = DIVISOR
            if softcapped:
                scalars["softcap"] = SOFTCAP
            mask = "first" if mask_first else masked
            name = f"eager(repeat={repeat},scale={scaling},softcap={softcapped},mask={mask})"
            fn = _eager_pattern(repeat, scaling, softcapped, masked, mask_first)
            specs.append(PatternSpec(fn, _example(masked, repeat), scalars, _IGNORE_REPEATS, name))
        # most specific first: a pattern without the mask must not claim a masked attention's core;
        # then the common spellings (no softcap), since apply_rule stops once every attention matched
        return sorted(specs, key=lambda s: (-len(s.example_inputs) - len(s.scalars), "softcap" in s.scalars))

    def check(self, m: Match, gm) -> str | None:
        return self.run_time_scalar(m, "scale", "divisor", "softcap")

    def replacement_kwargs(self, m: Match, gm) -> dict:
        variants = self.variant_kwargs(m, gm)
        variants["causal"] = variants["causal"] and "attn_mask" in m.bindings
        return {"q": m["q"], "k": m["k"], "v": m["v"], "scale": _eager_scale(m),
                "logit_softcap": m.bindings.get("softcap"), **variants}


def _eager_scale(m: Match) -> float:
    if "scale" in m.bindings:
        return float(m["scale"])
    return 1.0 / float(m["divisor"]) if "divisor" in m.bindings else 1.0


def _sdpa_pattern(repeat: bool, masked: bool):
    def pattern(q, k, v, attn_mask=None):
        if repeat:
            k, v = torch.ops.autodeploy.repeat_kv(k, 2), torch.ops.autodeploy.repeat_kv(v, 2)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, scale=SCALE)

    return pattern


class MatchSDPAAttention(AttentionRule):
    name = "match_sdpa_attention"
    required_ops = frozenset({aten.scaled_dot_product_attention.default})
    _FLAGS = {"dropout_p", "is_causal", "scale", "enable_gqa"}

    def patterns(self) -> list[PatternSpec]:
        ignored = {**_IGNORE_REPEATS, aten.scaled_dot_product_attention.default: self._FLAGS}
        return [
            PatternSpec(_sdpa_pattern(repeat, masked), _example(masked, repeat), {}, ignored, f"sdpa(repeat={repeat},mask={masked})")
            for repeat, masked in itertools.product([True, False], repeat=2)
        ]

    def check(self, m: Match, gm) -> str | None:
        flags = dict(schema_values(m.anchor))
        if flags["dropout_p"]:
            return "dropout during inference"
        if flags["attn_mask"] is not None and "attn_mask" not in m.bindings:
            return "mask present but not matched"
        return None

    def replacement_kwargs(self, m: Match, gm) -> dict:
        flags = dict(schema_values(m.anchor))
        scale = flags["scale"] if flags["scale"] is not None else 1.0 / math.sqrt(m["q"].meta["val"].shape[-1])
        variants = self.variant_kwargs(m, gm)
        if "attn_mask" not in m.bindings:
            variants["causal"] = bool(flags["is_causal"])
        return {"q": m["q"], "k": m["k"], "v": m["v"], "scale": float(scale), "logit_softcap": None, **variants}
