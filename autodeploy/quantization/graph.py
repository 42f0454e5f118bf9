"""Quantized linears on the graph: their parameters (on meta, filled later through the
:class:`ParameterWriter`), their canonical op nodes, and the stacking of several into one GEMM.

Stacking (fused q/k/v, gate/up) concatenates the weights' rows and lays the scales out so that the
one op computes exactly what the parts computed: per-channel and block scales stack by rows, a
per-tensor FP8 scale becomes its part's rows of a per-channel vector, an NVFP4 global scale its
part's entries of a per-row vector, and the parts' static input scales one scale, their maximum
(ModelOpt already exports fused parts with one input scale; otherwise the max keeps every part's
activations inside the FP8 range).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import fx

from ..graph.meta import fake_mode_of
from ..graph.params import fused_parameter_name, remove_parameter
from .params import FP8_LINEAR, NVFP4_LINEAR, ParameterWriter, QuantLinear, add_meta_parameter, quant_op_args
from .scheme import LinearFormat


@dataclass(frozen=True)
class StackedQuantLinear:
    """A quantized linear made of ``parts`` (their rows in order)."""

    fused: QuantLinear
    parts: tuple[QuantLinear, ...]


def param_node(gm: fx.GraphModule, name: str, shape, dtype, before: fx.Node) -> fx.Node:
    """A get_attr of parameter ``name`` before ``before``, with fake metadata."""
    with gm.graph.inserting_before(before):
        node = gm.graph.get_attr(name)
    with fake_mode_of(gm):
        node.meta["val"] = torch.empty(shape, dtype=dtype, device="meta")
    return node


def add_quant_params(gm: fx.GraphModule, writer: ParameterWriter, linear: QuantLinear) -> None:
    """The meta parameters of ``linear`` (replacing a same-named unquantized weight), each expected
    whole from its logical tensor of the same name."""
    for role in linear.roles():
        shape, dtype = linear.spec(role)
        add_meta_parameter(gm, linear.name(role), shape, dtype)
        writer.expect(linear.name(role), shape)


def quant_linear_args(gm: fx.GraphModule, linear: QuantLinear, x, bias, before: fx.Node) -> tuple:
    """``(target, args)`` of the canonical op computing ``linear`` on ``x``; the get_attrs of its
    parameters are inserted before ``before``."""
    params = [param_node(gm, linear.name(r), *linear.spec(r), before) for r in linear.roles()]
    return quant_op_args(linear.fmt, x, params, bias)


def quant_linear_node(gm: fx.GraphModule, linear: QuantLinear, x, bias, before: fx.Node) -> fx.Node:
    """The canonical op computing ``linear`` on ``x``, inserted before ``before``."""
    target, args = quant_linear_args(gm, linear, x, bias, before)
    with gm.graph.inserting_before(before):
        return gm.graph.call_function(target, args)


def quant_linear_of(node: fx.Node) -> QuantLinear | None:
    """The quantized linear an ``fp8_linear`` / ``nvfp4_linear`` node computes (None for another
    node, or one whose weight and scales are not parameters)."""
    if node.target not in (FP8_LINEAR, NVFP4_LINEAR):
        return None
    weight, scale = node.args[1], node.args[2]
    if not all(isinstance(a, fx.Node) and a.op == "get_attr" for a in (weight, scale)):
        return None
    n, k = weight.meta["val"].shape
    module, leaf = str(weight.target).rpartition(".")[0], str(scale.target).rpartition(".")[2]
    if node.target == NVFP4_LINEAR:
        fmt = LinearFormat("nvfp4", "nvfp4", "none")
        return QuantLinear(module, fmt, int(n), int(k) * 2, stacked=node.args[3].meta["val"].dim() == 1)
    block, activations = node.args[5], node.args[6]
    kind = ("tensor", "channel", "block")[scale.meta["val"].dim()]
    fmt = LinearFormat("fp8", kind, activations, tuple(block) if block else None, scale_name=leaf)
    return QuantLinear(module, fmt, int(n), int(k))


def can_stack(parts: list[QuantLinear]) -> bool:
    """Same format and input width; with block scales, every part a whole number of row blocks."""
    first = parts[0]
    if any(p.fmt != first.fmt or p.in_features != first.in_features for p in parts):
        return False
    return first.fmt.weight_scale != "block" or all(p.out_features % first.fmt.block_size[0] == 0 for p in parts)


def stack_quant_linears(gm: fx.GraphModule, parts: list[QuantLinear]) -> QuantLinear:
    """One quantized linear whose output rows are the parts' in order (module doc), its parameters
    on meta; the writer learns where the parts' tensors go from :func:`redirect_stacked`, and the
    parts' parameters stay until :func:`remove_params` (after the nodes reading them are gone)."""
    first = parts[0]
    fmt = first.fmt
    if fmt.kind == "fp8" and fmt.weight_scale == "tensor":
        fmt = dataclasses.replace(fmt, weight_scale="channel")
    module = fused_parameter_name([p.name("weight") for p in parts]).rpartition(".")[0]
    fused = QuantLinear(module, fmt, sum(p.out_features for p in parts), first.in_features, stacked=True)
    for role in fused.roles():
        add_meta_parameter(gm, fused.name(role), *fused.spec(role))
    return fused


def redirect_stacked(writer: ParameterWriter, fused: QuantLinear, parts: list[QuantLinear]) -> None:
    """The parts' tensors land in their rows of the stacked parameters."""
    start = 0
    for part in parts:
        rows = (start, start + part.out_features)
        for role in part.roles():
            writer.redirect(part.name(role), fused.name(role), *_slot(fused, role, rows))
        start += part.out_features


def remove_params(gm: fx.GraphModule, linears: list[QuantLinear]) -> None:
    """Delete the parameters of ``linears`` (stacked into others; nothing reads them any more)."""
    for linear in linears:
        for role in linear.roles():
            remove_parameter(gm, linear.name(role))


def _slot(fused: QuantLinear, role: str, rows: tuple[int, int]) -> tuple[tuple[int, int] | None, str]:
    """(rows of the fused parameter, combine) for one part's tensor of ``role``."""
    if role == "input_scale":
        return None, "max"
    if role == "scale" and fused.fmt.weight_scale == "block":
        bn = fused.fmt.block_size[0]
        return (rows[0] // bn, rows[1] // bn), "copy"
    return rows, "copy"
