"""Canonicalization passes: apply ``match_*`` rule sets, then check nothing they own is left.

Zero matches is a decision, not a default: a pass whose source ops remain after its rules ran
fails with the nodes that were not rewritten (and why, when a rule rejected them).
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import fx

from autodeploy.graph.rewrite import apply_rule
from autodeploy.pipeline.base import CompileContext, Pass, PassConfig, PassResult, Stage
from autodeploy.transforms import RULES

aten = torch.ops.aten


class RuleSetConfig(PassConfig):
    rules: list[str]
    require_complete: bool = True


class RuleSetPass(Pass):
    """Applies its configured rules in order; ``leftovers`` names what must be gone afterwards."""

    stage = Stage.CANONICALIZE
    Config = RuleSetConfig

    def leftovers(self, gm: fx.GraphModule) -> list[fx.Node]:
        return []

    def apply(self, ctx: CompileContext) -> PassResult:
        counts, reasons = [], []
        for rule_name in self.config.rules:
            result = apply_rule(ctx.gm, RULES.get(rule_name)(), provenance=self.name)
            counts.append(f"{rule_name}={result.matches}")
            reasons.extend(result.reasons)
            ctx.artifacts.setdefault("rule_matches", {})[rule_name] = result.matches
        left = self.leftovers(ctx.gm)
        if left and self.config.require_complete:
            why = f"; rejected matches: {'; '.join(reasons[:5])}" if reasons else ""
            names = ", ".join(f"{n.name} ({n.target})" for n in left[:5])
            raise RuntimeError(f"{len(left)} node(s) were not canonicalized: {names}{why}")
        total = sum(ctx.artifacts["rule_matches"][r] for r in self.config.rules)
        return PassResult(total, " ".join(counts))


def _nodes(gm: fx.GraphModule, targets: set) -> list[fx.Node]:
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target in targets]


class CanonicalizeAttention(RuleSetPass):
    """Eager (matmul-softmax-matmul) and SDPA attention -> ``autodeploy::attention``."""

    name = "canonicalize_attention"
    ensures = ("attention_canonical",)
    _SOURCES: ClassVar[set] = {aten.scaled_dot_product_attention.default, torch.ops.autodeploy.repeat_kv.default}

    def leftovers(self, gm: fx.GraphModule) -> list[fx.Node]:
        return _nodes(gm, self._SOURCES) + [n for n in _nodes(gm, {aten.softmax.int}) if _is_attention_softmax(n)]


def _is_attention_softmax(node: fx.Node) -> bool:
    """A softmax whose input comes (through elementwise ops) from a matmul of two activations."""
    frontier, seen = [node.args[0]], set()
    while frontier:
        cur = frontier.pop()
        if not isinstance(cur, fx.Node) or cur in seen or cur.op != "call_function":
            continue
        seen.add(cur)
        if cur.target in (aten.matmul.default, aten.bmm.default, aten.baddbmm.default, aten.einsum.default):
            return True
        if cur.target in (aten.linear.default, aten.mm.default, aten.addmm.default):
            continue
        frontier.extend(a for a in cur.args if isinstance(a, fx.Node))
    return False


class CanonicalizeRoPE(RuleSetPass):
    name = "canonicalize_rope"
    ensures = ("rope_canonical",)


class CanonicalizeNorms(RuleSetPass):
    name = "canonicalize_norms"
    ensures = ("norms_canonical",)


class CanonicalizeMLP(RuleSetPass):
    name = "canonicalize_mlp"
    ensures = ("mlp_canonical",)


class CanonicalizeMoE(RuleSetPass):
    """Export-friendly HF MoE experts (``batched_mm``) -> ``autodeploy::moe``."""

    name = "canonicalize_moe"
    ensures = ("moe_canonical",)

    def leftovers(self, gm: fx.GraphModule) -> list[fx.Node]:
        # batched expert GEMMs index stacked expert weights with routing ids: none may remain
        return [n for n in _nodes(gm, {aten.bmm.default}) if _reads_indexed_weight(n)]


def _reads_indexed_weight(node: fx.Node) -> bool:
    return any(isinstance(a, fx.Node) and a.target == aten.index.Tensor for a in node.args)
