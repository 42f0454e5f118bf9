"""fuse_gate_up: ``swiglu(x, W_gate, W_up, W_down)`` -> ``swiglu_down(linear(x, cat(W_gate, W_up)), W_down)``.

One GEMM for gate and up, then ``swiglu_down``: ``act(gate) * up`` over the two halves of its output
and the down projection (on CUDA one Triton activation pass and a GEMM, or one fused GEMV for a few
rows). The gate/up GEMM is a plain linear, so ``fuse_norm_linear`` can fold the norm before it.
Gated MLPs whose checkpoint already stacks gate/up (Phi-3: the canonical op reads two row slices of
one parameter) use that parameter directly. Otherwise both weights must be
parameters read once (``can_fuse`` as in fuse_qkv); the stacked parameters are returned for the
pass to register load hooks. A graph function (it creates parameters), like fuse_qkv.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import fx

from autodeploy.graph.meta import propagate_meta
from autodeploy.graph.params import FusedParameter, remove_parameter, sole_parameter, stack_parameters
from autodeploy.graph.rewrite import RuleResult

aten = torch.ops.aten
SWIGLU = torch.ops.autodeploy.swiglu.default
SWIGLU_DOWN = torch.ops.autodeploy.swiglu_down.default


def fuse_gate_up(
    gm: fx.GraphModule, can_fuse: Callable[[str], bool] = lambda name: True
) -> tuple[RuleResult, list[FusedParameter]]:
    result, fused = RuleResult(), []
    for node in list(gm.graph.find_nodes(op="call_function", target=SWIGLU)):
        x, w_gate, w_up, w_down, *rest = node.args
        stacked = halves_of_one_weight(w_gate, w_up)
        if stacked is None:
            names = [sole_parameter(w_gate), sole_parameter(w_up)]
            if any(n is None or not can_fuse(n) for n in names) or not _stackable(w_gate, w_up):
                result.rejected += 1
                result.reasons.append(f"{node.name}: gate/up weights are not plain parameters read once")
                continue
            stacked, info = stack_parameters(gm, [w_gate, w_up], before=node)
            fused.append(info)
        _replace(gm, node, (x, stacked, w_down, *rest))
        result.matches += 1
    gm.graph.eliminate_dead_code()
    for info in fused:
        for name, _, _ in info.pieces:
            remove_parameter(gm, name)
    gm.recompile()
    return result, fused


def _stackable(w_gate: fx.Node, w_up: fx.Node) -> bool:
    a, b = w_gate.meta["val"], w_up.meta["val"]
    return a.dim() == 2 and a.shape == b.shape and a.dtype == b.dtype


def halves_of_one_weight(w_gate, w_up) -> fx.Node | None:
    """W if gate/up are rows [0, I) and [I, 2I) of one 2-d tensor W with 2I rows."""
    if not all(isinstance(w, fx.Node) and w.target == aten.slice.Tensor for w in (w_gate, w_up)):
        return None
    (src, dim_g, start_g, end_g, step_g), (src_u, dim_u, start_u, end_u, step_u) = map(_slice_args, (w_gate, w_up))
    if src is not src_u or not isinstance(src, fx.Node) or src.meta["val"].dim() != 2:
        return None
    rows = src.meta["val"].shape[0]
    inter = rows // 2
    halves = (dim_g, start_g, end_g, dim_u, start_u, step_g, step_u) == (0, 0, inter, 0, inter, 1, 1)
    return src if halves and 2 * inter == rows and (end_u is None or end_u >= rows) else None


def _slice_args(node: fx.Node) -> tuple:
    """(input, dim, start, end, step) of an aten.slice.Tensor node, defaults filled in."""
    args = list(node.args) + [None] * (5 - len(node.args))
    src, dim, start, end, step = args[:5]
    return src, dim or 0, start or 0, end, 1 if step is None else step


def _replace(gm: fx.GraphModule, node: fx.Node, args: tuple) -> None:
    x, w_gate_up, w_down, *activation = args
    with gm.graph.inserting_before(node):
        gate_up = gm.graph.call_function(aten.linear.default, (x, w_gate_up))
        down = gm.graph.call_function(SWIGLU_DOWN, (gate_up, w_down, *activation))
    for new in (gate_up, down):
        new.meta["autodeploy_provenance"] = "fuse_gate_up"
    propagate_meta(gm, [gate_up, down])
    node.replace_all_uses_with(down)
    gm.graph.erase_node(node)
