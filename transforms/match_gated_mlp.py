"""match_gated_mlp: gated MLPs (SwiGLU, GeGLU) -> ``autodeploy::swiglu``.

Matches ``down(act(gate(x)) * up(x))`` with separate gate/up projections (Llama, Mistral, Qwen,
Gemma) and with one fused ``gate_up`` projection split in halves (Phi-3). Activations: SiLU, exact
GELU, tanh-approximated GELU.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from autodeploy.graph.matcher import Match
from autodeploy.graph.rewrite import PatternSpec, RewriteRule

aten = torch.ops.aten
_ACTIVATIONS = {
    "silu": F.silu,
    "gelu": F.gelu,
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
}


def _separate(act):
    def pattern(x, w_gate, w_up, w_down):
        return F.linear(act(F.linear(x, w_gate)) * F.linear(x, w_up), w_down)

    return pattern


def _fused(act):
    def pattern(x, w_gate_up, w_down):
        gate, up = F.linear(x, w_gate_up).chunk(2, dim=-1)
        return F.linear(up * act(gate), w_down)

    return pattern


class MatchGatedMLP(RewriteRule):
    name = "match_gated_mlp"

    def patterns(self) -> list[PatternSpec]:
        x = torch.randn(1, 3, 8)
        specs = []
        for act_name, act in _ACTIVATIONS.items():
            separate = {"x": x, "w_gate": torch.randn(16, 8), "w_up": torch.randn(16, 8), "w_down": torch.randn(8, 16)}
            fused = {"x": x, "w_gate_up": torch.randn(32, 8), "w_down": torch.randn(8, 16)}
            specs.append(PatternSpec(_separate(act), separate, name=f"separate:{act_name}"))
            specs.append(PatternSpec(_fused(act), fused, name=f"fused:{act_name}"))
        return specs

    def replacement_kwargs(self, m: Match, gm) -> dict:
        kind, activation = m.pattern.name.split(":")
        kwargs = {"x": m["x"], "w_down": m["w_down"], "activation": activation}
        if kind == "separate":
            return {**kwargs, "w_gate": m["w_gate"], "w_up": m["w_up"], "inter": None}
        inter = m["w_gate_up"].meta["val"].shape[0] // 2
        return {**kwargs, "w_gate": m["w_gate_up"], "w_up": m["w_gate_up"], "inter": int(inter)}

    def replacement(self, x, w_gate, w_up, w_down, activation, inter):
        if inter is not None:  # fused gate_up weight: gate rows first, then up rows
            w_gate = aten.slice.Tensor(w_gate, 0, 0, inter)
            w_up = aten.slice.Tensor(w_up, 0, inter, 2 * inter)
        return torch.ops.autodeploy.swiglu.default(x, w_gate, w_up, w_down, activation)
