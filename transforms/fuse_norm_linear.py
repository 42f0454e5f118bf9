"""fuse_norm_linear: an RMSNorm read only by one linear layer -> one op.

- ``linear(rms_norm(x, w, eps), W, b)`` -> ``rms_norm_linear(x, w, eps, W, b)``;
- ``linear(fused_add_rms_norm(x, r, w, eps)[0], W, b)`` -> ``add_rms_norm_linear(x, r, w, eps, W, b)``,
  whose second output (``x + r``) takes over the uses of ``fused_add_rms_norm(...)[1]``;
- the same for ``fp8_linear`` / ``nvfp4_linear`` -> ``fp8_rms_norm_linear`` / ``fp8_add_rms_norm_linear``
  (nvfp4 likewise), their scales moving up with the weight.

In a pre-norm decoder, after ``fuse_qkv`` and ``fuse_gate_up``, that is every norm before the q/k/v
GEMM and before the gate/up GEMM. A decode step of a few tokens then runs each of them as one GEMV
that normalises its operand as it loads it (``ops/fused_linear.py``). The fused op takes the norm's
place; the linear's weight and bias (parameters, usually placed just before the linear) move up to
it. Rejected, with a reason: a norm whose output has another consumer (it must be written anyway),
a linear whose weight is not 2-d or not of the norm's dtype, or whose weight is computed from the
norm. A graph function: the fused norm has two outputs.
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
ADD_RMS_NORM = torch.ops.autodeploy.fused_add_rms_norm.default
RMS_NORM_LINEAR = torch.ops.autodeploy.rms_norm_linear.default
ADD_RMS_NORM_LINEAR = torch.ops.autodeploy.add_rms_norm_linear.default
# linear op -> (its rms_norm variant, its add + rms_norm variant); each takes (x, <norm args>, <linear args after x>)
FUSED_VARIANTS = {
    aten.linear.default: (RMS_NORM_LINEAR, ADD_RMS_NORM_LINEAR),
    torch.ops.autodeploy.fp8_linear.default: (torch.ops.autodeploy.fp8_rms_norm_linear.default,
                                              torch.ops.autodeploy.fp8_add_rms_norm_linear.default),
    torch.ops.autodeploy.nvfp4_linear.default: (torch.ops.autodeploy.nvfp4_rms_norm_linear.default,
                                                torch.ops.autodeploy.nvfp4_add_rms_norm_linear.default),
}


def fuse_norm_linear(gm: fx.GraphModule) -> RuleResult:
    graph, result = gm.graph, RuleResult()
    for norm in list(graph.find_nodes(op="call_function", target=RMS_NORM)):
        if (why := _fuse(gm, norm, norm, None)) is not None:
            _reject(result, norm, why)
        else:
            result.matches += 1
    for fused in list(graph.find_nodes(op="call_function", target=ADD_RMS_NORM)):
        normed, summed = _outputs(fused)
        if normed is None:
            continue
        if (why := _fuse(gm, fused, normed, summed)) is not None:
            _reject(result, fused, why)
        else:
            result.matches += 1
    graph.eliminate_dead_code()
    gm.recompile()
    return result


def _reject(result: RuleResult, norm: fx.Node, why: str) -> None:
    result.rejected += 1
    result.reasons.append(f"{norm.name}: {why}")


def _outputs(fused: fx.Node) -> tuple[fx.Node | None, fx.Node | None]:
    """The getitem nodes reading outputs 0 (the norm) and 1 (the sum) of a fused_add_rms_norm."""
    picked = {u.args[1]: u for u in fused.users if u.target is operator.getitem}
    return picked.get(0), picked.get(1)


def _fuse(gm: fx.GraphModule, norm: fx.Node, normed: fx.Node, summed: fx.Node | None) -> str | None:
    """Replace ``norm`` and the linear reading ``normed``; returns why not, or None when done."""
    linear = _sole_linear_consumer(normed)
    if linear is None:
        return "the norm has consumers other than one linear's input"
    linear_args = _linear_args(linear)
    w_val, n_val = linear_args[0].meta.get("val"), normed.meta.get("val")
    plain = linear.target == aten.linear.default  # a quantized weight has its own dtype
    if w_val is None or n_val is None or w_val.dim() != 2 or (plain and w_val.dtype != n_val.dtype):
        return "the linear's weight is not a 2-d tensor of the norm's dtype"
    late = ancestors_after([n for n in linear_args if isinstance(n, fx.Node)], norm)
    if any(norm in node.all_input_nodes for node in late):
        return "the linear's weight depends on the norm"
    x, *rest = norm.args  # rms_norm: (x, w, eps); fused_add_rms_norm: (x, residual, w, eps)
    graph = gm.graph
    for node in late:  # weight, scales and bias are ready where the norm was
        norm.prepend(node)
    norm_linear, add_norm_linear = FUSED_VARIANTS[linear.target]
    with graph.inserting_before(norm):
        if norm.target == RMS_NORM:
            new = graph.call_function(norm_linear, (x, *rest, *linear_args))
            created = [new]
        else:  # the sum is read only when something used fused_add_rms_norm(...)[1]
            new = graph.call_function(add_norm_linear, (x, *rest, *linear_args))
            created = [new, graph.call_function(operator.getitem, (new, 0))]
            if summed is not None:
                created.append(graph.call_function(operator.getitem, (new, 1)))
    propagate_meta(gm, created)
    for node in created:
        node.meta["autodeploy_provenance"] = "fuse_norm_linear"
    linear.replace_all_uses_with(created[0] if norm.target == RMS_NORM else created[1])
    if summed is not None:
        summed.replace_all_uses_with(created[2])
    return None


def _linear_args(linear: fx.Node) -> tuple:
    """A linear's arguments after its input, all positional (``aten.linear``: weight, bias)."""
    if linear.target == aten.linear.default:
        return linear.args[1], linear.args[2] if len(linear.args) > 2 else linear.kwargs.get("bias")
    return tuple(linear.args[1:])


def _sole_linear_consumer(normed: fx.Node) -> fx.Node | None:
    users = list(normed.users)
    if len(users) != 1:
        return None
    user = users[0]
    ok = user.target in FUSED_VARIANTS and user.args[0] is normed and normed not in user.args[1:]
    return user if ok else None
