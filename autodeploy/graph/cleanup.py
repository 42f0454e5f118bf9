"""Graph normalisation shared by model graphs and pattern graphs.

Removes what export leaves behind that carries no computation (tensor-metadata asserts, symbolic
range constraints, inference-mode dropout), then dead code.
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


def _is_noop_dropout(node: fx.Node) -> bool:
    if node.target not in (aten.dropout.default,):
        return False
    p = node.args[1] if len(node.args) > 1 else node.kwargs.get("p", 0.0)
    train = node.args[2] if len(node.args) > 2 else node.kwargs.get("train", False)
    return p == 0.0 or not train


def cleanup_graph(gm: fx.GraphModule) -> fx.GraphModule:
    """Drop asserts and no-op dropouts, eliminate dead code, lint and recompile."""
    graph = gm.graph
    for node in list(graph.nodes):
        if node.op != "call_function":
            continue
        if node.target in _ASSERT_TARGETS:
            graph.erase_node(node)
        elif _is_noop_dropout(node):
            node.replace_all_uses_with(node.args[0])
            graph.erase_node(node)
    eliminate_dead_code(gm)
    return gm


def eliminate_dead_code(gm: fx.GraphModule) -> None:
    gm.graph.eliminate_dead_code()
    gm.graph.lint()
    gm.recompile()
