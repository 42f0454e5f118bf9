"""Recognize what an attention mask computes by running it, at lengths that prove it.

Models build masks in many ways (HF masking utilities, packed-sequence detection, a causal buffer
sliced per length, hand-written ``triu``...). Rather than matching each spelling, the mask's subgraph
is evaluated for one sequence of ``n`` tokens (positions ``0..n-1``) and the resulting ``[n, n]``
pattern is classified as causal, causal with a sliding window ``w`` (``i - w < j <= i``), or chunked
attention with chunks of ``c`` tokens (``j <= i`` and ``i // c == j // c``, Llama-4), or refused
with a message saying why. A mask may come in several terms (an additive float mask, a boolean
"allowed" mask as in ``where(mask, scores, min)``, a boolean "blocked" mask as in
``masked_fill(mask, min)``); the pairs allowed are those every term allows.

Which lengths prove the kind for every sequence the engine runs (up to ``max_seq_len``)? A mask only
changes its structure where the positions cross a size it is computed from: a window, a chunk, the
length of a buffer. So it is evaluated at

- ``max_seq_len`` itself, whole, up to ``FULL_EVAL_TOKENS`` (longer: at ``FULL_EVAL_TOKENS``);
- just past every size the model config names (``*window*``, ``*chunk*`` keys) and every integer
  constant and buffer size in the mask's own subgraph, below ``max_seq_len``: ``size + 1``, and past
  it twice, ``2 * size + 1`` (at most ``max_seq_len`` and ``MAX_PROBE_TOKENS``). Just past a window
  of w, the window and other patterns can still coincide (one row differs from causal); the second
  length tells them apart and checks the pattern repeats (a chunk's second boundary);
- a short length (``SHORT_PROBE``);

the kind is read off the longest evaluation, and every evaluation must be exactly that kind's
pattern at its length, or the compile stops. Sizes at or past ``max_seq_len`` change nothing the
engine can run (a chunk of 8192 under ``max_seq_len=4096`` is plain causal attention for it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal, Sequence

import sympy
import torch
from torch import fx
from torch.utils import _pytree as pytree

from ..errors import UnsupportedPatternError

SHORT_PROBE = 64
# The longest mask evaluated whole: 16 M pairs. Llama's mask at 8192 tokens took 1 s to evaluate (one
# core), at 4096 0.25 s. Sizes past it are probed just past them, at most MAX_PROBE_TOKENS (Llama-4's
# chunk of 8192: 16385 tokens, 268 M pairs, a 268 MB boolean per step of the mask's computation).
FULL_EVAL_TOKENS = 4096
MAX_PROBE_TOKENS = 4 * FULL_EVAL_TOKENS + 1  # a size hint needing a longer probe is refused
UNKNOWN_MAX_SEQ_LEN = FULL_EVAL_TOKENS  # graphs compiled without a max_seq_len (tests)
SMALL_CONSTANT = 16  # constant tensors of up to this many elements: their values are size hints too

MaskForm = Literal["additive", "allowed", "blocked"]
_WHERE = {torch.ops.aten.where.self, torch.ops.aten.where.ScalarOther, torch.ops.aten.where.ScalarSelf,
          torch.ops.aten.where.Scalar}


@dataclass(frozen=True)
class MaskKind:
    causal: bool
    sliding_window: int | None = None
    chunk_size: int | None = None

    def allowed(self, n: int) -> torch.Tensor:
        """The [n, n] pattern of this kind for positions 0..n-1."""
        pos = torch.arange(n)
        allowed = pos[:, None] >= pos[None, :] if self.causal else torch.ones(n, n, dtype=torch.bool)
        if self.sliding_window:
            allowed &= pos[:, None] - pos[None, :] < self.sliding_window
        if self.chunk_size:
            allowed &= pos[:, None] // self.chunk_size == pos[None, :] // self.chunk_size
        return allowed


@dataclass(frozen=True)
class MaskTerm:
    """One node of a mask: ``additive`` (0 = allowed, <= finfo.min / 2 = blocked), ``allowed`` (bool,
    True = attend) or ``blocked`` (bool, True = masked out)."""

    node: fx.Node
    form: MaskForm = "additive"


def classify_mask(gm: fx.GraphModule, terms: Sequence[MaskTerm]) -> MaskKind:
    """The kind of the mask made of ``terms`` (none: plain causal attention), proven at the lengths the
    module docstring lists; classifications are cached per graph."""
    if not terms:
        return MaskKind(causal=True)
    cache = gm.meta.setdefault("autodeploy_mask_kinds", {})
    key = tuple((t.node.name, t.form) for t in terms)
    if key not in cache:
        cache[key] = _classify(gm, terms)
    return cache[key]


def _classify(gm: fx.GraphModule, terms: Sequence[MaskTerm]) -> MaskKind:
    max_len = max_seq_len(gm)
    lengths = probe_lengths(max_len, size_hints(gm, [t.node for t in terms]))
    kind = classify_allowed(allowed_pairs(gm, terms, max(lengths)))
    names = ", ".join(t.node.name for t in terms)
    for n in lengths[:-1]:
        if not torch.equal(allowed_pairs(gm, terms, n), kind.allowed(n)):
            raise UnsupportedPatternError(
                f"mask {names} is {_describe(kind)} at {max(lengths)} tokens but not at {n} tokens: a pattern "
                f"that changes with the sequence length cannot use a KV cache")
    return kind


def max_seq_len(gm: fx.GraphModule) -> int:
    """The longest sequence the compiled graph will run (set by the compiler; else
    ``UNKNOWN_MAX_SEQ_LEN``)."""
    value = gm.meta.get("autodeploy_max_seq_len")
    return int(value) if value else UNKNOWN_MAX_SEQ_LEN


def probe_lengths(max_len: int, hints: Sequence[int]) -> list[int]:
    """The lengths a mask (or a position bias) is evaluated at; see the module docstring."""
    lengths = {min(SHORT_PROBE, max_len), min(max_len, FULL_EVAL_TOKENS)}
    for size in sorted(h for h in hints if 1 < h < max_len):
        if size + 1 > MAX_PROBE_TOKENS:
            raise UnsupportedPatternError(
                f"the mask is computed from a size of {size} tokens, too long to check by evaluation; compile "
                f"with max_seq_len <= {size} (then that size changes nothing) or check the model's masks")
        lengths.update((size + 1, min(2 * size + 1, max_len, MAX_PROBE_TOKENS)))
    return sorted(lengths)


def size_hints(gm: fx.GraphModule, nodes: Sequence[fx.Node]) -> list[int]:
    """Sizes the mask may change its structure at: those the config names (``autodeploy_size_hints``)
    and the integer constants and buffer sizes of the nodes' subgraphs."""
    hints = set(gm.meta.get("autodeploy_size_hints", ()))
    for node in {a for n in nodes for a in _ancestors(n)}:
        val = node.meta.get("val")
        if isinstance(val, torch.SymInt):  # a size computed from the token count: its constants
            hints.update(_integers(float(atom) for atom in val.node.expr.atoms(sympy.Number)))
        elif node.op == "get_attr":
            value = _attr(gm, node)
            hints.update(int(s) for s in value.shape)
            if value.numel() <= SMALL_CONSTANT:
                hints.update(_integers(value.flatten().tolist()))
        else:
            hints.update(_integers(pytree.tree_leaves((node.args, node.kwargs))))
    return sorted(h for h in hints if h > 1)


