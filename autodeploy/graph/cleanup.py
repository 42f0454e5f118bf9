"""Graph normalisation shared by model graphs and pattern graphs.

Removes what export leaves behind that carries no computation (tensor-metadata asserts, symbolic
range constraints, inference-mode dropout, full slices, ``* 1`` / ``+ 0``, ``detach``), turns in-place
arithmetic that nobody else can observe into its out-of-place op (``scores /= d`` and
``scores = scores / d`` are then one spelling for the matcher), then removes dead code. Such no-ops
sit between the ops of otherwise matching patterns (``x[:, :, None, :, :]`` exports as unsqueeze +
a full slice with some torch versions).
"""

from __future__ import annotations

import operator
import sys

import torch
from torch import fx

from .slice_fill import fold_slice_fills

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


# autograd bookkeeping only: the value is its input's. An unused in-place ``detach_`` (HF models'
# ``torch.tensor(...)`` in forward exports as lift_fresh_copy + detach_) would otherwise keep a copy
# of a constant alive in every step: FX never removes an in-place op as dead code.
_DETACH = {aten.detach.default, aten.detach_.default}


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


def _is_whole_first_split(node: fx.Node) -> bool:
    """``x.tensor_split([n], dim)[0]`` with n the size of dim (transformers 5.25's Mamba-2 mixers cut
    their inputs at the token count): the identity."""
    if node.target is not operator.getitem or node.args[1] != 0:
        return False
    split = node.args[0]
    if not isinstance(split, fx.Node) or split.target != aten.tensor_split.indices or len(split.args) < 2:
        return False
    x, indices = split.args[0], split.args[1]
    dim = split.args[2] if len(split.args) > 2 else split.kwargs.get("dim", 0)
    x_val = getattr(x, "meta", {}).get("val")
    if not isinstance(x_val, torch.Tensor) or len(indices) != 1:
        return False
    index = indices[0].meta.get("val") if isinstance(indices[0], fx.Node) else indices[0]
    return str(index) == str(x_val.shape[dim])  # the same symbol (or number): the same size


def cleanup_graph(gm: fx.GraphModule) -> fx.GraphModule:
    """Drop asserts, detaches and no-op dropouts/slices/splits/arithmetic, make private in-place arithmetic
    out-of-place, fold tensors filled slice by slice into ``cat`` (``slice_fill``), eliminate dead
    code, lint and recompile."""
    graph = gm.graph
    for node in list(graph.nodes):
        if node.op != "call_function":
            continue
        if node.target in _ASSERT_TARGETS:
            graph.erase_node(node)
        elif _is_whole_first_split(node):
            node.replace_all_uses_with(node.args[0].args[0])
            graph.erase_node(node)
        elif node.target in _DETACH or _is_noop_dropout(node) or _is_noop_slice(node) or _is_noop_arith(node):
            node.replace_all_uses_with(node.args[0])
            graph.erase_node(node)
        elif node.target in _INPLACE_ARITHMETIC and _mutation_is_private(node):
            node.target = _INPLACE_ARITHMETIC[node.target]
    fold_slice_fills(gm)
    eliminate_dead_code(gm)
    return gm


def eliminate_dead_code(gm: fx.GraphModule) -> None:
    gm.graph.eliminate_dead_code()
    gm.graph.lint()
    gm.recompile()
