"""fuse_add_rms_norm: residual add + RMSNorm -> ``fused_add_rms_norm`` (one pass, two outputs).

In a pre-norm decoder ``h = residual + x`` feeds both the next norm and the next residual add, so
the add has a consumer outside any single-output pattern: this is a graph function. For each
``rms_norm(h', w, eps)`` where ``h'`` is ``h = add(a, b)`` (same shapes) seen through up-casts:

- ``fused = fused_add_rms_norm(a, b, w, eps)``; every use of ``h`` reads ``fused[1]``, the norm's
  uses read ``fused[0]``.
- The up-cast to fp32 that HF's RMSNorm starts with is dropped when every consumer of the norm
  casts it back to ``h``'s dtype (bf16/fp16 models): the kernel computes in fp32 and rounds once,
  so the values are identical and the fp32 copy of ``h`` is never written.

``fold_norm_input_casts`` applies the same cast rule to norms without an add (the first layer's
input norm). Both return how many norms they rewrote.
"""

from __future__ import annotations

import operator

import torch
from torch import fx

from autodeploy.graph.meta import propagate_meta
from autodeploy.graph.order import ancestors_after
from autodeploy.graph.rewrite import RuleResult

aten = torch.ops.aten
RMS_NORM = torch.ops.autodeploy.rms_norm.default
FUSED = torch.ops.autodeploy.fused_add_rms_norm.default
_CASTS = {aten.to.dtype, aten._to_copy.default, aten.to.dtype_layout}


def _dtype(node) -> torch.dtype | None:
    val = node.meta.get("val") if isinstance(node, fx.Node) else None
    return val.dtype if isinstance(val, torch.Tensor) else None


def _through_upcasts(node: fx.Node) -> fx.Node:
    """Follow dtype casts that never lose precision (x -> fp32, or same dtype) to their source."""
    while node.op == "call_function" and node.target in _CASTS and isinstance(node.args[0], fx.Node):
        src = node.args[0]
        if _dtype(node) not in (_dtype(src), torch.float32) or _dtype(src) not in (torch.float16, torch.bfloat16, torch.float32):
            break
        node = src
    return node


def _consumers_accept(norm: fx.Node, dtype: torch.dtype) -> bool:
    """The norm may produce ``dtype`` instead of its own: same dtype, or only cast back to it."""
    if _dtype(norm) == dtype:
        return True
    return bool(norm.users) and all(u.target in _CASTS and _dtype(u) == dtype for u in norm.users)


def _reroute_norm(norm: fx.Node, value: fx.Node) -> None:
    """Uses of ``norm`` read ``value`` (dropping casts back to value's dtype, now no-ops)."""
    if _dtype(norm) == _dtype(value):
        norm.replace_all_uses_with(value)
        return
    for cast in list(norm.users):
        cast.replace_all_uses_with(value)


def _eligible_add(node: fx.Node) -> bool:
    if node.target != aten.add.Tensor or len(node.args) != 2 or node.kwargs.get("alpha", 1) != 1:
        return False
    a, b = node.args
    return all(isinstance(t, fx.Node) and _dtype(t) is not None for t in (a, b)) and (
        a.meta["val"].shape == b.meta["val"].shape == node.meta["val"].shape
    )


def fuse_add_rms_norm(gm: fx.GraphModule) -> RuleResult:
    graph, result = gm.graph, RuleResult()
    for norm in list(graph.find_nodes(op="call_function", target=RMS_NORM)):
        x, weight, eps = norm.args
        add = _through_upcasts(x)
        if not _eligible_add(add):
            continue
        if not _consumers_accept(norm, _dtype(add)):
            result.rejected += 1
            result.reasons.append(f"{norm.name}: consumers need the norm in {_dtype(norm)}")
            continue
        with graph.inserting_after(norm):
            fused = graph.call_function(FUSED, (*add.args, weight, eps))
        with graph.inserting_after(fused):
            normed = graph.call_function(operator.getitem, (fused, 0))
            summed = graph.call_function(operator.getitem, (fused, 1))
        _move_before_users(graph, add, [fused, normed, summed])
        propagate_meta(gm, [fused, normed, summed])
        for node in (fused, normed, summed):
            node.meta["autodeploy_provenance"] = "fuse_add_rms_norm"
        _reroute_norm(norm, normed)
        add.replace_all_uses_with(summed)
        result.matches += 1
    graph.eliminate_dead_code()
    gm.recompile()
    return result


def _move_before_users(graph: fx.Graph, add: fx.Node, nodes: list[fx.Node]) -> None:
    """Place the fused nodes right after the add, so every former user of the add comes later.

    Inputs of the fused op computed between the add and the norm (Gemma's ``1 + w`` norm weight)
    move up with their own inputs; they never depend on the add, which only the norm reads.
    """
    late = ancestors_after(nodes[0].all_input_nodes, add)
    anchor = add
    for node in late + nodes:
        anchor.append(node)
        anchor = node


def fold_norm_input_casts(gm: fx.GraphModule) -> RuleResult:
    graph, result = gm.graph, RuleResult()
    for norm in list(graph.find_nodes(op="call_function", target=RMS_NORM)):
        x, weight, eps = norm.args
        source = _through_upcasts(x)
        if source is x or _dtype(source) == _dtype(x) or not _consumers_accept(norm, _dtype(source)):
            continue
        with graph.inserting_after(norm):
            folded = graph.call_function(RMS_NORM, (source, weight, eps))
        propagate_meta(gm, [folded])
        folded.meta["autodeploy_provenance"] = "fold_norm_input_casts"
        _reroute_norm(norm, folded)
        result.matches += 1
    graph.eliminate_dead_code()
    gm.recompile()
    return result
