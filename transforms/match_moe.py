"""match_moe: HF's static-shape MoE experts (``batched_mm``) -> ``autodeploy::moe``.

The fallback behind ``autodeploy.hf_experts``: models are built with autodeploy's own experts
implementation, which emits ``autodeploy::moe`` directly where it can; experts it does not take run
transformers' ``batched_mm_experts_forward``, and so does any model built with
``experts_implementation="batched_mm"``. That code (stacked ``gate_up_proj[E, 2I, H]`` and
``down_proj[E, H, I]``, gate rows first, no bias) is the pattern: each token is repeated K times,
each copy multiplied with the weights of its expert gathered by id, gated, projected down, weighted
by its routing weight, and the K copies summed. transformers 5.17 clamps the expert ids into range
first; 5.25 clamps them only under expert parallelism: both spellings are patterns.
Routing (router linear, softmax/top-k, renormalisation) stays in the graph as ordinary ops: its
outputs are the ``topk_ids`` / ``topk_weights`` operands of the canonical op.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from autodeploy.graph.matcher import Match, schema_values
from autodeploy.graph.rewrite import PatternSpec, RewriteRule

aten = torch.ops.aten
_ACTIVATIONS = {
    "silu": F.silu,
    "gelu": F.gelu,
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
}
# K (repeats), the expert-id clamp bounds and view sizes are model constants: checked, not matched
_IGNORED = {aten.repeat_interleave.self_int: {"repeats", "output_size"}, aten.clamp.default: {"min", "max"}}


def _batched_mm_experts(act, clamp: bool):
    """transformers' ``batched_mm_experts_forward`` for gated, concatenated, untransposed experts,
    with or without the expert-id clamp."""

    def pattern(x, topk_ids, topk_weights, w_gate_up, w_down):
        num_tokens, hidden = x.shape
        top_k = topk_ids.shape[-1]
        selected = x.repeat_interleave(top_k, dim=0)
        weights = topk_weights.reshape(-1)
        ids = topk_ids.reshape(-1)
        if clamp:
            ids = ids.clamp(0, w_gate_up.shape[0] - 1)
        gate_up = torch.bmm(w_gate_up[ids], selected.unsqueeze(-1)).squeeze(-1)
        gate, up = gate_up.chunk(2, dim=-1)
        hidden_states = act(gate) * up
        out = torch.bmm(w_down[ids], hidden_states.unsqueeze(-1)).squeeze(-1)
        weighted = out * weights.unsqueeze(-1)
        return weighted.view(num_tokens, top_k, hidden).sum(dim=1)

    return pattern


def _example() -> dict[str, torch.Tensor]:
    experts, hidden, inter, tokens, top_k = 4, 8, 6, 3, 2
    return {
        "x": torch.randn(tokens, hidden),
        "topk_ids": torch.randint(0, experts, (tokens, top_k)),
        "topk_weights": torch.rand(tokens, top_k),
        "w_gate_up": torch.randn(experts, 2 * inter, hidden),
        "w_down": torch.randn(experts, hidden, inter),
    }


def _arguments(m: Match, target) -> dict:
    """Schema arguments (name -> value) of the matched ``target`` node."""
    return dict(schema_values(next(n for n in m.nodes if n.target == target)))


class MatchMoE(RewriteRule):
    name = "match_moe"
    required_ops = frozenset({aten.bmm.default, aten.index.Tensor})

    def patterns(self) -> list[PatternSpec]:
        return [
            PatternSpec(_batched_mm_experts(act, clamp), _example(), ignored=_IGNORED,
                        name=f"batched_mm{'' if clamp else '_unclamped'}:{act_name}")
            for clamp in (True, False)
            for act_name, act in _ACTIVATIONS.items()
        ]

    def check(self, m: Match, gm) -> str | None:
        top_k = m["topk_ids"].meta["val"].shape[-1]
        experts = m["w_gate_up"].meta["val"].shape[0]
        repeats = _arguments(m, aten.repeat_interleave.self_int)["repeats"]
        if repeats != top_k:
            return f"tokens repeated {repeats} times for top-{top_k} routing"
        if any(n.target == aten.clamp.default for n in m.nodes):
            clamp = _arguments(m, aten.clamp.default)
            low, high = clamp["min"], clamp["max"]
            if (low is not None and low > 0) or (high is not None and high < experts - 1):
                return f"expert ids clamped to [{low}, {high}], which cuts off some of the {experts} experts"
        summed = m.anchor.args[0].meta["val"].shape
        if summed[-2] != top_k:
            return f"sums groups of {summed[-2]} expert outputs for top-{top_k} routing"
        if m["w_down"].meta["val"].shape[-1] * 2 != m["w_gate_up"].meta["val"].shape[1]:
            return "gate_up rows are not twice the down projection's input width"
        return None

    def replacement_kwargs(self, m: Match, gm) -> dict:
        return {**m.bindings, "activation": m.pattern.name.split(":")[1]}

    def replacement(self, x, topk_ids, topk_weights, w_gate_up, w_down, activation):
        return torch.ops.autodeploy.moe.default(x, topk_ids, topk_weights, w_gate_up, w_down, activation)
