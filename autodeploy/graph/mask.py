"""Recognize what an attention mask computes by running it.

Models build masks in many ways (HF masking utilities, packed-sequence detection, hand-written
``triu``...). Rather than matching each spelling, the mask's subgraph is evaluated for one sequence
of ``n`` tokens (positions ``0..n-1``) and the resulting ``[n, n]`` pattern is classified as
causal, causal with a sliding window, or unsupported (with a message saying why).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import fx
from torch.utils import _pytree as pytree

from ..errors import UnsupportedPatternError

PROBE_LENGTHS = (64,)


@dataclass(frozen=True)
class MaskKind:
    causal: bool
    sliding_window: int | None = None


def classify_mask(gm: fx.GraphModule, mask: fx.Node | None, window_hints: tuple[int, ...] = ()) -> MaskKind:
    """Classify ``mask`` (bool: True = allowed, or additive float) for a single sequence."""
    if mask is None:
        return MaskKind(causal=True)
    lengths = sorted({*PROBE_LENGTHS, *(w + 8 for w in window_hints if 0 < w < (1 << 14))})
    kinds = {classify_allowed(allowed_pairs(gm, mask, n)) for n in lengths}
    windows = {k.sliding_window for k in kinds if k.sliding_window}
    if len(windows) > 1:
        raise UnsupportedPatternError(f"mask {mask.name} is not a fixed sliding window (widths {sorted(windows)})")
    return MaskKind(causal=True, sliding_window=windows.pop() if windows else None)


def allowed_pairs(gm: fx.GraphModule, mask: fx.Node, n: int) -> torch.Tensor:
    value = evaluate_for_length(gm, mask, n)
    if not isinstance(value, torch.Tensor) or value.dim() < 2 or tuple(value.shape[-2:]) != (n, n):
        raise UnsupportedPatternError(f"mask {mask.name} does not evaluate to a [{n}, {n}] pattern")
    flat = value.reshape(-1, n, n)
    if not all(torch.equal(flat[0], m) for m in flat[1:]):
        raise UnsupportedPatternError(f"mask {mask.name} differs between batch rows or heads")
    m = flat[0]
    if m.dtype == torch.bool:
        return m
    allowed, blocked = m == 0, m <= torch.finfo(m.dtype).min / 2
    if not bool((allowed | blocked).all()):
        raise UnsupportedPatternError(f"mask {mask.name} adds a bias to attention scores (not a pure mask)")
    return allowed


def classify_allowed(allowed: torch.Tensor) -> MaskKind:
    n = allowed.shape[0]
    diff = torch.arange(n)[:, None] - torch.arange(n)[None, :]
    causal = diff >= 0
    if torch.equal(allowed, causal):
        return MaskKind(causal=True)
    window = int(allowed[-1].sum())
    if torch.equal(allowed, causal & (diff < window)):
        return MaskKind(causal=True, sliding_window=window)
    if bool(allowed.all()):
        raise UnsupportedPatternError("bidirectional (non-causal) attention cannot use a KV cache")
    raise UnsupportedPatternError("attention mask is neither causal nor a causal sliding window")


def evaluate_for_length(gm: fx.GraphModule, target: fx.Node, n: int):
    """Evaluate ``target``'s ancestors with ``input_ids = 0`` and ``position_ids = arange(n)``."""
    token_symbol = _token_symbol(gm)
    env: dict[fx.Node, object] = {}
    for node in _ancestors(target):
        env[node] = _evaluate_node(gm, node, env, token_symbol, n)
    return env[target]


def _evaluate_node(gm, node: fx.Node, env, token_symbol, n: int):
    if node.op == "placeholder":
        if node.name == "position_ids":
            return torch.arange(n)
        if node.name == "input_ids":
            return torch.zeros(n, dtype=torch.int64)
        raise UnsupportedPatternError(f"mask depends on graph input {node.name}")
    if node.op == "get_attr":
        module_name, _, leaf = node.target.rpartition(".")
        value = getattr(gm.get_submodule(module_name) if module_name else gm, leaf)
        if value.device.type == "meta":
            raise UnsupportedPatternError(f"mask depends on weight {node.target}")
        return value
    val = node.meta.get("val")
    if isinstance(val, torch.SymInt) and token_symbol is not None:
        return int(val.node.expr.subs({token_symbol: n}))
    args, kwargs = pytree.tree_map_only(fx.Node, lambda a: env[a], (node.args, dict(node.kwargs)))
    if "device" in kwargs:
        kwargs["device"] = torch.device("cpu")
    return node.target(*args, **kwargs)


def _token_symbol(gm: fx.GraphModule):
    for node in gm.graph.find_nodes(op="placeholder"):
        val = node.meta.get("val")
        if node.name in ("input_ids", "position_ids") and isinstance(val, torch.Tensor):
            size = val.shape[0]
            return size.node.expr if isinstance(size, torch.SymInt) else None
    return None


def _ancestors(node: fx.Node) -> list[fx.Node]:
    order = {n: i for i, n in enumerate(node.graph.nodes)}
    seen, stack = set(), [node]
    while stack:
        cur = stack.pop()
        if cur in seen:
            continue
        seen.add(cur)
        if not isinstance(cur.meta.get("val"), torch.SymInt):  # sizes are computed from the symbol
            stack.extend(cur.all_input_nodes)
    return sorted(seen, key=order.__getitem__)
