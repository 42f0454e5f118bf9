"""Fake-tensor metadata (``node.meta["val"]``) for nodes that passes insert."""

from __future__ import annotations

import torch
from torch import fx
from torch._dispatch.python import enable_python_dispatcher
from torch._guards import detect_fake_mode
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import ShapeEnv
from torch.utils import _pytree as pytree


def fake_mode_of(gm: fx.GraphModule) -> FakeTensorMode:
    """The fake mode of the graph's metadata (export gives every node the same one).

    The first fake found decides: passes call this once per rewrite, and checking every node's
    metadata against it (``detect_fake_mode`` over the whole graph) was ~30% of the passes' time
    on a 32-layer model.
    """
    for node in gm.graph.nodes:
        if "val" in node.meta:
            mode = detect_fake_mode(node.meta["val"])
            if mode is not None:
                return mode
    return FakeTensorMode(shape_env=ShapeEnv(), allow_non_fake_inputs=True)


def node_val(arg):
    return arg.meta.get("val") if isinstance(arg, fx.Node) else arg


def propagate_meta(gm: fx.GraphModule, nodes: list[fx.Node]) -> None:
    """Compute ``meta["val"]`` of ``nodes`` (in order) from their inputs' metadata."""
    mode = fake_mode_of(gm)
    for node in nodes:
        if node.op != "call_function":
            continue
        args, kwargs = pytree.tree_map(node_val, (node.args, node.kwargs))
        # the python dispatcher lets composite ops (linear -> matmul) decompose on symbolic sizes
        with mode, enable_python_dispatcher():
            node.meta["val"] = node.target(*args, **kwargs)


def concrete_shape(val: torch.Tensor) -> list[int]:
    """The shape of a (fake) tensor with every symbolic size replaced by its example hint."""
    return [size_hint(s) for s in val.shape]


def size_hint(s) -> int:
    if isinstance(s, int):
        return s
    node = s.node
    hint = node.hint if node.hint is not None else node.shape_env.size_hint(node.expr)
    return int(hint)


def add_graph_input(gm: fx.GraphModule, name: str, example: torch.Tensor) -> fx.Node:
    """A graph input named ``name`` after the existing ones (reused if present), with fake
    metadata shaped like ``example``."""
    existing = {n.name: n for n in gm.graph.find_nodes(op="placeholder")}
    if name in existing:
        return existing[name]
    with gm.graph.inserting_after(list(existing.values())[-1]):
        node = gm.graph.placeholder(name)
    node.meta["val"] = fake_mode_of(gm).from_tensor(example)
    return node