def _integers(values) -> set[int]:
    """The integral numbers among ``values``, as non-negative ints."""
    out = set()
    for value in values:
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) \
                and float(value).is_integer():
            out.add(abs(int(value)))
    return out


def allowed_pairs(gm: fx.GraphModule, terms: Sequence[MaskTerm], n: int) -> torch.Tensor:
    """The [n, n] pairs (query, key) every term allows, for one sequence of ``n`` tokens."""
    allowed = torch.ones(n, n, dtype=torch.bool)
    for term in terms:
        allowed &= _term_allowed(gm, _as_boolean(gm, term), n)
    return allowed


def _as_boolean(gm: fx.GraphModule, term: MaskTerm) -> MaskTerm:
    """An additive mask computed as ``where(condition, 0, very negative)`` (HF's masks) as the boolean
    term it selects with: the same pairs, a quarter of the memory and no float pass to check."""
    node = term.node
    if term.form != "additive" or node.target not in _WHERE or not isinstance(node.meta.get("val"), torch.Tensor):
        return term
    floor = torch.finfo(node.meta["val"].dtype).min / 2 if node.meta["val"].is_floating_point() else None
    condition, if_true, if_false = node.args[:3]
    if floor is None or not isinstance(condition, fx.Node):
        return term
    values = [_constant(gm, branch) for branch in (if_true, if_false)]
    if values[0] == 0 and values[1] is not None and values[1] <= floor:
        return MaskTerm(condition, "allowed")
    if values[1] == 0 and values[0] is not None and values[0] <= floor:
        return MaskTerm(condition, "blocked")
    return term


