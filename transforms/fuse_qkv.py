"""fuse_qkv: sibling linears that read the same input (q/k/v projections) -> one GEMM + slices.

``linear(x, Wq, bq)``, ``linear(x, Wk, bk)``, ``linear(x, Wv, bv)`` become ``y = linear(x, W, b)`` with
``W = cat(Wq, Wk, Wv)`` (and b likewise) and each old output a slice of y's last dim: one weight
stream and one launch instead of three. A *structural* fusion (a set of siblings, which a
single-output pattern cannot express), so it is a graph function rather than a pattern rule.

Only plain weights are fused: each must be a parameter read once (not tied, not already claimed by
a sharding/quantization hook: ``can_fuse``); all linears of a group have a bias or none does.
The stacked parameters are returned so that the pass can register their load hooks.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Callable

import torch
from torch import fx

from autodeploy.graph.meta import propagate_meta
from autodeploy.graph.params import FusedParameter, remove_parameter, sole_parameter, stack_parameters
from autodeploy.graph.rewrite import RuleResult

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
    new_nodes, last_dim = [fused], first.meta["val"].dim() - 1
    for node, (_, start, end) in zip(group, w_info.pieces):
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
    readers = [a for n in group for a in n.args[1:3] if isinstance(a, fx.Node)]
    for node in group:
        graph.erase_node(node)
    for reader in readers:
        name = str(reader.target)
        graph.erase_node(reader)
        remove_parameter(gm, name)
    return infos
