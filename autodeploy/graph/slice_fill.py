"""A tensor filled slice by slice -> ``cat`` of its pieces (a normalisation of ``cleanup_graph``).

HF's MLA builds its keys as ``k = x.new_empty(...); k[..., :n].copy_(k_nope); k[..., n:].copy_(k_rot)``
(an allocation, then in-place copies into slices of it). That value is ``cat([k_nope, k_rot], -1)``
(each piece broadcast to its slice and cast to the buffer's dtype), which the matcher can follow and
nothing mutates. The rewrite is taken only when it provably changes nothing: the slices (step 1, along
one dimension) tile that dimension exactly, each slice is only copied into (once), every other reader
of the buffer comes after the last copy, and nothing writes the buffer through another view.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import fx

from .meta import propagate_meta

aten = torch.ops.aten
_ALLOCATIONS = frozenset({aten.new_empty.default, aten.empty.memory_format, aten.new_zeros.default,
                          aten.zeros.default})


@dataclass(frozen=True)
class _Fill:
    dim: int
    copies: list[fx.Node]  # in slice order
    expands: list[list[int] | None]  # per copy: expand() sizes taking its source to its slice, None: same shape
    last_copy: fx.Node
    readers: list[fx.Node]


def fold_slice_fills(gm: fx.GraphModule) -> int:
    """Rewrite every slice-by-slice fill of ``gm`` into a ``cat``; returns how many."""
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    folded = 0
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and node.target in _ALLOCATIONS:
            fill = _fill_plan(node, order)
            if fill is not None:
                _fold(gm, node, fill)
                folded += 1
    return folded


def _fill_plan(buffer: fx.Node, order: dict) -> _Fill | None:
    """How ``buffer`` is filled, or None where it is not a fill this rewrite may take."""
    val = buffer.meta.get("val")
    if not isinstance(val, torch.Tensor):
        return None
    slices = [u for u in buffer.users if u.target == aten.slice.Tensor and u.args[0] is buffer]
    readers = [u for u in buffer.users if u not in slices]
    if not slices or any(not _only_copied_into(s) for s in slices) or any(_writes(r) for r in readers):
        return None
    bounds = [_bounds(s, val) for s in slices]
    if any(b is None for b in bounds) or len({b[0] for b in bounds}) != 1:
        return None
    spans = sorted((start, end, s) for (_, start, end), s in zip(bounds, slices))
    edges = [0] + [end for _, end, _ in spans]
    if [start for start, _, _ in spans] != edges[:-1] or edges[-1] != val.shape[bounds[0][0]]:
        return None
    copies = [next(iter(s.users)) for _, _, s in spans]
    expands = [_expand_sizes(c.args[1].meta.get("val"), c.args[0].meta.get("val")) for c in copies]
    last_copy = max(copies, key=order.__getitem__)
    if any(e is False for e in expands) or any(order[r] < order[last_copy] for r in readers):
        return None
    return _Fill(bounds[0][0], copies, expands, last_copy, readers)


def _only_copied_into(view: fx.Node) -> bool:
    users = list(view.users)
    return (len(users) == 1 and users[0].target == aten.copy_.default and users[0].args[0] is view
            and not users[0].users)


def _bounds(view: fx.Node, val: torch.Tensor) -> tuple[int, int, int] | None:
    """(dim, start, end) of a step-1 slice with constant bounds along a dimension of constant size."""
    _, dim, start, end, step = (list(view.args) + [0, None, None, 1][len(view.args) - 1:])[:5]
    dim = dim % val.dim()
    size = val.shape[dim]
    if step != 1 or not isinstance(size, int) or not all(isinstance(b, (int, type(None))) for b in (start, end)):
        return None
    start = 0 if start is None else max(0, start + size) if start < 0 else min(start, size)
    end = size if end is None else max(0, end + size) if end < 0 else min(end, size)
    return (dim, start, end) if start < end else None


def _writes(node: fx.Node) -> bool:
    """Whether ``node`` or anything reached from it through views writes in place."""
    frontier, seen = [node], set()
    while frontier:
        cur = frontier.pop()
        if cur in seen or cur.op != "call_function":
            continue
        seen.add(cur)
        schema = getattr(cur.target, "_schema", None)
        if schema is None:
            continue
        if any(a.alias_info is not None and a.alias_info.is_write for a in schema.arguments):
            return True
        if any(r.alias_info is not None for r in schema.returns):  # a view: its readers read the buffer
            frontier.extend(cur.users)
    return False


def _expand_sizes(source, target) -> list[int] | None | bool:
    """expand() sizes taking ``source`` to ``target``'s shape (-1 where they agree, the constant target
    size where the source broadcasts); None when the shapes are equal; False when no such sizes exist."""
    if not isinstance(source, torch.Tensor) or not isinstance(target, torch.Tensor) or source.dim() != target.dim():
        return False
    if all(have == want for have, want in zip(source.shape, target.shape)):
        return None
    sizes = []
    for have, want in zip(source.shape, target.shape):
        if have == want:
            sizes.append(-1)
        elif have == 1 and isinstance(want, int):
            sizes.append(want)
        else:
            return False
    return sizes


def _fold(gm: fx.GraphModule, buffer: fx.Node, fill: _Fill) -> None:
    graph, dtype = gm.graph, buffer.meta["val"].dtype
    new = []
    with graph.inserting_before(fill.last_copy.next):
        pieces = []
        for copy, sizes in zip(fill.copies, fill.expands):
            piece = copy.args[1]
            if sizes is not None:
                piece = graph.call_function(aten.expand.default, (piece, sizes))
                new.append(piece)
            if copy.args[1].meta["val"].dtype != dtype:
                piece = graph.call_function(aten.to.dtype, (piece, dtype))
                new.append(piece)
            pieces.append(piece)
        cat = graph.call_function(aten.cat.default, (pieces, fill.dim))
    propagate_meta(gm, [*new, cat])
    for node in (*new, cat):
        node.meta.update({k: v for k, v in buffer.meta.items() if k in ("nn_module_stack", "stack_trace")})
    for reader in fill.readers:
        reader.replace_input_with(buffer, cat)
    for copy in fill.copies:
        view = copy.args[0]
        graph.erase_node(copy)
        graph.erase_node(view)
    graph.erase_node(buffer)
