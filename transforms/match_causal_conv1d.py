"""match_causal_conv1d: a causal depthwise convolution over the tokens -> ``autodeploy::causal_conv1d``.

The short convolution before Mamba-2's SSM and Gated DeltaNet's delta rule, as HF writes it without
a cache (``causal_conv1d_fn``, or ``nn.Conv1d`` with ``padding = K - 1``): convolve the channels-first
activations [1, C, T] with a depthwise weight [C, 1, K] padded by K - 1 on both sides, then keep the
first T outputs, so output t sees inputs t - K + 1 .. t. The activation after it stays in the graph.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from autodeploy.graph.matcher import Match
from autodeploy.graph.rewrite import PatternSpec, RewriteRule

aten = torch.ops.aten
_CHANNELS, _KERNEL, _TOKENS = 6, 4, 5


def causal_conv_with_bias(x, weight, bias):
    return F.conv1d(x, weight, bias, padding=_KERNEL - 1, groups=_CHANNELS)[:, :, : x.shape[-1]]


def causal_conv(x, weight):
    return F.conv1d(x, weight, None, padding=_KERNEL - 1, groups=_CHANNELS)[:, :, : x.shape[-1]]


class MatchCausalConv1d(RewriteRule):
    name = "match_causal_conv1d"
    required_ops = frozenset({aten.conv1d.default})

    def patterns(self) -> list[PatternSpec]:
        x, weight = torch.randn(1, _CHANNELS, _TOKENS), torch.randn(_CHANNELS, 1, _KERNEL)
        sizes = {aten.conv1d.default: {"padding", "groups"}, aten.slice.Tensor: {"end"}}  # checked in check()
        return [
            PatternSpec(causal_conv_with_bias, {"x": x, "weight": weight, "bias": torch.randn(_CHANNELS)}, ignored=sizes,
                        name="bias"),
            PatternSpec(causal_conv, {"x": x, "weight": weight}, ignored=sizes, name="no_bias"),
        ]

    def check(self, m: Match, gm) -> str | None:
        conv = next(n for n in m.nodes if n.target == aten.conv1d.default)
        _, _, _, stride, padding, dilation, groups = (list(conv.args) + [None] * 7)[:7]
        x, weight = m["x"].meta["val"], m["weight"].meta["val"]
        channels, kernel = weight.shape[0], weight.shape[-1]
        if x.shape[0] != 1 or weight.shape[1] != 1 or groups != channels or x.shape[1] != channels:
            return "not a depthwise convolution of one sequence"
        if list(stride or [1]) != [1] or list(dilation or [1]) != [1] or list(padding) != [kernel - 1]:
            return f"not causal: stride {stride}, dilation {dilation}, padding {padding} for kernel {kernel}"
        if m.anchor.meta["val"].shape != x.shape:
            return "keeps other outputs than the first T"
        return None

    def replacement_kwargs(self, m: Match, gm) -> dict:
        return {"x": m["x"], "weight": m["weight"], "bias": m.bindings.get("bias")}

    def replacement(self, x, weight, bias):
        rows = aten.transpose.int(aten.squeeze.dim(x, 0), 0, 1)  # [1, C, T] -> [T, C]
        flat_weight = aten.squeeze.dim(weight, 1)  # [C, 1, K] -> [C, K]
        out = torch.ops.autodeploy.causal_conv1d.default(rows, flat_weight, bias)
        return aten.unsqueeze.default(aten.transpose.int(out, 0, 1), 0)
