"""match_lightning_attention: MiniMax's lightning attention, as export sees it -> ``lightning_attention``.

HF's ``MiniMaxLightningAttention`` runs without a cache in blocks of ``block_size`` tokens: a Python
loop over ``ceil(T / block_size)`` blocks, each an intra-block term ``((q k^T) * diagonal_decay) v``
and an inter-block term ``(q * query_decay) @ kv`` with the running state ``kv`` (zeros before the
first block), then the state carried to the next block. Export sees a step of fewer tokens than a
block (8 against MiniMax's 256), so the loop runs once: the graph holds the first block from the zero
state, every slice cut at ``min(block_size, T)``, and the state update is dead code. That graph is
wrong for a step longer than a block (it drops the tokens past the first block) and keeps no state
between steps; the pattern is that one block, written as the eager code it is, and the replacement
is the recurrence it computes over all T rows as one sequence, ``lightning_attention``, whose state
the state pool keeps later. transformers 5.17 makes the zero state and moves it to the values' dtype
(``.to(v)``), 5.25 makes it in that dtype: two spellings of one pattern.

The per-head slopes (decay ``exp(-slope)`` per token) are the layer's ``slope_rate`` buffer, beside its
``query_decay``: export dropped it (it feeds only the dead state update), so the rule reads it into the
graph again (loaded from the checkpoint like the other buffers). Reading them off the decays instead
(``query_decay[h, 0] = exp(-slope_h)``) would lose them in bf16: exp(-0.01) rounds to within 2^-8 of
1, a fifth of the slope. A layer without that buffer, or exported over more than one block
(``block_size`` below the export's token count), does not match, and ``check_uncached_state`` refuses it.
"""

from __future__ import annotations

import torch
from torch import fx

from autodeploy.export import get_tensor_attr
from autodeploy.graph.matcher import Match
from autodeploy.graph.meta import fake_mode_of
from autodeploy.graph.rewrite import PatternSpec, RewriteRule

aten = torch.ops.aten
# the slices are cut at the block: more tokens and longer decay buffers than that, so export keeps them
_BLOCK, _TOKENS, _BUFFER, _HEADS, _HEAD_DIM = 4, 5, 6, 2, 3


def _first_block(q, k, v, query_decay, diagonal_decay, state):
    """HF's block loop at its first block, from the zero ``state``; q/k/v [1, H, T, D]."""
    end = min(_BLOCK, q.shape[2])
    q, k, v = q[:, :, 0:end], k[:, :, 0:end], v[:, :, 0:end]
    q_decay = query_decay[:, :end]
    diagonal = diagonal_decay[:, :, :end, :end]
    intra = torch.matmul(torch.matmul(q, k.transpose(-1, -2)) * diagonal, v)
    inter = torch.matmul(q * q_decay, state)
    return torch.cat([inter + intra], dim=-2)


def first_block_zeros_to(q, k, v, query_decay, diagonal_decay):
    """transformers 5.17: the zero state made, then moved to the values' dtype."""
    batch, heads, _, head_dim = q.shape
    state = torch.zeros(batch, heads, head_dim, head_dim).to(v)
    return _first_block(q, k, v, query_decay, diagonal_decay, state)


def first_block_zeros_like(q, k, v, query_decay, diagonal_decay):
    """transformers 5.25: the zero state made in the values' dtype and device."""
    batch, heads, _, head_dim = q.shape
    state = torch.zeros(batch, heads, head_dim, head_dim, device=v.device, dtype=v.dtype)
    return _first_block(q, k, v, query_decay, diagonal_decay, state)


def decay_buffers(slopes: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``query_decay`` [H, block, 1] and ``diagonal_decay`` [1, H, block, block] of per-head slopes, as
    HF builds them (the values the numerical verification gives the matched buffers)."""
    position = torch.arange(block, dtype=torch.float32) + 1
    query_decay = torch.exp(-slopes[:, None, None] * position[:, None])
    gap = position[:, None] - position[None, :]
    diagonal = torch.exp(-slopes[:, None, None] * gap.clamp(min=0)) * (gap >= 0)
    return query_decay, diagonal[None]


class MatchLightningAttention(RewriteRule):
    name = "match_lightning_attention"
    required_ops = frozenset({aten.matmul.default, aten.cat.default})

    def patterns(self) -> list[PatternSpec]:
        q, k, v = (torch.randn(1, _HEADS, _TOKENS, _HEAD_DIM) for _ in range(3))
        query_decay, diagonal_decay = decay_buffers(torch.rand(_HEADS), _BUFFER)
        inputs = {"q": q, "k": k, "v": v, "query_decay": query_decay, "diagonal_decay": diagonal_decay}
        ignored = {aten.slice.Tensor: {"end"}, aten.zeros.default: {"size", "dtype", "device"},
                   aten.to.device: {"device", "dtype"}}  # the model's dtype and (export's) device
        spellings = (first_block_zeros_to, first_block_zeros_like)
        return [PatternSpec(fn, inputs, ignored=ignored, name=fn.__name__) for fn in spellings]

    def check(self, m: Match, gm) -> str | None:
        q, query_decay = m["q"].meta["val"], m["query_decay"].meta["val"]
        if q.shape[0] != 1:
            return f"not one sequence (q {tuple(q.shape)})"
        if m["query_decay"].op != "get_attr" or m["diagonal_decay"].op != "get_attr":
            return "the decays are not the layer's buffers"
        if query_decay.dim() != 3 or query_decay.shape[0] != q.shape[1]:
            return f"query_decay {tuple(query_decay.shape)} is not one row of decays per head"
        slopes = _slope_buffer(gm, m)
        if slopes is None or slopes.numel() != q.shape[1]:
            return f"no slope_rate buffer of one slope per head beside {m['query_decay'].target}"
        return None

    def replacement_kwargs(self, m: Match, gm) -> dict:
        buffer = _slope_buffer(gm, m)
        with gm.graph.inserting_before(m.anchor):
            node = gm.graph.create_node("get_attr", _slope_name(m))
        with fake_mode_of(gm):
            node.meta["val"] = torch.empty(buffer.shape, dtype=buffer.dtype)
        return {**m.bindings, "slope_rate": node}

    def verification_inputs(self, m: Match, values: dict) -> None:
        """Decays and slopes of one random set of slopes (the slopes' node: the one replacement_kwargs made)."""
        query_decay = values[m["query_decay"]]
        slopes = torch.rand(query_decay.shape[0]) * 0.5 + 0.05
        values[m["query_decay"]], values[m["diagonal_decay"]] = decay_buffers(slopes, query_decay.shape[1])
        slope_node = m.anchor.graph.find_nodes(op="get_attr", target=_slope_name(m))[-1]
        values[slope_node] = slopes[:, None, None]

    def replacement(self, q, k, v, query_decay, diagonal_decay, slope_rate):
        slopes = aten.reshape.default(slope_rate, [-1])
        rows = [aten.squeeze.dim(aten.transpose.int(t, 1, 2), 0) for t in (q, k, v)]  # [T, H, D]
        out = torch.ops.autodeploy.lightning_attention.default(*rows, slopes)
        return aten.transpose.int(aten.unsqueeze.default(out, 0), 1, 2)


def _slope_name(m: Match) -> str:
    """The ``slope_rate`` buffer of the module whose ``query_decay`` the match read."""
    module = m["query_decay"].target.rpartition(".")[0]
    return f"{module}.slope_rate" if module else "slope_rate"


def _slope_buffer(gm: fx.GraphModule, m: Match) -> torch.Tensor | None:
    try:
        return get_tensor_attr(gm, _slope_name(m))
    except AttributeError:
        return None
