"""match_rope / match_partial_rope: rotary embeddings -> ``autodeploy::rope``.

``match_rope`` matches the rotation applied to one tensor, in the half-rotate (NeoX/Llama,
``cat(-x2, x1)``) and interleaved (GPT-J/Cohere, ``stack(-x_odd, x_even)``) spellings; cos/sin are
whatever the model multiplies with. ``match_partial_rope`` then folds partial rotary
(``cat(rope(x[..., :r]), x[..., r:])``, GPT-NeoX/Phi) into one op on the whole head.
"""

from __future__ import annotations

import torch

from autodeploy.graph.matcher import Match
from autodeploy.graph.rewrite import PatternSpec, RewriteRule

aten = torch.ops.aten
_SLICE_BOUNDS = {aten.slice.Tensor: {"start", "end"}}


def half_rotate(x, cos, sin):
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def interleaved_rotate(x, cos, sin):
    rotated = torch.stack((-x[..., 1::2], x[..., ::2]), dim=-1).flatten(-2)
    return x * cos + rotated * sin


def _example() -> dict[str, torch.Tensor]:
    return {"x": torch.randn(1, 2, 3, 8), "cos": torch.randn(1, 1, 3, 8), "sin": torch.randn(1, 1, 3, 8)}


def _slices(m: Match) -> list[torch.fx.Node]:
    return [t for t in m.nodes if t.target == aten.slice.Tensor]


class MatchRoPE(RewriteRule):
    name = "match_rope"
    required_ops = frozenset({aten.neg.default, aten.slice.Tensor})

    def patterns(self) -> list[PatternSpec]:
        return [
            PatternSpec(half_rotate, _example(), ignored=_SLICE_BOUNDS, name="half_rotate"),
            PatternSpec(interleaved_rotate, _example(), name="interleaved"),
        ]

    def check(self, m: Match, gm) -> str | None:
        dim = m["x"].meta["val"].shape[-1]
        if m.pattern.name == "half_rotate":
            bounds = sorted((s.args[2], s.args[3]) for s in _slices(m))
            if len(bounds) != 2 or bounds[0] != (0, dim // 2) or bounds[1][0] != dim // 2 or bounds[1][1] < dim:
                return f"slices {bounds} do not split head dim {dim} in halves"
        if m["cos"].meta["val"].shape[-1] != dim:
            return "cos/sin width differs from the rotated tensor"
        return None

    def replacement_kwargs(self, m: Match, gm) -> dict:
        return {"x": m["x"], "cos": m["cos"], "sin": m["sin"], "interleaved": m.pattern.name == "interleaved"}

    def replacement(self, x, cos, sin, interleaved):
        return torch.ops.autodeploy.rope.default(x, cos, sin, interleaved)


def partial_rotary(x, cos, sin):
    rot = cos.shape[-1]
    return torch.cat((torch.ops.autodeploy.rope(x[..., :rot], cos, sin, False), x[..., rot:]), dim=-1)


class MatchPartialRoPE(RewriteRule):
    name = "match_partial_rope"
    required_ops = frozenset({torch.ops.autodeploy.rope.default, aten.cat.default})

    def patterns(self) -> list[PatternSpec]:
        inputs = {"x": torch.randn(1, 2, 3, 8), "cos": torch.randn(1, 1, 3, 4), "sin": torch.randn(1, 1, 3, 4)}
        ignored = {**_SLICE_BOUNDS, torch.ops.autodeploy.rope.default: {"interleaved"}}
        return [PatternSpec(partial_rotary, inputs, ignored=ignored)]

    def check(self, m: Match, gm) -> str | None:
        rot = m["cos"].meta["val"].shape[-1]
        dim = m["x"].meta["val"].shape[-1]
        bounds = sorted((s.args[2], s.args[3]) for s in _slices(m))
        if len(bounds) != 2 or bounds[0] != (0, rot) or bounds[1][0] != rot or bounds[1][1] < dim:
            return f"slices {bounds} do not split head dim {dim} at rotary dim {rot}"
        return None

    def replacement_kwargs(self, m: Match, gm) -> dict:
        rope = next(n for n in m.nodes if n.target == torch.ops.autodeploy.rope.default)
        return {"x": m["x"], "cos": m["cos"], "sin": m["sin"], "interleaved": bool(rope.args[3])}

    def replacement(self, x, cos, sin, interleaved):
        return torch.ops.autodeploy.rope.default(x, cos, sin, interleaved)
