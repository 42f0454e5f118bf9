"""match_gated_rms_norm: a gated RMSNorm over rows flattened from tokens and heads -> ``rms_norm`` per head.

Gated DeltaNet (Qwen3-Next) normalizes each value head of its output and gates it with ``silu(z)``,
and HF writes it over rows that flatten the tokens and heads together: ``x.reshape(-1, V)``,
``z.reshape(-1, V)``, ``norm(x, z)``, then back to ``z``'s shape. The norm is per row, so the
flattening changes nothing but hides the token dimension (a row count of ``H * T``), which
``check_uncached_state`` cannot prove token-local. The replacement computes the same per head on the
unflattened tensors: ``rms_norm(x) * silu(z)`` (the product in fp32, as HF's, cast back once).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from autodeploy.graph.matcher import Match
from autodeploy.graph.rewrite import PatternSpec, RewriteRule

from .match_rms_norm import EPS

aten = torch.ops.aten
_TOKENS, _HEADS, _HEAD_DIM = 3, 2, 8


def gated_rms_norm_rows(x, gate, weight, eps):
    rows, gate_rows = x.reshape(-1, _HEAD_DIM), gate.reshape(-1, _HEAD_DIM)
    normed = rows.to(torch.float32)
    normed = normed * torch.rsqrt(normed.pow(2).mean(-1, keepdim=True) + eps)
    normed = weight * normed.to(x.dtype)
    normed = normed * F.silu(gate_rows.to(torch.float32))
    return normed.to(x.dtype).reshape(gate.shape)


class MatchGatedRMSNorm(RewriteRule):
    name = "match_gated_rms_norm"
    required_ops = frozenset({aten.rsqrt.default, aten.silu.default})

    def patterns(self) -> list[PatternSpec]:
        shape = (1, _TOKENS, _HEADS, _HEAD_DIM)
        inputs = {"x": torch.randn(shape), "gate": torch.randn(shape), "weight": torch.randn(_HEAD_DIM)}
        return [PatternSpec(gated_rms_norm_rows, inputs, scalars={"eps": EPS})]

    def check(self, m: Match, gm) -> str | None:
        x, gate, weight = (m[name].meta["val"] for name in ("x", "gate", "weight"))
        out = m.anchor.meta["val"]
        if x.shape != gate.shape or out.shape != x.shape:
            return f"x {tuple(x.shape)}, gate {tuple(gate.shape)} and output {tuple(out.shape)} differ in shape"
        if weight.dim() != 1 or weight.shape[0] != x.shape[-1]:
            return f"weight {tuple(weight.shape)} is not one per element of the last dimension {x.shape[-1]}"
        return None

    def replacement(self, x, gate, weight, eps):
        # in fp32 (the anchor's dtype comes back through the rewrite's cast, once, as HF casts)
        normed = aten._to_copy.default(torch.ops.autodeploy.rms_norm.default(x, weight, eps), dtype=torch.float32)
        return aten.mul.Tensor(normed, aten.silu.default(aten._to_copy.default(gate, dtype=torch.float32)))
