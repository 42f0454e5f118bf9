"""Rewrite rules: a pattern written as the eager code it matches, a replacement, and verification.

A rule subclasses :class:`RewriteRule`::

    class MatchRMSNorm(RewriteRule):
        name = "match_rms_norm"

        def patterns(self):
            return [PatternSpec(llama_rms_norm, {"x": rand(2, 8), "weight": rand(8)}, scalars={"eps": EPS})]

        def replacement(self, x, weight, eps):
            return torch.ops.autodeploy.rms_norm(x, weight, eps)

``replacement`` is eager code too: it runs on FX proxies, so write ops as ``torch.ops.aten.*`` /
``torch.ops.autodeploy.*`` calls (Tensor methods would not produce aten nodes). Every structural
match is then checked by ``check`` (rule-specific conditions on shapes and bound values) and, for
the first match of each shape signature, verified numerically: the matched subgraph and the
replacement run on the same random inputs and must agree.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar

import torch
from torch import fx
from torch.utils import _pytree as pytree

from .matcher import Match, Pattern, find_matches, trace_pattern
from .meta import concrete_shape, propagate_meta, size_hint

log = logging.getLogger("autodeploy.rewrite")

VERIFY_MAX_ELEMENTS = 1 << 24


@dataclass(frozen=True)
class PatternSpec:
    """How to trace one pattern variant: the function, example tensors, captured scalars."""

    fn: Callable
    example_inputs: dict[str, torch.Tensor]
    scalars: dict[str, Any] = field(default_factory=dict)
    ignored: dict[Any, set[str]] = field(default_factory=dict)
    name: str | None = None


@dataclass
class RuleResult:
    matches: int = 0
    rejected: int = 0
    reasons: list[str] = field(default_factory=list)


class RewriteRule(ABC):
    """Base class of rewrite rules (see module docstring)."""

    name: ClassVar[str] = ""
    # ops that every pattern of the rule contains (exact targets, no casts or view/reshape, which the
    # matcher sees through): while the graph lacks one, no pattern can match, so apply_rule stops
    # before tracing the rest (~20 ms each with torch.export); empty: never skip
    required_ops: ClassVar[frozenset] = frozenset()
    _traced: ClassVar[dict[tuple[str, int], Pattern]] = {}  # per process: (rule class, pattern index)

    @abstractmethod
    def patterns(self) -> list[PatternSpec]:
        """The pattern variants this rule matches."""

    @abstractmethod
    def replacement(self, **kwargs) -> Any:
        """Eager code (on proxies) that computes the same value with canonical ops."""

    def check(self, m: Match, gm: fx.GraphModule) -> str | None:
        """Return None to accept the match or a reason to reject it."""
        return None

    def replacement_kwargs(self, m: Match, gm: fx.GraphModule) -> dict[str, Any]:
        """Arguments of ``replacement``; defaults to the match bindings."""
        return dict(m.bindings)

    def verification_inputs(self, m: Match, values: dict[fx.Node, Any]) -> None:
        """Adjust the random inputs of numerical verification in place (e.g. a real mask)."""

    def traced_pattern(self, index: int, spec: PatternSpec) -> Pattern:
        """``spec`` (the rule's pattern number ``index``) traced, once per process."""
        key = (f"{type(self).__module__}.{type(self).__qualname__}", index)
        if key not in RewriteRule._traced:
            name = spec.name or f"{self.name}[{index}]"
            traced = trace_pattern(name, spec.fn, spec.example_inputs, spec.scalars, spec.ignored)
            RewriteRule._traced[key] = traced
        return RewriteRule._traced[key]

    def traced_patterns(self) -> list[Pattern]:
        return [self.traced_pattern(i, spec) for i, spec in enumerate(self.patterns())]


def apply_rule(gm: fx.GraphModule, rule: RewriteRule, provenance: str) -> RuleResult:
    """Apply ``rule`` everywhere it matches in ``gm``; returns match and rejection counts.

    Patterns are tried in order and traced only when tried: once the graph lacks one of the rule's
    ``required_ops`` (e.g. every attention already replaced) the rest are skipped.
    """
    result = RuleResult()
    verified: set[tuple] = set()
    for index, spec in enumerate(rule.patterns()):
        if not all(_present(gm.graph, op) for op in rule.required_ops):
            break
        replaced = result.matches
        for m in find_matches(gm.graph, rule.traced_pattern(index, spec)):
            reason = rule.check(m, gm)
            kwargs = rule.replacement_kwargs(m, gm) if reason is None else None
            if reason is None:
                reason = _verify_once(gm, rule, m, kwargs, verified)
            if reason is not None:
                result.rejected += 1
                result.reasons.append(f"{m.anchor.name}: {reason}")
                log.debug("%s rejected match at %s: %s", rule.name, m.anchor.name, reason)
                continue
            replace_match(gm, m, rule.replacement, kwargs, provenance=f"{provenance}/{rule.name}")
            result.matches += 1
        if result.matches > replaced:
            gm.graph.eliminate_dead_code()  # the replaced nodes go now: the check above sees what is left
    gm.graph.eliminate_dead_code()
    gm.recompile()
    return result


def _present(graph: fx.Graph, op) -> bool:
    return bool(graph.find_nodes(op="call_function", target=op, sort=False))


def replace_match(gm: fx.GraphModule, m: Match, fn: Callable, kwargs: dict[str, Any], provenance: str) -> fx.Node:
    """Insert ``fn(**kwargs)`` (traced on proxies) before the anchor and reroute its users."""
    graph = gm.graph
    tracer = fx.proxy.GraphAppendingTracer(graph)
    before = set(graph.nodes)
    with graph.inserting_before(m.anchor):
        proxies = pytree.tree_map_only(fx.Node, lambda n: fx.Proxy(n, tracer), kwargs)
        out = fn(**proxies)
        new_node = out.node
        new_nodes = [n for n in graph.nodes if n not in before]
        propagate_meta(gm, new_nodes)
        new_node = _cast_like(graph, gm, new_node, m.anchor)
    for node in [n for n in graph.nodes if n not in before]:
        node.meta["autodeploy_provenance"] = provenance
        node.meta["autodeploy_replaced"] = m.anchor.name
        for key in ("stack_trace", "nn_module_stack"):
            if key in m.anchor.meta:
                node.meta.setdefault(key, m.anchor.meta[key])
    m.anchor.replace_all_uses_with(new_node)
    for node in reversed(list(graph.nodes)):
        if node in m.nodes and not node.users:
            graph.erase_node(node)
    return new_node


def _cast_like(graph: fx.Graph, gm: fx.GraphModule, node: fx.Node, like: fx.Node) -> fx.Node:
    want, got = like.meta.get("val"), node.meta.get("val")
    if isinstance(want, torch.Tensor) and isinstance(got, torch.Tensor) and want.dtype != got.dtype:
        node = graph.call_function(torch.ops.aten.to.dtype, (node, want.dtype))
        propagate_meta(gm, [node])
    return node


# ----------------------------------------------------------------------------- verification


def _verify_once(gm: fx.GraphModule, rule: RewriteRule, m: Match, kwargs: dict, seen: set) -> str | None:
    inputs = _region_inputs(m)
    signature = (
        m.pattern.name,
        tuple(tuple(concrete_shape(n.meta["val"])) if _is_tensor(n) else None for n in inputs),
        tuple(sorted((k, v) for k, v in kwargs.items() if not isinstance(v, (fx.Node, list, tuple)))),
    )
    if signature in seen:
        return None
    seen.add(signature)
    numel = sum(_numel(n) for n in inputs)
    if numel > VERIFY_MAX_ELEMENTS:
        log.debug("%s: match at %s too large to verify numerically (%d elements)", rule.name, m.anchor.name, numel)
        return None
    try:
        values = {n: _random_value(n) for n in inputs}
        rule.verification_inputs(m, values)
        expected = _run_region(m, values)
        got = rule.replacement(**pytree.tree_map_only(fx.Node, lambda n: values[n], kwargs))
    except Exception as exc:  # a region we cannot evaluate is not verified, not rejected
        log.debug("%s: could not verify match at %s: %r", rule.name, m.anchor.name, exc)
        return None
    got = got.to(expected.dtype)
    if expected.shape != got.shape:
        return f"replacement shape {tuple(got.shape)} != matched {tuple(expected.shape)}"
    tol = 1e-3 if expected.dtype == torch.float32 else 3e-2
    if not torch.allclose(got, expected, rtol=tol, atol=tol):
        err = (got.float() - expected.float()).abs().max().item()
        return f"replacement differs numerically from the matched code (max abs err {err:.3g})"
    return None


def _is_tensor(node: fx.Node) -> bool:
    return isinstance(node.meta.get("val"), torch.Tensor)


def _numel(node: fx.Node) -> int:
    if not _is_tensor(node):
        return 0
    n = 1
    for s in concrete_shape(node.meta["val"]):
        n *= s
    return n


def _region_inputs(m: Match) -> list[fx.Node]:
    inputs: list[fx.Node] = []
    for node in m.nodes:
        for arg in node.all_input_nodes:
            if arg not in m.nodes and arg not in inputs:
                inputs.append(arg)
    return inputs


def _random_value(node: fx.Node) -> Any:
    val = node.meta.get("val")
    if isinstance(val, torch.Tensor):
        shape = concrete_shape(val)
        if val.dtype.is_floating_point:
            return torch.randn(shape, dtype=torch.float32).to(val.dtype)
        if val.dtype == torch.bool:
            return torch.ones(shape, dtype=torch.bool)
        return torch.randint(0, 2, shape, dtype=val.dtype)
    if isinstance(val, torch.SymInt):
        return size_hint(val)
    if val is None:
        raise ValueError(f"no metadata for {node.name}")
    return val


def _run_region(m: Match, values: dict[fx.Node, Any]) -> torch.Tensor:
    env = dict(values)
    for node in _topological(m):
        args, kwargs = pytree.tree_map_only(fx.Node, lambda n: env[n], (node.args, dict(node.kwargs)))
        kwargs = {k: ("cpu" if k == "device" else v) for k, v in kwargs.items()}
        env[node] = node.target(*args, **kwargs)
    return env[m.anchor]


def _topological(m: Match) -> list[fx.Node]:
    order = {n: i for i, n in enumerate(m.anchor.graph.nodes)}
    return sorted(m.nodes, key=order.__getitem__)
