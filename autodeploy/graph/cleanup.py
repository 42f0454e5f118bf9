"""Graph normalisation shared by model graphs and pattern graphs.

Removes what export leaves behind that carries no computation (tensor-metadata asserts, symbolic
range constraints, inference-mode dropout), turns in-place arithmetic that nobody else can observe
into its out-of-place op (``scores /= d`` and ``scores = scores / d`` are then one spelling for the
matcher), then removes dead code.
"""

from __future__ import annotations

import torch
from torch import fx

aten = torch.ops.aten

_ASSERT_TARGETS = {
    aten._assert_tensor_metadata.default,
    aten._assert_scalar.default,
    aten.sym_constrain_range.default,
    aten.sym_constrain_range_for_size.default,
    aten._assert_async.msg,
}


# in-place arithmetic -> the out-of-place op computing the same value
_INPLACE_ARITHMETIC = {
    aten.add_.Tensor: aten.add.Tensor,
    aten.add_.Scalar: aten.add.Scalar,
    aten.sub_.Tensor: aten.sub.Tensor,
    aten.sub_.Scalar: aten.sub.Scalar,
    aten.mul_.Tensor: aten.mul.Tensor,
    aten.mul_.Scalar: aten.mul.Scalar,
    aten.div_.Tensor: aten.div.Tensor,
    aten.div_.Scalar: aten.div.Scalar,
}


def _mutation_is_private(node: fx.Node) -> bool:
    """True when the tensor ``node`` mutates is read by nothing else, so the mutation is unobservable:
    an intermediate (not an input or weight), not a view (its base would change too), used only by
    ``node``, and the out-of-place op keeps its dtype (in-place ops never promote)."""
    target = node.args[0]
    if not isinstance(target, fx.Node) or target.op != "call_function" or len(target.users) != 1:
        return False
    schema = getattr(target.target, "_schema", None)
    if schema is None or any(ret.alias_info is not None for ret in schema.returns):
        return False
    dtype = target.meta.get("val").dtype if isinstance(target.meta.get("val"), torch.Tensor) else None
    others = [a for a in node.args[1:] if isinstance(a, fx.Node)]
    return dtype is not None and all(getattr(o.meta.get("val"), "dtype", None) == dtype for o in others)


def _is_noop_dropout(node: fx.Node) -> bool:
    if node.target not in (aten.dropout.default,):
        return False
    p = node.args[1] if len(node.args) > 1 else node.kwargs.get("p", 0.0)
    train = node.args[2] if len(node.args) > 2 else node.kwargs.get("train", False)
    return p == 0.0 or not train


def cleanup_graph(gm: fx.GraphModule) -> fx.GraphModule:
    """Drop asserts and no-op dropouts, make private in-place arithmetic out-of-place, eliminate dead
    code, lint and recompile."""
    graph = gm.graph
    for node in list(graph.nodes):
        if node.op != "call_function":
            continue
        if node.target in _ASSERT_TARGETS:
            graph.erase_node(node)
        elif _is_noop_dropout(node):
            node.replace_all_uses_with(node.args[0])
            graph.erase_node(node)
        elif node.target in _INPLACE_ARITHMETIC and _mutation_is_private(node):
            node.target = _INPLACE_ARITHMETIC[node.target]
    eliminate_dead_code(gm)
    return gm


def eliminate_dead_code(gm: fx.GraphModule) -> None:
    gm.graph.eliminate_dead_code()
    gm.graph.lint()
    gm.recompile()
