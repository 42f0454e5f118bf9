"""Follow a sharded dimension through the graph (the analysis behind the ``shard`` plan).

A column-parallel linear leaves each rank 1/factor of its output features: its output is *split*
along its last dimension into ``factor`` contiguous blocks, rank r holding block ``r * factor //
world`` (``factor`` is the world size, or fewer where key/value heads are replicated). From such
seeds :class:`SplitTracer` walks the graph in order and derives, op by op, which dimension of each
value is split: layout ops move it (a view's split lands on the outermost output dimension of its
factor group: whole heads), elementwise ops keep it, the canonical attention keeps it on the heads.
It stops at row-parallel linears (their input split along the features they reduce over). Anything
else that reads a split value — a reduction or norm across it, an unknown op, the graph output —
is refused with the node's name: a plan that cannot be followed exactly is never guessed.

Along the way it collects what the apply step must change besides the linears: parameters the split
values meet across the split dimension (attention sinks, per-head scales) and literal sizes in
views/expands that count the whole dimension.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass, field

import torch
from torch import fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

from autodeploy.errors import UnsupportedPatternError

aten = torch.ops.aten
AD = torch.ops.autodeploy


class ShardError(UnsupportedPatternError):
    """The graph cannot be sharded as planned; the message names the node and the reason."""


@dataclass(frozen=True)
class Split:
    """Dimension ``dim`` of a value is cut into ``factor`` contiguous blocks."""

    dim: int
    factor: int


@dataclass(frozen=True)
class LiteralFix:
    """Divide the literal size at ``args[1][position]`` of node ``node`` (a view/expand) by ``factor``."""

    node: str
    position: int
    factor: int


@dataclass(frozen=True)
class SliceFix:
    """Node ``node`` (a slice of a fused projection's output or weight) takes ``[start, end)`` instead."""

    node: str
    start: int
    end: int


Fix = LiteralFix | SliceFix


@dataclass
class Traced:
    splits: dict[fx.Node, Split] = field(default_factory=dict)
    sinks: list[fx.Node] = field(default_factory=list)  # row-parallel linears reached
    sink_splits: dict[str, Split] = field(default_factory=dict)  # their input's split
    params: dict[str, tuple[int, int]] = field(default_factory=dict)  # parameter -> (dim, factor)
    fixes: list[LiteralFix] = field(default_factory=list)


SAME_SPLIT_OPS = {aten.contiguous.default, aten.clone.default, aten.alias.default, aten.to.dtype, aten._to_copy.default,
         aten.to.dtype_layout, aten.to.device, aten.detach.default, aten.type_as.default}
ELEMENTWISE_OPS = {aten.add.Tensor, aten.sub.Tensor, aten.mul.Tensor, aten.div.Tensor, aten.add.Scalar,
                aten.sub.Scalar, aten.mul.Scalar, aten.div.Scalar, aten.rsub.Scalar, aten.neg.default,
                aten.pow.Tensor_Scalar, aten.rsqrt.default, aten.sqrt.default, aten.exp.default, aten.tanh.default,
                aten.sigmoid.default, aten.silu.default, aten.gelu.default, aten.relu.default, aten.abs.default,
                aten.reciprocal.default, aten.erf.default, aten.clamp.default, aten.maximum.default,
                aten.minimum.default, aten.where.self, aten.square.default, aten.log.default}
_VIEWS = {aten.view.default, aten.reshape.default, aten._unsafe_view.default}
_REDUCTIONS = {aten.mean.dim, aten.sum.dim_IntList, aten.amax.default, aten.amin.default}


def val(node) -> torch.Tensor | None:
    return node.meta.get("val") if isinstance(node, fx.Node) else None


def _norm(dim: int, ndim: int) -> int:
    return dim + ndim if dim < 0 else dim


def is_param(node) -> bool:
    return isinstance(node, fx.Node) and node.op == "get_attr"


def linear_parts(node: fx.Node) -> dict[str, object] | None:
    """``{"input", "weight", "bias", <other tensor args>}`` of a linear layer: ``aten.linear`` or a
    custom op named ``*linear`` whose schema has a ``weight`` argument (quantized linears: their scale
    arguments come along by name); None for anything else."""
    if node.op != "call_function":
        return None
    if node.target == aten.linear.default:
        x, w, b = (list(node.args) + [None])[:3]
        return {"input": x, "weight": w, "bias": b}
    schema = getattr(node.target, "_schema", None)
    if schema is None or not schema.name.endswith("linear") or "weight" not in [a.name for a in schema.arguments]:
        return None
    return op_arguments(node)


def op_arguments(node: fx.Node) -> dict[str, object]:
    """A custom op's arguments by schema name (defaults filled in); the first one is called ``input``."""
    schema = node.target._schema
    bound = {a.name: (node.args[i] if i < len(node.args) else node.kwargs.get(a.name, a.default_value))
             for i, a in enumerate(schema.arguments)}
    first = schema.arguments[0].name
    return {"input": bound.pop(first), **bound}


class SplitTracer:
    """Walks the graph from seeds (values split along a dimension) to the row-parallel linears."""

    def __init__(self, gm: fx.GraphModule, world: int):
        self.gm, self.world = gm, world
        self.order = {n: i for i, n in enumerate(gm.graph.nodes)}

    def trace(self, seeds: dict[fx.Node, Split]) -> Traced:
        out = Traced(splits=dict(seeds))
        start = min(self.order[n] for n in seeds)
        last_use = max(self.order[u] for n in seeds for u in n.users)
        for node in list(self.gm.graph.nodes)[start + 1:]:
            if self.order[node] > last_use:
                break
            inputs = [a for a in node.all_input_nodes if a in out.splits]
            if not inputs or node in out.splits:
                continue
            split = self._step(node, out)
            if split is not None:
                out.splits[node] = split
                last_use = max([last_use, *(self.order[u] for u in node.users)])
        if not out.sinks:
            raise ShardError("the split values reach no row-parallel linear (nothing would sum them)")
        return out

    def _step(self, node: fx.Node, out: Traced) -> Split | None:
        if node.op == "output":
            raise ShardError("a sharded value reaches the graph output")
        parts = linear_parts(node)
        if parts is not None:
            return self._row_linear(node, parts, out)
        rule = _RULES.get(node.target)
        if rule is None:
            name = getattr(node.target, "__name__", str(node.target))
            raise ShardError(f"{node.name}: the shard plan cannot follow a sharded value through {name}")
        return rule(self, node, out)

    def _row_linear(self, node: fx.Node, parts: dict, out: Traced) -> None:
        x = parts["input"]
        split = out.splits.get(x)
        others = [a for k, a in parts.items() if k != "input" and a in out.splits]
        if split is None or others:
            raise ShardError(f"{node.name}: a linear whose weights, not its input, are sharded")
        if split.dim != val(x).dim() - 1:
            raise ShardError(f"{node.name}: its input is sharded along dimension {split.dim}, not the features")
        if not is_param(parts["weight"]):
            raise ShardError(f"{node.name}: a row-parallel linear's weight must be a parameter")
        out.sinks.append(node)
        out.sink_splits[node.name] = split

    # ---- helpers the rules share ----------------------------------------------------------------

    def broadcast_operand(self, node: fx.Node, operand, split: Split, out_ndim: int, out: Traced) -> None:
        """A replicated operand broadcast against a split value: size 1 (or no dimension) at the
        split position, or a parameter that is then sharded along it too."""
        v = val(operand)
        if not isinstance(v, torch.Tensor):
            return
        dim = split.dim - (out_ndim - v.dim())
        if dim < 0 or statically_known_true(v.shape[dim] == 1):
            return
        source = _through_casts(operand)
        if is_param(source) and len(source.users) == 1:
            out.params[str(source.target)] = (dim, split.factor)
            return
        raise ShardError(f"{node.name}: {operand.name} spans the sharded dimension but is not a parameter")


def _through_casts(node: fx.Node) -> fx.Node:
    while node.op == "call_function" and node.target in SAME_SPLIT_OPS and len(node.users) == 1:
        node = node.args[0]
    return node


# ---- rules: (tracer, node, traced) -> the split of the node's output ---------------------------------


def _same(tracer: SplitTracer, node: fx.Node, out: Traced) -> Split:
    return out.splits[node.args[0]]


def _elementwise(tracer: SplitTracer, node: fx.Node, out: Traced) -> Split:
    ndim = val(node).dim()
    operands = [a for a in node.args if isinstance(a, fx.Node)]
    aligned = {Split(s.dim + ndim - val(a).dim(), s.factor) for a in operands if (s := out.splits.get(a))}
    if len(aligned) != 1:
        raise ShardError(f"{node.name}: its operands are sharded along different dimensions")
    split = aligned.pop()
    for a in operands:
        if a not in out.splits:
            tracer.broadcast_operand(node, a, split, ndim, out)
    return split


def _transpose(tracer, node, out) -> Split:
    s, ndim = out.splits[node.args[0]], val(node).dim()
    d0, d1 = _norm(node.args[1], ndim), _norm(node.args[2], ndim)
    return Split({d0: d1, d1: d0}.get(s.dim, s.dim), s.factor)


def _permute(tracer, node, out) -> Split:
    s, ndim = out.splits[node.args[0]], val(node).dim()
    return Split([_norm(d, ndim) for d in node.args[1]].index(s.dim), s.factor)


def _unsqueeze(tracer, node, out) -> Split:
    s = out.splits[node.args[0]]
    d = _norm(node.args[1], val(node).dim())
    return Split(s.dim + (d <= s.dim), s.factor)


def _squeeze(tracer, node, out) -> Split:
    s, in_ndim = out.splits[node.args[0]], val(node.args[0]).dim()
    dims = node.args[1] if len(node.args) > 1 else range(in_ndim)
    dims = [dims] if isinstance(dims, int) else dims
    removed = [d for d in (_norm(d, in_ndim) for d in dims) if statically_known_true(val(node.args[0]).shape[d] == 1)]
    return Split(s.dim - sum(d < s.dim for d in removed), s.factor)


def _not_along(node: fx.Node, s: Split, dim: int, what: str) -> None:
    if _norm(dim, val(node.args[0]).dim()) == s.dim:
        raise ShardError(f"{node.name}: {what} along the sharded dimension")


def _slice(tracer, node, out) -> Split:
    s = out.splits[node.args[0]]
    _not_along(node, s, node.args[1] if len(node.args) > 1 else 0, "a slice")
    return s


def _select(tracer, node, out) -> Split:
    s = out.splits[node.args[0]]
    d = _norm(node.args[1], val(node.args[0]).dim())
    _not_along(node, s, d, "a select")
    return Split(s.dim - (d < s.dim), s.factor)


def _chunk(tracer, node, out) -> Split:
    s = out.splits[node.args[0]]
    dim = node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", 0)
    _not_along(node, s, dim, "a chunk/split")
    return s


def _getitem(tracer, node, out) -> Split:
    return out.splits[node.args[0]]


def _cat(tracer, node, out) -> Split:
    tensors = node.args[0]
    splits = {out.splits.get(t) for t in tensors}
    if len(splits) != 1 or None in splits:
        raise ShardError(f"{node.name}: a concatenation of sharded and replicated values")
    s = splits.pop()
    dim = node.args[1] if len(node.args) > 1 else 0
    if _norm(dim, val(node).dim()) == s.dim:
        raise ShardError(f"{node.name}: a concatenation along the sharded dimension")
    return s


def _reduction(tracer, node, out) -> Split:
    s, ndim = out.splits[node.args[0]], val(node.args[0]).dim()
    dims = node.args[1] if len(node.args) > 1 else list(range(ndim))
    dims = [_norm(d, ndim) for d in ([dims] if isinstance(dims, int) else dims)]
    keepdim = (node.args[2] if len(node.args) > 2 else node.kwargs.get("keepdim", False))
    if s.dim in dims:
        raise ShardError(f"{node.name}: a reduction across the sharded dimension (it would need a collective)")
    return s if keepdim else Split(s.dim - sum(d < s.dim for d in dims), s.factor)


def _view(tracer, node, out) -> Split:
    s = out.splits[node.args[0]]
    before, after = val(node.args[0]).shape, val(node).shape
    dim = _view_target(before, after, s, node)
    shape_arg = node.args[1]
    if isinstance(shape_arg[dim], int) and shape_arg[dim] != -1:
        out.fixes.append(LiteralFix(node.name, dim, s.factor))
    return Split(dim, s.factor)


def _view_target(before, after, s: Split, node: fx.Node) -> int:
    """The output dimension that holds ``s``'s blocks: same elements before it, same block length."""
    outer, period = math.prod(before[: s.dim]), math.prod(before[s.dim:])
    for dim, size in enumerate(after):
        if not isinstance(size, int) or size % s.factor or size == 1:
            continue
        if statically_known_true(math.prod(after[:dim]) == outer) and statically_known_true(math.prod(after[dim:]) == period):
            return dim
    raise ShardError(f"{node.name}: a reshape {list(before)} -> {list(after)} that does not keep whole blocks of "
                     f"the sharded dimension {s.dim} ({s.factor} blocks): e.g. heads not divisible by the ranks")


def _expand(tracer, node, out) -> Split:
    s = out.splits[node.args[0]]
    sizes = node.args[1]
    offset = len(sizes) - val(node.args[0]).dim()
    if isinstance(sizes[s.dim + offset], int) and sizes[s.dim + offset] != -1:
        out.fixes.append(LiteralFix(node.name, s.dim + offset, s.factor))
    return Split(s.dim + offset, s.factor)


def _row_wise(norm_dims: int):
    """RMSNorm / RoPE: computed within the last ``norm_dims`` dimensions; other tensors broadcast."""

    def rule(tracer, node, out) -> Split:
        s = out.splits[node.args[0]]
        ndim = val(node).dim()
        if s.dim >= ndim - norm_dims:
            raise ShardError(f"{node.name}: {node.target} works across the sharded dimension "
                             "(e.g. a q/k norm over all heads at once)")
        for a in node.args[1:]:
            if isinstance(a, fx.Node):
                if a in out.splits:
                    raise ShardError(f"{node.name}: a sharded weight or table")
                tracer.broadcast_operand(node, a, s, ndim, out)
        return s

    return rule


def _layer_norm(tracer, node, out) -> Split:
    return _row_wise(len(node.args[1]))(tracer, node, out)


def _attention(tracer, node, out) -> Split:
    q, k, v = node.args[:3]
    splits = [out.splits.get(t) for t in (q, k, v)]
    if any(s is None or s.dim != 2 for s in splits):
        raise ShardError(f"{node.name}: q, k and v must all be sharded along their heads")
    sinks = node.args[7] if len(node.args) > 7 else node.kwargs.get("sinks")
    if isinstance(sinks, fx.Node):
        if not is_param(sinks):
            raise ShardError(f"{node.name}: attention sinks that are not a parameter")
        out.params[str(sinks.target)] = (0, splits[0].factor)
    return splits[0]


_RULES = {
    **{op: _same for op in SAME_SPLIT_OPS},
    **{op: _elementwise for op in ELEMENTWISE_OPS},
    **{op: _view for op in _VIEWS},
    **{op: _reduction for op in _REDUCTIONS},
    aten.transpose.int: _transpose,
    aten.permute.default: _permute,
    aten.unsqueeze.default: _unsqueeze,
    aten.squeeze.dim: _squeeze,
    aten.squeeze.dims: _squeeze,
    aten.squeeze.default: _squeeze,
    aten.slice.Tensor: _slice,
    aten.select.int: _select,
    aten.chunk.default: _chunk,
    aten.split.Tensor: _chunk,
    aten.split_with_sizes.default: _chunk,
    aten.cat.default: _cat,
    aten.expand.default: _expand,
    operator.getitem: _getitem,
    aten.layer_norm.default: _layer_norm,
    AD.rms_norm.default: _row_wise(1),
    AD.rope.default: _row_wise(1),
    AD.attention.default: _attention,
}
