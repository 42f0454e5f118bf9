"""A small structural pattern matcher over exported (aten-level) FX graphs.

A pattern is plain eager code, traced once with ``torch.export`` into the same IR as the model.
Matching unifies the pattern graph with the model graph from the pattern's output backwards:

- pattern inputs (placeholders) bind to any node; one input used twice must bind the same node;
- ops must be equal (``view``/``reshape``/``_unsafe_view`` count as one), ``add``/``mul`` commute;
- dtype casts, ``contiguous`` and ``clone`` are transparent: model code differs mostly in where it
  casts, and the canonical ops define their own precision;
- size arguments of view-like ops are ignored (they hold symbolic sizes in the model graph);
- scalar literals must be equal, except *captured* scalars (traced with a sentinel value), which
  bind like inputs (``eps``, ``scale``...);
- every matched node except the output must be used only inside the match, so it can be removed.

Matches are candidates: each rule verifies its own matches further (see ``autodeploy.graph.rewrite``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch
from torch import fx

from .cleanup import cleanup_graph

aten = torch.ops.aten

TRANSPARENT_OPS = {
    aten.to.dtype,
    aten.to.dtype_layout,
    aten._to_copy.default,
    aten.type_as.default,
    aten.contiguous.default,
    aten.clone.default,
}
_SAME_OP = {aten.view.default: "reshape", aten._unsafe_view.default: "reshape", aten.reshape.default: "reshape"}
_SIZE_ARGS = {"reshape": {"size", "shape"}, aten.expand.default: {"size"}}
_COMMUTATIVE = {aten.add.Tensor, aten.mul.Tensor}


def op_key(target: Any) -> Any:
    return _SAME_OP.get(target, target)


def strip_transparent(node: Any) -> tuple[Any, list[fx.Node]]:
    """Follow casts/contiguous/clone up to the producing node; return it and the nodes skipped."""
    skipped = []
    while isinstance(node, fx.Node) and node.op == "call_function" and node.target in TRANSPARENT_OPS:
        skipped.append(node)
        node = node.args[0]
    return node, skipped


# dimension arguments compared after normalisation to non-negative values (x.transpose(-1, -2)
# and x.transpose(2, 3) are the same op on a 4-d tensor)
_DIM_ARGS = {
    aten.transpose.int: ("dim0", "dim1"),
    aten.softmax.int: ("dim",),
    aten.cat.default: ("dim",),
    aten.slice.Tensor: ("dim",),
    aten.mean.dim: ("dim",),
    aten.sum.dim_IntList: ("dim",),
}


def _rank(node: fx.Node) -> int | None:
    """Rank of the op's (first) input tensor."""
    first = node.args[0] if node.args else None
    if isinstance(first, (list, tuple)) and first:  # cat
        first = first[0]
    val = first.meta.get("val") if isinstance(first, fx.Node) else None
    return val.dim() if isinstance(val, torch.Tensor) else None


def _normalize_dim(value: Any, rank: int | None) -> Any:
    if rank is None:
        return value
    if isinstance(value, int) and not isinstance(value, bool):
        return value % rank if rank else value
    if isinstance(value, (list, tuple)) and all(isinstance(v, int) for v in value):
        return type(value)(v % rank if rank else v for v in value)
    return value


def schema_values(node: fx.Node) -> list[tuple[str, Any]]:
    """(name, value) for every schema argument of an op node, defaults filled in, dims normalized."""
    values = _raw_schema_values(node)
    if node.target == aten.slice.Tensor:  # x[:n] exports with start None or 0: one spelling
        values = [(n, 0 if n == "start" and v is None else v) for n, v in values]
    dim_args = _DIM_ARGS.get(node.target)
    if dim_args:
        rank = _rank(node)
        values = [(n, _normalize_dim(v, rank) if n in dim_args else v) for n, v in values]
        if node.target == aten.transpose.int:
            dims = sorted(v for n, v in values if n in dim_args) if rank is not None else None
            if dims is not None:
                values = [values[0], ("dim0", dims[0]), ("dim1", dims[1])]
    return values


def _raw_schema_values(node: fx.Node) -> list[tuple[str, Any]]:
    schema = getattr(node.target, "_schema", None)
    if schema is None:
        return [(str(i), a) for i, a in enumerate(node.args)] + sorted(node.kwargs.items())
    values = []
    for i, arg in enumerate(schema.arguments):
        if i < len(node.args) and not arg.kwarg_only:
            value = node.args[i]
        elif arg.name in node.kwargs:
            value = node.kwargs[arg.name]
        elif arg.has_default_value():
            value = arg.default_value
        else:
            value = None
        values.append((arg.name, value))
    return values


@dataclass(frozen=True)
class Pattern:
    """A traced pattern: its graph, output node, input names and captured-scalar sentinels."""

    name: str
    graph: fx.Graph
    output: fx.Node
    input_names: tuple[str, ...]
    sentinels: dict[Any, str]
    ignored: dict[Any, frozenset[str]]

    @property
    def anchor_key(self) -> Any:
        return op_key(self.output.target)


