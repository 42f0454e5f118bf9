"""Graph-order helpers for rewrites that move nodes up to where a fused op is inserted."""

from __future__ import annotations

from typing import Iterable

from torch import fx


def ancestors_after(roots: Iterable[fx.Node], anchor: fx.Node) -> list[fx.Node]:
    """``roots`` and their ancestors placed after ``anchor`` in its graph, in graph order: what
    must move up with them for a node reading ``roots`` to be inserted right after ``anchor``."""
    order = {n: i for i, n in enumerate(anchor.graph.nodes)}
    limit = order[anchor]
    seen, stack = set(), list(roots)
    while stack:
        cur = stack.pop()
        if cur in seen or order.get(cur, -1) <= limit:
            continue
        seen.add(cur)
        stack.extend(cur.all_input_nodes)
    return sorted(seen, key=order.__getitem__)
