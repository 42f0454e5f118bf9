"""Canonicalization passes: apply ``match_*`` rule sets, then check nothing they own is left.

Zero matches is a decision, not a default: a pass whose source ops remain after its rules ran
fails with an :class:`UnsupportedLayerError`: the kind of layer, the HF modules its leftover nodes
came from, the nodes and why a rule rejected them, and (from the runner) where the graph dump is.
"""

from __future__ import annotations

from collections import Counter
from typing import ClassVar

import torch
from torch import fx

from autodeploy.errors import UnsupportedLayerError
from autodeploy.graph.modules import layers_of, module_stack
from autodeploy.graph.rewrite import apply_rule
from autodeploy.pipeline.base import CompileContext, Pass, PassConfig, PassResult, Stage
from autodeploy.transforms import RULES

aten = torch.ops.aten


class RuleSetConfig(PassConfig):
    rules: list[str]
    require_complete: bool = True


class RuleSetPass(Pass):
    """Applies its configured rules in order; ``leftovers`` names what must be gone afterwards, and
    ``layer_kind`` what a leftover is part of, in words."""

    stage = Stage.CANONICALIZE
    Config = RuleSetConfig
    layer_kind: ClassVar[str] = "layer"

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
            raise self.unsupported(left, reasons)
        total = sum(ctx.artifacts["rule_matches"][r] for r in self.config.rules)
        return PassResult(total, " ".join(counts))

    def unsupported(self, left: list[fx.Node], reasons: list[str]) -> UnsupportedLayerError:
        rejected = f"; rejected matches: {'; '.join(reasons[:3])}" if reasons else ""
        ops = ", ".join(f"{count} {target}" for target, count in Counter(str(n.target) for n in left).items())
        why = f"no rule of {self.name} rewrites it ({len(left)} node(s) not canonicalized: {ops}{rejected})"
        return UnsupportedLayerError(self.layer_kind, layers_of(left), why)


def _nodes(gm: fx.GraphModule, targets: set) -> list[fx.Node]:
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target in targets]


class CanonicalizeAttention(RuleSetPass):
    """Eager (matmul-softmax-matmul) and SDPA attention -> ``autodeploy::attention``."""

    name = "canonicalize_attention"
    ensures = ("attention_canonical",)
    layer_kind = "attention"
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
    layer_kind = "rotary embedding"
    ensures = ("rope_canonical",)


class CanonicalizeNorms(RuleSetPass):
    name = "canonicalize_norms"
    layer_kind = "normalization"
    ensures = ("norms_canonical",)


class CanonicalizeMLP(RuleSetPass):
    name = "canonicalize_mlp"
    layer_kind = "MLP"
    ensures = ("mlp_canonical",)


class CanonicalizeMoE(RuleSetPass):
    """HF MoE experts -> ``autodeploy::moe``: most arrive as the op already (``autodeploy.hf_experts``);
    the rules rewrite transformers' ``batched_mm`` code of the others. Every experts module the
    model ran (``gm.meta["autodeploy_experts_modules"]``) must end up as a ``moe`` op."""

    name = "canonicalize_moe"
    ensures = ("moe_canonical",)
    layer_kind = "MoE experts layer"

    def leftovers(self, gm: fx.GraphModule) -> list[fx.Node]:
        # batched expert GEMMs index stacked expert weights with routing ids: none may remain
        indexed = [n for n in _nodes(gm, {aten.bmm.default}) if _reads_indexed_weight(n)]
        return indexed + [n for n in experts_without_moe(gm) if n not in indexed]


def _reads_indexed_weight(node: fx.Node) -> bool:
    return any(isinstance(a, fx.Node) and a.target == aten.index.Tensor for a in node.args)


def experts_without_moe(gm: fx.GraphModule) -> list[fx.Node]:
    """The nodes of every experts module that ran in the graph without becoming a ``moe`` op."""
    expected = set(gm.meta.get("autodeploy_experts_modules", ()))
    covered: set[str] = set()
    inside: dict[str, list[fx.Node]] = {}
    for node in (n for n in gm.graph.nodes if n.op == "call_function"):
        paths = expected.intersection(path for path, _ in module_stack(node))
        if node.target == torch.ops.autodeploy.moe.default:
            covered |= paths
        for path in paths:
            inside.setdefault(path, []).append(node)
    return [node for path in sorted(set(inside) - covered) for node in inside[path]]