def trace_pattern(
    name: str,
    fn: Callable,
    example_inputs: dict[str, torch.Tensor],
    scalars: dict[str, Any] | None = None,
    ignored: dict[Any, set[str]] | None = None,
) -> Pattern:
    """Trace ``fn(**example_inputs, **scalars)`` with torch.export into a matchable pattern.

    ``scalars`` maps a captured scalar's name to the sentinel value it is traced with; the sentinel
    must be unusual enough not to appear in the pattern otherwise.
    """
    scalars = dict(scalars or {})
    names = tuple(example_inputs)

    class PatternModule(torch.nn.Module):
        def forward(self, *tensors):
            return fn(**dict(zip(names, tensors)), **scalars)

    with torch.no_grad():
        program = torch.export.export(PatternModule(), tuple(example_inputs.values()), strict=False)
    gm = cleanup_graph(program.graph_module)
    graph = gm.graph
    _drop_transparent(graph)
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    for node, input_name in zip(placeholders, names):
        node.target = input_name
        node.name = input_name
    (output,) = [n for n in graph.nodes if n.op == "output"]
    result = output.args[0]
    result = result[0] if isinstance(result, (tuple, list)) else result
    return Pattern(
        name=name,
        graph=graph,
        output=result,
        input_names=names,
        sentinels={v: k for k, v in scalars.items()},
        ignored={op_key(k): frozenset(v) for k, v in (ignored or {}).items()},
    )


def _drop_transparent(graph: fx.Graph) -> None:
    for node in list(graph.nodes):
        if node.op == "call_function" and node.target in TRANSPARENT_OPS:
            node.replace_all_uses_with(node.args[0])
            graph.erase_node(node)
    graph.eliminate_dead_code()


@dataclass
class Match:
    """One occurrence of a pattern: the model node it ends at, what it consumed, what it bound."""

    pattern: Pattern
    anchor: fx.Node
    bindings: dict[str, Any]
    nodes: set[fx.Node] = field(default_factory=set)
    node_map: dict[fx.Node, fx.Node] = field(default_factory=dict)

    def __getitem__(self, name: str) -> Any:
        return self.bindings[name]

    def copy(self) -> "Match":
        return Match(self.pattern, self.anchor, dict(self.bindings), set(self.nodes), dict(self.node_map))


class _Unifier:
    def __init__(self, pattern: Pattern):
        self.pattern = pattern

    def match_at(self, anchor: fx.Node) -> Match | None:
        start = Match(self.pattern, anchor, {})
        for candidate in self.node(self.pattern.output, anchor, start):
            if _exclusively_used(candidate):
                return candidate
        return None

    def node(self, p: fx.Node, t: Any, st: Match) -> Iterator[Match]:
        if p.op == "placeholder":
            yield from self.bind(p.target, t, st)
            return
        if not isinstance(t, fx.Node):
            return
        t, skipped = strip_transparent(t)
        if p in st.node_map:
            if st.node_map[p] is t:
                yield st
            return
        if t.op != "call_function" or op_key(p.target) != op_key(t.target):
            return
        p_vals, t_vals = schema_values(p), schema_values(t)
        if len(p_vals) != len(t_vals):
            return
        st = st.copy()
        st.node_map[p] = t
        st.nodes.update(skipped)
        st.nodes.add(t)
        ignored = self.pattern.ignored.get(op_key(p.target), frozenset()) | _SIZE_ARGS.get(op_key(p.target), set())
        pairs = [(pv, tv) for (name, pv), (_, tv) in zip(p_vals, t_vals) if name not in ignored]
        yield from self.values(pairs, st)
        if p.target in _COMMUTATIVE and len(pairs) >= 2:
            yield from self.values([(pairs[0][0], pairs[1][1]), (pairs[1][0], pairs[0][1]), *pairs[2:]], st)

    def bind(self, name: str, t: Any, st: Match) -> Iterator[Match]:
        if name in st.bindings:
            bound = st.bindings[name]
            if bound is t or strip_transparent(bound)[0] is strip_transparent(t)[0] or _same_literal(bound, t):
                yield st
            return
        st = st.copy()
        st.bindings[name] = t
        yield st

    def values(self, pairs: list[tuple[Any, Any]], st: Match) -> Iterator[Match]:
        if not pairs:
            yield st
            return
        (pv, tv), rest = pairs[0], pairs[1:]
        for st2 in self.value(pv, tv, st):
            yield from self.values(rest, st2)

    def value(self, pv: Any, tv: Any, st: Match) -> Iterator[Match]:
        if isinstance(pv, fx.Node):
            yield from self.node(pv, tv, st)
        elif isinstance(pv, (list, tuple)):
            if isinstance(tv, (list, tuple)) and len(pv) == len(tv):
                yield from self.values(list(zip(pv, tv)), st)
        elif _hashable(pv) and pv in self.pattern.sentinels and not isinstance(pv, bool):
            yield from self.bind(self.pattern.sentinels[pv], tv, st)
        elif _same_literal(pv, tv):
            yield st


def _hashable(value: Any) -> bool:
    try:
        hash(value)
    except TypeError:
        return False
    return True


def _same_literal(a: Any, b: Any) -> bool:
    if isinstance(a, fx.Node) or isinstance(b, fx.Node):
        return False
    if isinstance(a, float) and isinstance(b, (int, float)) and not isinstance(b, bool):
        return math.isclose(a, b, rel_tol=1e-9) or (math.isnan(a) and math.isnan(b))
    if isinstance(a, torch.dtype) or isinstance(b, torch.dtype):
        return a == b
    return type(a) is type(b) and a == b


def _exclusively_used(m: Match) -> bool:
    """Every consumed node other than the anchor feeds only consumed nodes."""
    for node in m.nodes:
        if node is m.anchor:
            continue
        if any(user not in m.nodes for user in node.users):
            return False
    return True


def find_matches(graph: fx.Graph, pattern: Pattern) -> Iterator[Match]:
    """Yield matches of ``pattern`` in node order; skips nodes erased by earlier replacements."""
    unifier = _Unifier(pattern)
    key = pattern.anchor_key
    for node in list(graph.nodes):
        if getattr(node, "_erased", False) or node.op != "call_function" or op_key(node.target) != key:
            continue
        match = unifier.match_at(node)
        if match is not None:
            yield match
