"""match_rms_norm: RMSNorm spellings -> ``autodeploy::rms_norm``.

Covers Llama/Mistral/Qwen (cast back, then weight), OLMo-2 (weight, then cast), Gemma (``1 + w``:
the weight argument becomes the ``1 + w`` node, folded later) and q/k norms over the head dim.
Casts are transparent to the matcher, so the variants differ only in operand order.
"""

from __future__ import annotations

import torch

from autodeploy.graph.rewrite import PatternSpec, RewriteRule

EPS = 1.2345e-5  # sentinel the patterns are traced with; the matcher binds the model's eps


def rms_weight_after(x, weight, eps):
    xf = x.to(torch.float32)
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype)


def rms_normed_times_weight(x, weight, eps):
    xf = x.to(torch.float32)
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return normed * weight


class MatchRMSNorm(RewriteRule):
    name = "match_rms_norm"
    required_ops = frozenset({torch.ops.aten.rsqrt.default, torch.ops.aten.mean.dim})

    def patterns(self) -> list[PatternSpec]:
        inputs = {"x": torch.randn(2, 3, 8), "weight": torch.randn(8)}
        return [
            PatternSpec(rms_weight_after, inputs, scalars={"eps": EPS}, name="weight*norm"),
            PatternSpec(rms_normed_times_weight, inputs, scalars={"eps": EPS}, name="norm*weight"),
        ]

    def replacement(self, x, weight, eps):
        return torch.ops.autodeploy.rms_norm.default(x, weight, eps)
