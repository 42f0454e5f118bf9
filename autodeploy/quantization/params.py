"""The parameters of quantized linears, on the graph, and where their values land when they load.

:class:`QuantLinear` names a quantized linear's tensors (``M.weight``, ``M.weight_scale`` or
``M.weight_scale_inv``, ``M.input_scale``, ``M.weight_scale_2``: the checkpoint's names) with their
shapes and dtypes, and builds the canonical op's arguments. :class:`ParameterWriter` is where load
hooks put values: by *logical* name (the tensor as the checkpoint has it), following the slots that
fusion assigns (rows of a stacked parameter; a per-tensor scale broadcast over its part's rows of a
per-channel vector; static input scales of fused parts combined by their maximum), so weights
arrive once, already in place.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable

import torch
from torch import fx

from ..errors import QuantizationError
from ..export import get_tensor_attr, set_tensor_attr
from .numerics import FP8_DTYPE, NVFP4_GROUP
from .scheme import LinearFormat

FP8_LINEAR = torch.ops.autodeploy.fp8_linear.default
NVFP4_LINEAR = torch.ops.autodeploy.nvfp4_linear.default


@dataclass(frozen=True)
class QuantLinear:
    """One quantized linear: module ``module`` computing ``out_features`` from ``in_features``."""

    module: str
    fmt: LinearFormat
    out_features: int
    in_features: int
    stacked: bool = False  # several linears in one (fusion): NVFP4's global scale becomes one per row

    def name(self, role: str) -> str:
        leaf = {"weight": "weight", "scale": self.fmt.scale_name, "input_scale": "input_scale",
                "scale_2": "weight_scale_2"}[role]
        return f"{self.module}.{leaf}"

    def roles(self) -> tuple[str, ...]:
        """The graph parameters of this linear, in op-argument order."""
        if self.fmt.kind == "nvfp4":
            return ("weight", "scale", "scale_2")
        return ("weight", "scale", "input_scale") if self.fmt.activations == "static" else ("weight", "scale")

    def spec(self, role: str) -> tuple[tuple[int, ...], torch.dtype]:
        """(shape, dtype) of a parameter, as the op takes it."""
        n, k = self.out_features, self.in_features
        if role == "weight":
            return ((n, k // 2), torch.uint8) if self.fmt.kind == "nvfp4" else ((n, k), FP8_DTYPE)
        if role == "scale":
            return self._scale_spec()
        if role == "scale_2" and self.stacked:
            return (n,), torch.float32
        return (), torch.float32  # input_scale, scale_2

    def _scale_spec(self) -> tuple[tuple[int, ...], torch.dtype]:
        n, k = self.out_features, self.in_features
        if self.fmt.kind == "nvfp4":
            return (n, k // NVFP4_GROUP), FP8_DTYPE
        if self.fmt.weight_scale == "block":
            bn, bk = self.fmt.block_size
            return (-(-n // bn), -(-k // bk)), torch.float32
        return ((n,) if self.fmt.weight_scale == "channel" else ()), torch.float32

    def check_shape(self, method: str) -> None:
        """A clear error when the weight does not split into the format's groups or blocks."""
        k, fmt = self.in_features, self.fmt
        if fmt.kind == "nvfp4" and k % NVFP4_GROUP:
            raise QuantizationError(f"{method}: {self.name('weight')} has {k} input features, not a multiple of "
                                    f"the NVFP4 group of {NVFP4_GROUP}")
        if fmt.activations == "group" and k % fmt.block_size[1]:
            raise QuantizationError(f"{method}: {self.name('weight')} has {k} input features, which do not split "
                                    f"into blocks of {fmt.block_size[1]} (block size {list(fmt.block_size)})")


def quant_op_args(fmt: LinearFormat, x, params: list, bias) -> tuple:
    """``(target, args)`` of the canonical op of ``fmt`` on input ``x`` with ``params`` in role order."""
    if fmt.kind == "nvfp4":
        return NVFP4_LINEAR, (x, *params, bias)
    weight, scale, *rest = params
    block = list(fmt.block_size) if fmt.weight_scale == "block" else None
    return FP8_LINEAR, (x, weight, scale, rest[0] if rest else None, bias, block, fmt.activations)


def add_meta_parameter(gm: fx.GraphModule, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> None:
    set_tensor_attr(gm, name, torch.empty(shape, dtype=dtype, device="meta"), as_parameter=True)


@dataclass(frozen=True)
class Slot:
    """Where a logical tensor lands: ``rows`` of parameter ``param`` (None: all of it), combined
    with what is there by ``copy`` or ``max``; ``take`` (tensor parallelism) cuts this rank's piece
    out of a value that had to be computed whole (online quantization with a scale over all of it)."""

    param: str
    shape: tuple[int, ...]  # the logical tensor's shape (what the hook writes)
    rows: tuple[int, int] | None = None
    combine: str = "copy"
    take: Callable[[torch.Tensor], torch.Tensor] | None = None


class ParameterWriter:
    """Writes load-hook values into graph parameters by logical name (module doc)."""

    def __init__(self, gm: fx.GraphModule, device: torch.device):
        self.gm, self.device = gm, device
        self.slots: dict[str, Slot] = {}
        self.written: set[str] = set()
        self.online: str | None = None  # "fp8" / "nvfp4": hooks quantize unquantized weights themselves

    def expect(self, logical: str, shape: tuple[int, ...]) -> None:
        """``logical`` is written whole into the parameter of the same name."""
        self.slots[logical] = Slot(logical, tuple(shape))

    def redirect(self, old_param: str, new_param: str, rows: tuple[int, int] | None, combine: str = "copy") -> None:
        """What was going to ``old_param`` goes to ``rows`` of ``new_param`` (fusion)."""
        for logical, slot in list(self.slots.items()):
            if slot.param == old_param:
                self.slots[logical] = dataclasses.replace(slot, param=new_param, rows=rows, combine=combine)

    def slots_of(self, param: str) -> dict[str, Slot]:
        """The logical tensors that land in ``param``."""
        return {logical: slot for logical, slot in self.slots.items() if slot.param == param}

    def write(self, logical: str, value: torch.Tensor) -> None:
        slot = self.slots[logical]
        if tuple(value.shape) != slot.shape:
            raise QuantizationError(f"{logical}: checkpoint shape {tuple(value.shape)} != expected {slot.shape}")
        target = self._target(slot)
        view = target if slot.rows is None else target[slot.rows[0]:slot.rows[1]]
        value = (slot.take(value) if slot.take else value).to(device=self.device)
        if slot.combine == "max":
            view.copy_(torch.maximum(view, value.to(view.dtype)))
        else:
            view.copy_(value)  # a per-tensor value broadcasts over its rows
        self.written.add(logical)

    def complete(self, param: str) -> bool:
        return all(name in self.written for name, slot in self.slots.items() if slot.param == param)

    def params(self) -> set[str]:
        return {slot.param for slot in self.slots.values()}

    def _target(self, slot: Slot) -> torch.Tensor:
        current = get_tensor_attr(self.gm, slot.param)
        if current.device.type == "meta":
            make = torch.zeros if slot.combine == "max" else torch.empty
            current = make(current.shape, dtype=current.dtype, device=self.device)
            set_tensor_attr(self.gm, slot.param, current, as_parameter=True)
        return current
