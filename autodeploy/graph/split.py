"""Split a compiled step graph into pieces a CUDA graph can capture at a fixed token count, and the
nodes between them that must run eagerly.

A step's tokens are flattened into one dimension T, and ``check_uncached_state`` proved (on the
canonical graph, before fusion) that every op but attention keeps the token rows apart. So the work
between two attention calls depends on T alone: captured once per token bucket, it replays for any
step padded to that bucket, padding rows computing garbage only in their own rows. What cannot be
captured that way, read off the graph:

- nodes that read the step's metadata or caches (a graph input other than ``input_ids`` /
  ``position_ids``): paged attention of every backend, the logits gather (``logits_indices``);
- nodes with a size that is not a function of T alone (after the gather: one row per logit);
- ops that synchronise with the host (:data:`HOST_SYNC_OPS`), which no CUDA graph can hold.

Those run eagerly between the captured pieces (``autodeploy.piecewise``). A captured piece made
only of views launches nothing: it runs eagerly too.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import sympy
import torch
from torch import fx
from torch.fx.passes.split_module import split_module

from .. import ops  # noqa: F401  (registers the canonical ops named below)
from ..kvcache.metadata import TOKEN_INPUTS
from ..ops.state_ops import STATE_OPS

# ops whose implementation reads device values on the host (a capture fails on them)
HOST_SYNC_OPS: dict[object, str] = {
    torch.ops.autodeploy.moe.default: "reads the routed expert ids on the host (.tolist())",
    **{op: "loops over the step's sequences on the host (.tolist())" for op in STATE_OPS.values()},
}
_SIZE_OPS = frozenset({torch.ops.aten.sym_size.int, torch.ops.aten.sym_numel.default, torch.ops.aten.sym_stride.int})


@dataclass(frozen=True)
class SplitGraph:
    """``outer`` calls the submodules in order; ``captured`` names the pieces to capture per token
    bucket, ``eager`` the ones that run as they are; ``fresh_args[name]``: positions of a captured
    piece's inputs that an eager submodule produces (new tensors every step)."""

    outer: fx.GraphModule
    captured: tuple[str, ...]
    eager: tuple[str, ...]
    fresh_args: dict[str, tuple[int, ...]]
    reasons: dict[str, str]  # eager submodule -> why its first node cannot be captured


def token_symbol(gm: fx.GraphModule) -> sympy.Symbol | None:
    """The symbol of the step's token count (``input_ids``' dynamic size), None if it is static."""
    node = next(n for n in gm.graph.find_nodes(op="placeholder") if n.name == TOKEN_INPUTS[0])
    size = node.meta["val"].shape[0]
    return size.node.expr if isinstance(size, torch.SymInt) else None


def eager_reason(node: fx.Node, tokens: sympy.Symbol | None) -> str | None:
    """Why ``node`` must run eagerly between captured pieces (None: a piece may hold it)."""
    if node.op != "call_function":
        return None
    name = _name(node.target)
    if node.target in HOST_SYNC_OPS:
        return f"{name} {HOST_SYNC_OPS[node.target]}"
    step_inputs = [a.name for a in node.all_input_nodes if a.op == "placeholder" and a.name not in TOKEN_INPUTS]
    if step_inputs:
        return f"{name} reads the step's {', '.join(step_inputs)}"
    for value in [node.meta.get("val")] + [a.meta.get("val") for a in node.all_input_nodes]:
        if _symbols(value) - {tokens}:
            return f"{name} has a size that is not a function of the token count"
    return None


def split_at_eager_ops(gm: fx.GraphModule) -> SplitGraph:
    """Split ``gm`` (the compiled step graph) into alternating captured and eager submodules."""
    tokens = token_symbol(gm)
    kinds: dict[fx.Node, str | None] = {}
    partition: dict[fx.Node, int] = {}
    current, previous = 0, None
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "get_attr", "output"):
            continue
        reason = eager_reason(node, tokens)
        if previous is not None and (reason is None) != (kinds[previous] is None):
            current += 1
        kinds[node], partition[node], previous = reason, current, node
    outer = split_module(gm, gm, lambda node: partition[node], keep_original_order=True)
    first = {}
    for node, part in partition.items():
        first.setdefault(f"submod_{part}", kinds[node])
    captured = [name for name, reason in first.items() if reason is None and not _views_only(getattr(outer, name))]
    eager = [name for name in first if name not in captured]
    reasons = {name: first[name] or "views only: nothing to capture" for name in eager}
    _copy_captured_output(outer, set(captured))
    return SplitGraph(outer, tuple(captured), tuple(eager), _fresh_args(outer, set(eager)), reasons)


def _views_only(piece: fx.GraphModule) -> bool:
    """A piece launches no kernel: every op is a view, a size or a tuple item."""
    for node in piece.graph.nodes:
        target = node.target
        if node.op != "call_function":
            continue
        if target is operator.getitem or target in _SIZE_OPS:
            continue
        if not (isinstance(target, torch._ops.OpOverload) and target.is_view):
            return False
    return True


def _fresh_args(outer: fx.GraphModule, eager: set[str]) -> dict[str, tuple[int, ...]]:
    """Per captured call: argument positions whose value an eager submodule made this step."""
    fresh = {}
    for node in outer.graph.nodes:
        if node.op == "call_module" and node.target not in eager:
            fresh[node.target] = tuple(i for i, arg in enumerate(node.args) if _made_by(arg, eager))
    return fresh


def _made_by(arg, modules: set[str]) -> bool:
    """``arg`` is the output (or a tuple item of the output) of one of ``modules``."""
    if not isinstance(arg, fx.Node):
        return False
    if arg.op == "call_function" and arg.target is operator.getitem:
        arg = arg.args[0]
    return arg.op == "call_module" and arg.target in modules


def _copy_captured_output(outer: fx.GraphModule, captured: set[str]) -> None:
    """A step's output must outlive the next replay: one that a captured piece writes is copied."""
    output = outer.graph.output_node()

    def copied(arg: fx.Node) -> fx.Node:
        if not _made_by(arg, captured):
            return arg
        with outer.graph.inserting_before(output):
            return outer.graph.call_function(torch.ops.aten.clone.default, (arg,))

    output.args = fx.map_arg(output.args, copied)
    outer.recompile()


def _symbols(value) -> set:
    sizes = value.shape if isinstance(value, torch.Tensor) else [value] if isinstance(value, torch.SymInt) else []
    return {s for size in sizes if isinstance(size, torch.SymInt) for s in size.node.expr.free_symbols}


def _name(target) -> str:
    if isinstance(target, torch._ops.OpOverload):
        return str(target).removesuffix(".default")
    return getattr(target, "__name__", str(target))
