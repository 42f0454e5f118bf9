"""Parameters as graph objects: stack several parameters into one (for fused GEMMs) on the graph.

While a model compiles its parameters are meta tensors; a fused parameter is then created on meta
too, and its rows are filled later by load hooks (``passes/fuse.py``): one checkpoint tensor at a
time is copied into its slice, so there is never a second copy of the weights. Parameters that
already hold values (tests, eager modules) are concatenated right away.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import fx

from ..export import get_tensor_attr, set_tensor_attr
from .meta import fake_mode_of


@dataclass(frozen=True)
class FusedParameter:
    """A parameter whose rows (dim 0) are other parameters, in order."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    pieces: tuple[tuple[str, int, int], ...]  # (source parameter name, first row, end row)


def sole_parameter(node: object) -> str | None:
    """The parameter name read by ``node`` if it is a get_attr whose value is used only once."""
    if not isinstance(node, fx.Node) or node.op != "get_attr" or len(node.users) != 1:
        return None
    readers = node.graph.find_nodes(op="get_attr", target=node.target)
    return str(node.target) if len(readers) == 1 else None


def fused_parameter_name(names: list[str]) -> str:
    """``a.b.q_proj.weight`` + ``a.b.k_proj.weight`` -> ``a.b.fused_q_proj_k_proj.weight``."""
    modules = [n.split(".")[:-1] for n in names]
    leaves = [n.split(".")[-1] for n in names]
    common: list[str] = []
    for column in zip(*modules):
        if len(set(column)) != 1:
            break
        common.append(column[0])
    middle = "_".join("_".join(m[len(common):]) for m in modules if m[len(common):])
    if not middle or len(set(leaves)) != 1:
        return ".".join([*common, "fused_" + "_".join(filter(None, [middle, *leaves]))])
    return ".".join([*common, f"fused_{middle}", leaves[0]])


def stack_parameters(gm: fx.GraphModule, readers: list[fx.Node], before: fx.Node) -> tuple[fx.Node, FusedParameter]:
    """Replace the parameters read by ``readers`` (get_attr nodes) by one parameter stacking them
    along dim 0; returns a get_attr of it inserted before ``before`` and its description."""
    names = [str(n.target) for n in readers]
    values = [get_tensor_attr(gm, n) for n in names]
    if len({v.dtype for v in values}) != 1 or len({tuple(v.shape[1:]) for v in values}) != 1:
        raise ValueError(f"cannot stack parameters of different dtypes or trailing shapes: {names}")
    name = fused_parameter_name(names)
    if any(v.device.type == "meta" for v in values):
        rows = sum(v.shape[0] for v in values)
        value = torch.empty((rows, *values[0].shape[1:]), dtype=values[0].dtype, device="meta")
    else:
        value = torch.cat(values)
    set_tensor_attr(gm, name, value, as_parameter=True)
    with fake_mode_of(gm):
        fake = torch.cat([n.meta["val"] for n in readers])
    with gm.graph.inserting_before(before):
        node = gm.graph.create_node("get_attr", name)
    node.meta["val"] = fake
    pieces, start = [], 0
    for source, v in zip(names, values):
        pieces.append((source, start, start + v.shape[0]))
        start += v.shape[0]
    return node, FusedParameter(name, tuple(value.shape), value.dtype, tuple(pieces))


def remove_parameter(gm: fx.GraphModule, name: str) -> None:
    """Delete a parameter nothing reads any more (its get_attr nodes must be gone)."""
    module_name, _, leaf = name.rpartition(".")
    module = gm.get_submodule(module_name) if module_name else gm
    delattr(module, leaf)