def _constant(gm: fx.GraphModule, value) -> float | None:
    """``value`` as a number if it is one (a literal, or a one-element tensor computed from constants)."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if not isinstance(value, fx.Node) or any(a.op == "placeholder" for a in _ancestors(value)):
        return None
    tensor = evaluate_for_length(gm, value, 1)
    return float(tensor) if isinstance(tensor, torch.Tensor) and tensor.numel() == 1 else None


def _term_allowed(gm: fx.GraphModule, term: MaskTerm, n: int) -> torch.Tensor:
    value = evaluate_for_length(gm, term.node, n)
    name = term.node.name
    if not isinstance(value, torch.Tensor) or value.dim() < 2 or value.shape[-1] != n or value.shape[-2] not in (1, n):
        raise UnsupportedPatternError(f"mask {name} does not evaluate to a [{n}, {n}] pattern")
    flat = value.expand(*value.shape[:-2], n, n).reshape(-1, n, n)
    if not all(torch.equal(flat[0], m) for m in flat[1:]):
        raise UnsupportedPatternError(f"mask {name} differs between batch rows or heads")
    m = flat[0]
    if term.form != "additive":
        if m.dtype != torch.bool:
            raise UnsupportedPatternError(f"mask {name} selects scores but is not boolean ({m.dtype})")
        return m if term.form == "allowed" else ~m
    if m.dtype == torch.bool:
        return m
    allowed, blocked = m == 0, m <= torch.finfo(m.dtype).min / 2
    if not bool((allowed | blocked).all()):
        raise UnsupportedPatternError(f"mask {name} adds a bias to attention scores (not a pure mask)")
    return allowed


def classify_allowed(allowed: torch.Tensor) -> MaskKind:
    """The kind whose [n, n] pattern ``allowed`` is (causal, sliding window or chunks), or an error."""
    n = allowed.shape[0]
    if bool(allowed.all()) and n > 1:
        raise UnsupportedPatternError("bidirectional (non-causal) attention cannot use a KV cache")
    # The first query that does not see key 0 is the window's width (it sees w keys) or the chunk's
    # (it sees only itself); the whole pattern is then compared with the candidates'.
    hidden_first = (~allowed[:, 0]).nonzero()
    candidates = [MaskKind(causal=True)]
    if len(hidden_first):
        row = int(hidden_first[0])
        seen = int(allowed[row].sum())
        candidates = [MaskKind(True, sliding_window=seen)] + ([MaskKind(True, chunk_size=row)] if seen == 1 else [])
    kind = next((k for k in candidates if torch.equal(allowed, k.allowed(n))), None)
    if kind is None:
        raise UnsupportedPatternError("attention mask is neither causal, a causal sliding window nor chunked")
    return kind


def _describe(kind: MaskKind) -> str:
    if kind.sliding_window:
        return f"a sliding window of {kind.sliding_window}"
    return f"chunked ({kind.chunk_size} tokens)" if kind.chunk_size else "causal"


def evaluate_for_length(gm: fx.GraphModule, target: fx.Node, n: int, full_precision: bool = False):
    """Evaluate ``target``'s ancestors with ``input_ids = 0`` and ``position_ids = arange(n)``.

    ``full_precision``: casts to 16-bit floats are evaluated as fp32 (a position bias is read exactly,
    not as the model's dtype rounds it)."""
    token_symbol = _token_symbol(gm)
    env: dict[fx.Node, object] = {}
    for node in _ancestors(target):
        env[node] = _evaluate_node(gm, node, env, token_symbol, n, full_precision)
    return env[target]


_HALF = (torch.float16, torch.bfloat16)


def _evaluate_node(gm, node: fx.Node, env, token_symbol, n: int, full_precision: bool):
    if node.op == "placeholder":
        if node.name == "position_ids":
            return torch.arange(n)
        if node.name == "input_ids":
            return torch.zeros(n, dtype=torch.int64)
        raise UnsupportedPatternError(f"mask depends on graph input {node.name}")
    if node.op == "get_attr":
        return _attr(gm, node)
    val = node.meta.get("val")
    if isinstance(val, torch.SymInt) and token_symbol is not None:
        return int(val.node.expr.subs({token_symbol: n}))
    args, kwargs = pytree.tree_map_only(fx.Node, lambda a: env[a], (node.args, dict(node.kwargs)))
    if "device" in kwargs:
        kwargs["device"] = torch.device("cpu")
    if full_precision:
        args, kwargs = pytree.tree_map_only(torch.dtype, lambda d: torch.float32 if d in _HALF else d, (args, kwargs))
    return node.target(*args, **kwargs)


def _attr(gm: fx.GraphModule, node: fx.Node) -> torch.Tensor:
    """A get_attr's value; a buffer still on meta is looked up among the real values the compiler
    kept (``autodeploy_buffer_values``: the model's non-persistent buffers)."""
    module_name, _, leaf = node.target.rpartition(".")
    value = getattr(gm.get_submodule(module_name) if module_name else gm, leaf)
    if isinstance(value, torch.Tensor) and value.device.type == "meta":
        value = gm.meta.get("autodeploy_buffer_values", {}).get(node.target)
        if value is None:
            raise UnsupportedPatternError(f"mask depends on weight {node.target}")
    return value


def _token_symbol(gm: fx.GraphModule):
    size = token_count(gm)
    return size.node.expr if isinstance(size, torch.SymInt) else None


def token_count(gm: fx.GraphModule):
    """The token dimension of the graph's inputs (a SymInt in the compiler's export), or None."""
    for node in gm.graph.find_nodes(op="placeholder"):
        val = node.meta.get("val")
        if node.name in ("input_ids", "position_ids") and isinstance(val, torch.Tensor):
            return val.shape[0]
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
