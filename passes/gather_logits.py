"""gather_logits: run the LM head on one row per sequence (``logits_indices``), not on all T tokens.

Walks back from the graph output through row-wise ops (casts, final-logit softcapping and scaling,
dropping the batch dim) to the LM-head linear and gathers its input rows.
"""

from __future__ import annotations

import torch
from torch import fx

from autodeploy.graph.meta import add_graph_input, propagate_meta
from autodeploy.pipeline.base import CompileContext, Pass, PassResult, Stage

aten = torch.ops.aten

_ROW_WISE = {
    aten.to.dtype, aten._to_copy.default, aten.to.dtype_layout, aten.mul.Tensor, aten.div.Tensor,
    aten.tanh.default, aten.add.Tensor, aten.sub.Tensor, aten.select.int,
}
_LM_HEAD = {aten.linear.default, aten.matmul.default, aten.mm.default}


def find_lm_head(gm: fx.GraphModule) -> fx.Node:
    node = gm.graph.output_node().args[0]
    while isinstance(node, fx.Node) and node.op == "call_function" and node.target not in _LM_HEAD:
        if node.target not in _ROW_WISE:
            raise RuntimeError(f"cannot find the LM head: the output is computed by {node.target} ({node.name})")
        node = node.args[0]
    if not isinstance(node, fx.Node) or node.target not in _LM_HEAD:
        raise RuntimeError("cannot find the LM head linear feeding the graph output")
    return node


class GatherLogits(Pass):
    name = "gather_logits"
    stage = Stage.CANONICALIZE
    ensures = ("logits_gathered",)

    def apply(self, ctx: CompileContext) -> PassResult:
        head = find_lm_head(ctx.gm)
        hidden = head.args[0]
        token_dim = hidden.meta["val"].dim() - 2  # [..., T, H]
        indices = add_graph_input(ctx.gm, "logits_indices", torch.zeros(2, dtype=torch.int64))
        with ctx.gm.graph.inserting_before(head):
            gathered = ctx.gm.graph.call_function(aten.index_select.default, (hidden, token_dim, indices))
        gathered.meta["autodeploy_provenance"] = self.name
        head.replace_input_with(hidden, gathered)
        propagate_meta(ctx.gm, [gathered, head, *_downstream(head)])
        ctx.gm.recompile()
        return PassResult(1, f"lm_head={head.name}")


def _downstream(node: fx.Node) -> list[fx.Node]:
    order = {n: i for i, n in enumerate(node.graph.nodes)}
    seen, stack = set(), list(node.users)
    while stack:
        cur = stack.pop()
        if cur not in seen and cur.op == "call_function":
            seen.add(cur)
            stack.extend(cur.users)
    return sorted(seen, key=order.__getitem__)
