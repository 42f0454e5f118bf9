"""Graph normalisation shared by model graphs and pattern graphs.

Removes what export leaves behind that carries no computation (tensor-metadata asserts, symbolic
range constraints, inference-mode dropout, full slices, ``* 1`` / ``+ 0``), then dead code. Such
no-ops sit between the ops of otherwise matching patterns (``x[:, :, None, :, :]`` exports as
unsqueeze + a full slice with some torch versions).
"""

from __future__ import annotations

import sys

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


def _is_noop_slice(node: fx.Node) -> bool:
    """``x[..., 0:]`` (start 0, end past the end, step 1): the identity."""
    if node.target != aten.slice.Tensor:
        return False
    defaults = [None, 0, None, None, 1]  # self, dim, start, end, step
    _, _dim, start, end, step = list(node.args) + defaults[len(node.args) :]
    return start in (0, None) and (end is None or (isinstance(end, int) and end >= sys.maxsize)) and step == 1


def _is_noop_arith(node: fx.Node) -> bool:
    """``x * 1`` or ``x + 0`` that keeps x's dtype (e.g. RoPE's attention_scaling of 1.0)."""
    identity = {aten.mul.Tensor: 1, aten.add.Tensor: 0}.get(node.target)
    if identity is None or len(node.args) != 2 or node.kwargs:
        return False
    x, other = node.args
    if isinstance(other, bool) or not isinstance(other, (int, float)) or other != identity:
        return False
    x_val, out_val = getattr(x, "meta", {}).get("val"), node.meta.get("val")
    return isinstance(x_val, torch.Tensor) and isinstance(out_val, torch.Tensor) and x_val.dtype == out_val.dtype


def cleanup_graph(gm: fx.GraphModule) -> fx.GraphModule:
    """Drop asserts, no-op dropouts/slices/arithmetic, eliminate dead code, lint and recompile."""
    graph = gm.graph
    for node in list(graph.nodes):
        if node.op != "call_function":
            continue
        if node.target in _ASSERT_TARGETS:
            graph.erase_node(node)
        elif _is_noop_dropout(node) or _is_noop_slice(node) or _is_noop_arith(node):
            node.replace_all_uses_with(node.args[0])
            graph.erase_node(node)
    eliminate_dead_code(gm)
    return gm


def eliminate_dead_code(gm: fx.GraphModule) -> None:
    gm.graph.eliminate_dead_code()
    gm.graph.lint()
    gm.recompile()
