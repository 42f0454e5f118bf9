"""gather_logits: run the LM head on one row per sequence (``logits_indices``), not on all T tokens.

Walks back from the graph output through row-wise ops (casts, final-logit softcapping and scaling,
dropping the batch dim) to the LM-head linear and gathers its input rows. The gather then moves up
through the row-wise ops before the LM head (the final norm, the last residual add, casts) while it
is their only consumer (``hoist``): those ops then run on the gathered rows only, and the final norm
sits right before the LM head, where ``fuse_add_rms_norm`` and ``fuse_norm_linear`` fold it into the
LM head's GEMM (in a one-row decode step, one GEMV kernel instead of a norm kernel, a gather kernel
and the GEMM).

The gather is :func:`gather_rows`: in a step where every token's logits are wanted (every decode
step) it is the identity and launches nothing.
"""

from __future__ import annotations

import torch
from torch import fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

from autodeploy.graph.meta import add_graph_input, propagate_meta
from autodeploy.pipeline.base import CompileContext, Pass, PassConfig, PassResult, Stage

aten = torch.ops.aten

_ROW_WISE = {
    aten.to.dtype, aten._to_copy.default, aten.to.dtype_layout, aten.mul.Tensor, aten.div.Tensor,
    aten.tanh.default, aten.add.Tensor, aten.sub.Tensor, aten.select.int,
}
_LM_HEAD = {aten.linear.default, aten.matmul.default, aten.mm.default}
# ops above the LM head that the gather may move through: each output row is computed from the same
# row of its token-shaped inputs (the norm's weight and scalar operands broadcast)
_HOISTABLE = {
    aten.to.dtype, aten._to_copy.default, aten.to.dtype_layout, aten.add.Tensor, aten.sub.Tensor,
    aten.mul.Tensor, aten.div.Tensor, torch.ops.autodeploy.rms_norm.default,
}


def gather_rows(hidden: torch.Tensor, dim: int, indices: torch.Tensor) -> torch.Tensor:
    """``hidden.index_select(dim, indices)``, or ``hidden`` itself when there are as many indices as rows.

    As many logits rows as tokens means each chunk asked for all of its tokens' logits, so the
    indices are ``0 .. T-1`` in order (``kvcache/metadata.py``); or the step is a CUDA-graph decode
    step padded to its captured size, whose real rows are ``0 .. B-1`` and whose padding rows are
    discarded. Under fake tensors (symbolic T) the sizes are not known to match: the gather's shape.
    """
    if statically_known_true(indices.shape[0] == hidden.shape[dim]):
        return hidden
    return hidden.index_select(dim, indices)


def find_lm_head(gm: fx.GraphModule) -> fx.Node:
    node = gm.graph.output_node().args[0]
    while isinstance(node, fx.Node) and node.op == "call_function" and node.target not in _LM_HEAD:
        if node.target not in _ROW_WISE:
            raise RuntimeError(f"cannot find the LM head: the output is computed by {node.target} ({node.name})")
        node = node.args[0]
    if not isinstance(node, fx.Node) or node.target not in _LM_HEAD:
        raise RuntimeError("cannot find the LM head linear feeding the graph output")
    return node


class GatherLogitsConfig(PassConfig):
    hoist: bool = True  # move the gather above the final norm and residual add (module docstring)


class GatherLogits(Pass):
    name = "gather_logits"
    stage = Stage.CANONICALIZE
    ensures = ("logits_gathered",)
    Config = GatherLogitsConfig

    def apply(self, ctx: CompileContext) -> PassResult:
        gm = ctx.gm
        head = find_lm_head(gm)
        hidden = head.args[0]
        token_dim = hidden.meta["val"].dim() - 2  # [..., T, H]
        indices = add_graph_input(gm, "logits_indices", torch.zeros(2, dtype=torch.int64))
        with gm.graph.inserting_before(head):
            gathered = gm.graph.call_function(gather_rows, (hidden, token_dim, indices))
        gathered.meta["autodeploy_provenance"] = self.name
        head.replace_input_with(hidden, gathered)
        propagate_meta(gm, [gathered, head, *_downstream(head)])
        gathers = hoist_gathers(gm, [gathered]) if self.config.hoist else [gathered]
        gm.graph.eliminate_dead_code()
        gm.recompile()
        sources = ", ".join(g.args[0].name for g in gathers)
        return PassResult(1, f"lm_head={head.name}, rows gathered from {sources}")


def hoist_gathers(gm: fx.GraphModule, gathers: list[fx.Node]) -> list[fx.Node]:
    """Move each gather above its source while the source is row-wise and read by the gather alone;
    returns the gathers left (one per token-shaped input reached)."""
    done, todo = [], list(gathers)
    while todo:
        gather = todo.pop()
        source = gather.args[0]
        if source.op != "call_function" or source.target not in _HOISTABLE or len(source.users) != 1:
            done.append(gather)
            continue
        todo.extend(_gather_inputs_of(gm, gather, source))
    return done


def _gather_inputs_of(gm: fx.GraphModule, gather: fx.Node, source: fx.Node) -> list[fx.Node]:
    """Replace ``gather(source(inputs))`` with ``source(gather(inputs))``; returns the new gathers."""
    _, dim, indices = gather.args
    graph, new_gathers, by_input = gm.graph, [], {}

    def gathered(arg):
        if not (isinstance(arg, fx.Node) and _has_token_rows(arg, dim, source)):
            return arg
        if arg not in by_input:
            with graph.inserting_before(source):
                by_input[arg] = graph.call_function(gather_rows, (arg, dim, indices))
            by_input[arg].meta["autodeploy_provenance"] = gather.meta.get("autodeploy_provenance")
            new_gathers.append(by_input[arg])
        return by_input[arg]

    args = tuple(gathered(a) for a in source.args)
    kwargs = {k: gathered(v) for k, v in source.kwargs.items()}
    with graph.inserting_before(source):
        moved = graph.call_function(source.target, args, kwargs)
    moved.meta.update({k: v for k, v in source.meta.items() if k != "val"})
    propagate_meta(gm, [*new_gathers, moved])
    gather.replace_all_uses_with(moved)
    graph.erase_node(gather)
    graph.erase_node(source)
    return new_gathers


def _has_token_rows(arg: fx.Node, dim: int, source: fx.Node) -> bool:
    """Whether ``arg`` has the source's rows along ``dim`` (not a broadcast weight or scalar tensor);
    sizes compare by their text, so a symbolic token count matches itself without a guard."""
    val, out = arg.meta.get("val"), source.meta["val"]
    same_rows = isinstance(val, torch.Tensor) and val.dim() == out.dim()
    return same_rows and str(val.shape[dim]) == str(out.shape[dim])


def _downstream(node: fx.Node) -> list[fx.Node]:
    order = {n: i for i, n in enumerate(node.graph.nodes)}
    seen, stack = set(), list(node.users)
    while stack:
        cur = stack.pop()
        if cur not in seen and cur.op == "call_function":
            seen.add(cur)
            stack.extend(cur.users)
    return sorted(seen, key=order.__getitem__)
