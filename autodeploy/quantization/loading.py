"""Load hooks of quantized linears: checkpoint tensors (or bf16 weights quantized on the fly) into
their parameters through the :class:`ParameterWriter`.

Before anything loads, every tensor a quantized linear needs is checked against the checkpoint's
safetensors headers (present, shaped as the format says, scale dtype): a missing or misshapen
scale is a compile-time error naming the scheme and the tensor, not a wrong answer. Online
quantization runs on the target device, one tensor at a time: the bf16 weight is never kept.
"""

from __future__ import annotations

import functools
import math

import torch

from ..errors import QuantizationError
from .numerics import quantize_fp8_per_channel, quantize_nvfp4
from .params import ParameterWriter, QuantLinear
from .scheme import QuantPlan

_SAFETENSORS_DTYPES = {torch.float8_e4m3fn: "F8_E4M3", torch.uint8: "U8"}


def register_quant_hooks(ctx, plan: QuantPlan, linears: list[QuantLinear], writer: ParameterWriter,
                         stored: dict[str, tuple[str, tuple[int, ...]]]) -> None:
    """One hook per checkpoint tensor of each linear (``ctx`` is the pass's CompileContext)."""
    for linear in linears:
        if plan.online:
            ctx.add_weight_hook(linear.name("weight"), functools.partial(_quantize_online, linear, writer, ctx.device))
            continue
        for role in linear.roles():
            if stored:
                check_stored(plan, linear, role, stored)
            ctx.add_weight_hook(linear.name(role), functools.partial(_write_stored, plan, linear, role, writer))


def register_targets(ctx, writer: ParameterWriter) -> None:
    """Parameters the writer fills count as loaded once every piece has arrived."""
    for param in writer.params():
        ctx.hook_targets[param] = functools.partial(writer.complete, param)


def check_stored(plan: QuantPlan, linear: QuantLinear, role: str, stored: dict) -> None:
    name = linear.name(role)
    if name not in stored:
        raise QuantizationError(f"{plan.method}: {name} is missing from the checkpoint "
                                f"({linear.fmt.describe()} needs it)")
    dtype, shape = stored[name]
    want_shape, want_dtype = linear.spec(role)
    if role == "weight" and (shape != want_shape or dtype != _SAFETENSORS_DTYPES[want_dtype]):
        raise QuantizationError(f"{plan.method}: {name} is stored as {dtype} {list(shape)}; a "
                                f"{linear.out_features}x{linear.in_features} linear needs "
                                f"{_SAFETENSORS_DTYPES[want_dtype]} {list(want_shape)}")
    if role == "scale":
        _check_scale(plan, linear, name, dtype, shape)
    elif role != "weight" and math.prod(shape) != 1:
        raise QuantizationError(f"{plan.method}: {name} has shape {list(shape)}; one value per tensor expected")


def _check_scale(plan: QuantPlan, linear: QuantLinear, name: str, dtype: str, shape: tuple[int, ...]) -> None:
    want, want_dtype = linear.spec("scale")
    if linear.fmt.weight_scale == "block" and tuple(shape) != tuple(want):
        bn, bk = linear.fmt.block_size
        raise QuantizationError(f"{plan.method}: {name} has shape {list(shape)}, but a {linear.out_features}x"
                                f"{linear.in_features} weight in {bn}x{bk} blocks needs {list(want)}")
    if math.prod(shape) != math.prod(want):
        raise QuantizationError(f"{plan.method}: {name} has shape {list(shape)}; {linear.fmt.describe()} needs "
                                f"{math.prod(want)} values for a {linear.out_features}x{linear.in_features} weight")
    if want_dtype == torch.float8_e4m3fn and dtype != "F8_E4M3":
        raise QuantizationError(f"{plan.method}: {name} is stored as {dtype}; NVFP4 block scales are F8_E4M3")


def _write_stored(plan: QuantPlan, linear: QuantLinear, role: str, writer: ParameterWriter, tensor) -> None:
    shape, dtype = linear.spec(role)
    if role == "weight" and tensor.dtype != dtype:
        raise QuantizationError(f"{plan.method}: {linear.name(role)} arrived as {tensor.dtype}, expected {dtype}")
    writer.write(linear.name(role), tensor.reshape(writer.slots[linear.name(role)].shape))


def _quantize_online(linear: QuantLinear, writer: ParameterWriter, device: torch.device, tensor) -> None:
    weight = tensor.to(device)
    if linear.fmt.kind == "nvfp4":
        packed, scale, scale_2 = quantize_nvfp4(weight)
        writer.write(linear.name("scale_2"), scale_2)
    else:
        packed, scale = quantize_fp8_per_channel(weight)
    writer.write(linear.name("weight"), packed)
    writer.write(linear.name("scale"), scale)
