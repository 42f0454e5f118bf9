"""fuse_qkv: sibling linears that read the same input (q/k/v projections) -> one GEMM + slices.

``linear(x, Wq, bq)``, ``linear(x, Wk, bk)``, ``linear(x, Wv, bv)`` become ``y = linear(x, W, b)`` with
``W = cat(Wq, Wk, Wv)`` (and b likewise) and each old output a slice of y's last dim: one weight
stream and one launch instead of three. A *structural* fusion (a set of siblings, which a
single-output pattern cannot express), so it is a graph function rather than a pattern rule.

Only plain weights are fused: each must be a parameter read once (not tied, not already claimed by
a sharding/quantization hook: ``can_fuse``); all linears of a group have a bias or none does.
The stacked parameters are returned so that the pass can register their load hooks.
``fuse_sibling_quant_linears`` does the same for quantized linears of one format (their scales
stacked as ``autodeploy.quantization.graph`` describes).
"""

from __future__ import annotations

from collections import defaultdict
from typing import Callable

import torch
from torch import fx

from autodeploy.graph.meta import propagate_meta
from autodeploy.graph.params import FusedParameter, remove_parameter, sole_parameter, stack_parameters
from autodeploy.graph.rewrite import RuleResult
from autodeploy.quantization.graph import (
    StackedQuantLinear,
    can_stack,
    quant_linear_args,
    quant_linear_of,
    remove_params,
    stack_quant_linears,
)
from autodeploy.quantization.params import FP8_LINEAR, NVFP4_LINEAR, QuantLinear

aten = torch.ops.aten
_VIEWS = {aten.view.default, aten._unsafe_view.default}


def fuse_sibling_linears(
    gm: fx.GraphModule, can_fuse: Callable[[str], bool] = lambda name: True
) -> tuple[RuleResult, list[FusedParameter]]:
    """Fuse every group of >= 2 eligible linears sharing one input; returns (result, stacked params)."""
    groups: dict[tuple, list[fx.Node]] = defaultdict(list)
    for node in gm.graph.find_nodes(op="call_function", target=aten.linear.default):
        key = _group_key(node, can_fuse)
        if key is not None:
            groups[key].append(node)
    result, fused = RuleResult(), []
    for group in groups.values():
        if len(group) >= 2:
            fused.extend(_fuse(gm, group))
            result.matches += 1
    gm.graph.eliminate_dead_code()
    gm.recompile()
    return result, fused


def _group_key(node: fx.Node, can_fuse: Callable[[str], bool]) -> tuple | None:
    x, weight, bias = (list(node.args) + [None])[:3]
    params = [sole_parameter(weight)] + ([sole_parameter(bias)] if bias is not None else [])
    if any(p is None or not can_fuse(p) for p in params) or weight.meta["val"].dim() != 2:
        return None
    return x, bias is not None, weight.meta["val"].dtype


def _fuse(gm: fx.GraphModule, group: list[fx.Node]) -> list[FusedParameter]:
    graph, first = gm.graph, group[0]
    weight, w_info = stack_parameters(gm, [n.args[1] for n in group], before=first)
    args, infos = [first.args[0], weight], [w_info]
    if len(first.args) > 2 and first.args[2] is not None:
        bias, b_info = stack_parameters(gm, [n.args[2] for n in group], before=first)
        args.append(bias)
        infos.append(b_info)
    with graph.inserting_before(first):
        fused = graph.call_function(aten.linear.default, tuple(args))
    readers = [a for n in group for a in n.args[1:3] if isinstance(a, fx.Node)]
    _replace_by_slices(gm, group, fused, [(start, end) for _, start, end in w_info.pieces], readers)
    return infos


def _replace_by_slices(gm: fx.GraphModule, group: list[fx.Node], fused: fx.Node, rows: list[tuple[int, int]],
                       readers: list[fx.Node]) -> None:
    """Each node of ``group`` -> its ``rows`` of ``fused``'s last dim; the parameters that
    ``readers`` (get_attr nodes) read are deleted."""
    graph, first = gm.graph, group[0]
    new_nodes, last_dim = [fused], first.meta["val"].dim() - 1
    for node, (start, end) in zip(group, rows):
        with graph.inserting_before(first):
            piece = graph.call_function(aten.slice.Tensor, (fused, last_dim, start, end))
        new_nodes.append(piece)
        node.replace_all_uses_with(piece)
        for user in piece.users:
            if user.target in _VIEWS:  # a slice of the last dim is not contiguous: reshape views when it can
                user.target = aten.reshape.default
    for node in new_nodes:
        node.meta["autodeploy_provenance"] = "fuse_qkv"
    propagate_meta(gm, new_nodes)
    for node in group:
        graph.erase_node(node)
    for reader in readers:
        if not reader.users:
            name = str(reader.target)
            graph.erase_node(reader)
            remove_parameter(gm, name)


def fuse_sibling_quant_linears(gm: fx.GraphModule) -> tuple[RuleResult, list[StackedQuantLinear], list[FusedParameter]]:
    """The same for quantized linears (``fp8_linear`` / ``nvfp4_linear`` of one format): their
    weights and scales stack as ``autodeploy.quantization.graph`` says. Returns the stacked
    quantized linears (for the pass to redirect their load hooks) and stacked biases."""
    groups: dict[tuple, list[tuple[fx.Node, QuantLinear]]] = defaultdict(list)
    for node in gm.graph.find_nodes(op="call_function", target=FP8_LINEAR) + gm.graph.find_nodes(
            op="call_function", target=NVFP4_LINEAR):
        linear, bias = quant_linear_of(node), _quant_bias(node)
        params = [a for a in node.args[1:] if isinstance(a, fx.Node)]
        if linear is not None and all(sole_parameter(p) is not None for p in params):
            groups[(node.args[0], node.target, linear.fmt, bias is not None)].append((node, linear))
    result, stacked, biases = RuleResult(), [], []
    for group in groups.values():
        parts = [linear for _, linear in group]
        if len(group) >= 2 and can_stack(parts):
            fused, bias_info = _fuse_quant(gm, [node for node, _ in group], parts)
            stacked.append(StackedQuantLinear(fused, tuple(parts)))
            biases.extend(bias_info)
            result.matches += 1
    gm.graph.eliminate_dead_code()
    remove_params(gm, [part for s in stacked for part in s.parts])
    gm.recompile()
    return result, stacked, biases


def _quant_bias(node: fx.Node):
    return node.args[4]  # fp8_linear(x, w, scale, input_scale, bias, ...), nvfp4_linear(x, w, scale, scale_2, bias)


def _fuse_quant(gm: fx.GraphModule, group: list[fx.Node], parts: list[QuantLinear]):
    first = group[0]
    fused = stack_quant_linears(gm, parts)
    bias, infos = None, []
    if _quant_bias(first) is not None:
        bias, info = stack_parameters(gm, [_quant_bias(n) for n in group], before=first)
        infos.append(info)
    target, args = quant_linear_args(gm, fused, first.args[0], bias, before=first)
    with gm.graph.inserting_before(first):
        node = gm.graph.call_function(target, args)
    rows, start = [], 0
    for part in parts:
        rows.append((start, start + part.out_features))
        start += part.out_features
    readers = [_quant_bias(n) for n in group if isinstance(_quant_bias(n), fx.Node)]
    _replace_by_slices(gm, group, node, rows, readers)
    return fused, infos
