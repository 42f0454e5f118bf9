"""fuse_rope_qk: the q and k rotations of one attention -> ``rope_qk`` (one launch instead of two).

Pairs are found from the attention they feed: ``attention(q', k', ...)`` where q' and k' lead back
(through layout ops: transpose, view, ...) to ``rope`` nodes with the same cos, sin and layout
flag. A graph function: the replacement has two outputs. The fused node sits where the later rope
was, which is valid when nothing uses the earlier rope's output before that point.
"""

from __future__ import annotations

import operator

import torch
from torch import fx

from autodeploy.graph.meta import propagate_meta
from autodeploy.graph.rewrite import RuleResult

aten = torch.ops.aten
ROPE = torch.ops.autodeploy.rope.default
ROPE_QK = torch.ops.autodeploy.rope_qk.default
ATTENTION = torch.ops.autodeploy.attention.default
_LAYOUT = {aten.transpose.int, aten.view.default, aten.reshape.default, aten._unsafe_view.default,
           aten.unsqueeze.default, aten.squeeze.dim, aten.contiguous.default, aten.clone.default, aten.permute.default}


def _rope_source(node) -> fx.Node | None:
    while isinstance(node, fx.Node) and node.op == "call_function" and node.target in _LAYOUT:
        node = node.args[0]
    return node if isinstance(node, fx.Node) and node.target == ROPE else None


def _rope_args(node: fx.Node) -> tuple:
    x, cos, sin, *rest = node.args
    return cos, sin, bool(rest[0] if rest else node.kwargs.get("interleaved", False))


def fuse_rope_qk(gm: fx.GraphModule) -> RuleResult:
    graph, result = gm.graph, RuleResult()
    order = {n: i for i, n in enumerate(graph.nodes)}
    for attention in list(graph.find_nodes(op="call_function", target=ATTENTION)):
        q_rope, k_rope = _rope_source(attention.args[0]), _rope_source(attention.args[1])
        if q_rope is None or k_rope is None or q_rope is k_rope or _rope_args(q_rope) != _rope_args(k_rope):
            continue
        first, last = sorted((q_rope, k_rope), key=order.__getitem__)
        if any(order[user] < order[last] for user in first.users):
            result.rejected += 1
            result.reasons.append(f"{first.name}: used before {last.name}")
            continue
        with graph.inserting_before(last):
            fused = graph.call_function(ROPE_QK, (q_rope.args[0], k_rope.args[0], *_rope_args(q_rope)))
            q_out = graph.call_function(operator.getitem, (fused, 0))
            k_out = graph.call_function(operator.getitem, (fused, 1))
        propagate_meta(gm, [fused, q_out, k_out])
        for node in (fused, q_out, k_out):
            node.meta["autodeploy_provenance"] = "fuse_rope_qk"
        q_rope.replace_all_uses_with(q_out)
        k_rope.replace_all_uses_with(k_out)
        graph.erase_node(q_rope)
        graph.erase_node(k_rope)
        order = {n: i for i, n in enumerate(graph.nodes)}
        result.matches += 1
    gm.recompile()
    return result
