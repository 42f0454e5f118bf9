"""Read ALiBi slopes off a position bias the model adds to its attention scores, by running it.

Bloom and MPT add a per-head bias that grows linearly with the key's position (``slope[h] * j``,
plus a constant per query row that softmax ignores) to the scores: ALiBi. Like a mask, the bias
node's subgraph is evaluated for one sequence of ``n`` tokens, at the lengths ``graph/mask.py``
proves masks at (``max_seq_len`` up to its evaluation limit, and across every size the bias is
computed from), in fp32 whatever the model's dtype (a bias rounded to bf16 is no longer linear; the
canonical op uses the exact slopes). The slopes are fitted at the longest length and every
evaluation must be ``slope[h] * j + c[h, i]`` on the pairs a causal query sees, or the compile stops.
"""

from __future__ import annotations

import torch
from torch import fx

from ..errors import UnsupportedPatternError
from ..export import set_tensor_attr
from .mask import evaluate_for_length, max_seq_len, probe_lengths, size_hints
from .meta import fake_mode_of

ATTR_PREFIX = "alibi_slopes"
RELATIVE_TOLERANCE = 1e-5  # of the bias's largest magnitude (fp32 evaluation)


def alibi_slopes(gm: fx.GraphModule, bias: fx.Node, num_heads: int) -> torch.Tensor:
    """The [num_heads] fp32 slopes of ``bias`` (broadcastable to [1, H, n, n] or [H, n, n] scores)."""
    lengths = [n for n in probe_lengths(max_seq_len(gm), size_hints(gm, [bias])) if n >= 2]
    if not lengths:
        raise UnsupportedPatternError(f"position bias {bias.name}: max_seq_len is too short to read its slopes")
    rows = {n: _bias_rows(gm, bias, n, num_heads) for n in lengths}
    longest = rows[max(lengths)]
    slopes = (longest[:, 0, -1] - longest[:, 0, 0]) / (longest.shape[-1] - 1)
    for n, values in rows.items():
        linear = values[:, :, :1] + slopes[:, None, None] * torch.arange(n, dtype=torch.float64)
        seen = _causal_pairs(values.shape[1], n)
        error = ((values - linear).abs() * seen).max()
        if error > RELATIVE_TOLERANCE * max(1.0, float(values.abs().max())):
            raise UnsupportedPatternError(
                f"position bias {bias.name} is not linear in the key position per head (ALiBi) at {n} tokens "
                f"(off by {float(error):.3g})")
    return slopes.float()


def _bias_rows(gm: fx.GraphModule, bias: fx.Node, n: int, num_heads: int) -> torch.Tensor:
    """The bias for ``n`` tokens as [H, rows, n] float64, rows 1 (the same for every query) or n."""
    value = evaluate_for_length(gm, bias, n, full_precision=True)
    if not isinstance(value, torch.Tensor) or value.dim() < 2 or value.shape[-1] != n or value.shape[-2] not in (1, n):
        raise UnsupportedPatternError(f"position bias {bias.name} does not evaluate to [heads, {n}, {n}] scores")
    rows = value.reshape(-1, value.shape[-2], n).double()
    if rows.shape[0] == 1:
        rows = rows.expand(num_heads, -1, -1)
    if rows.shape[0] != num_heads:
        raise UnsupportedPatternError(f"position bias {bias.name} has {rows.shape[0]} heads, not {num_heads}")
    return rows


def _causal_pairs(rows: int, n: int) -> torch.Tensor:
    """Which entries of a [rows, n] bias a causal query sees (a single row: the last query's, all)."""
    if rows == 1:
        return torch.ones(1, n, dtype=torch.float64)
    pos = torch.arange(n)
    return (pos[:, None] >= pos[None, :]).double()


def slopes_node(gm: fx.GraphModule, slopes: torch.Tensor) -> fx.Node:
    """A get_attr of a buffer holding ``slopes`` (one buffer per distinct set of slopes), at the top of
    the graph."""
    existing = gm.meta.setdefault("autodeploy_alibi_buffers", {})
    key = tuple(slopes.tolist())
    if key not in existing:
        existing[key] = f"{ATTR_PREFIX}_{len(existing)}"
        set_tensor_attr(gm, existing[key], slopes.clone(), as_parameter=False)
    with gm.graph.inserting_before(next(iter(gm.graph.nodes))):
        node = gm.graph.get_attr(existing[key])
    node.meta["val"] = fake_mode_of(gm).from_tensor(slopes)
    return node
