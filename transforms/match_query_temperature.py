"""match_query_temperature: Llama-4's query temperature, computed from the tokens' positions.

Llama-4 scales the queries of its NoPE layers by ``log1p(floor((pos + 1) / floor_scale)) * attn_scale
+ 1`` (attention temperature tuning), with ``pos = arange(seq_len) + past_seen_tokens``: the token's
position in its sequence. Exported in the flattened layout (one step's tokens of every sequence in one
dimension, no cache), that reads ``arange(T)``: right only for one sequence starting at position 0,
wrong for every chunked prefill and decode. The rule makes the scale read ``position_ids``, what
``arange(T) + past_seen_tokens`` is in HF's own cached generation.
"""

from __future__ import annotations

import torch

from autodeploy.graph.mask import token_count
from autodeploy.graph.matcher import Match, strip_transparent
from autodeploy.graph.rewrite import PatternSpec, RewriteRule

aten = torch.ops.aten
FLOOR_SCALE, ATTN_SCALE = 8191.5, 0.01234  # sentinels
_ARANGE = (aten.arange.default, aten.arange.start, aten.arange.start_step)


def query_temperature(positions, floor_scale, attn_scale):
    return torch.log1p(torch.floor((positions.float() + 1.0) / floor_scale)) * attn_scale + 1.0


class MatchQueryTemperature(RewriteRule):
    name = "match_query_temperature"
    required_ops = frozenset({aten.log1p.default, aten.floor.default})

    def patterns(self) -> list[PatternSpec]:
        return [PatternSpec(query_temperature, {"positions": torch.arange(5)},
                            {"floor_scale": FLOOR_SCALE, "attn_scale": ATTN_SCALE}, name="llama4 temperature")]

    def check(self, m: Match, gm) -> str | None:
        positions = strip_transparent(m["positions"])[0]
        if positions.op == "placeholder" and positions.name == "position_ids":
            return "already reads position_ids"
        if positions.target not in _ARANGE or not _counts_the_tokens(positions, gm):
            return f"positions {positions.name} are not arange over the step's tokens"
        return None

    def replacement_kwargs(self, m: Match, gm) -> dict:
        (position_ids,) = [n for n in gm.graph.find_nodes(op="placeholder") if n.name == "position_ids"]
        return {"positions": position_ids, "floor_scale": m["floor_scale"], "attn_scale": m["attn_scale"]}

    def verification_inputs(self, m: Match, values: dict) -> None:
        # the replacement reads position_ids where the matched code read arange(T): the same values here
        arange = strip_transparent(m["positions"])[0]
        (position_ids,) = [n for n in arange.graph.find_nodes(op="placeholder") if n.name == "position_ids"]
        values[position_ids] = torch.arange(values[m["positions"]].shape[0])
        values[m["positions"]] = values[position_ids].to(values[m["positions"]].dtype)

    def replacement(self, positions, floor_scale, attn_scale):
        scaled = aten.div.Tensor(aten.add.Tensor(aten._to_copy.default(positions, dtype=torch.float32), 1.0),
                                 floor_scale)
        return aten.add.Tensor(aten.mul.Tensor(aten.log1p.default(aten.floor.default(scaled)), attn_scale), 1.0)


def _counts_the_tokens(arange, gm) -> bool:
    """Whether ``arange`` is 0, 1, ... up to the step's token count (start 0, step 1)."""
    args = list(arange.args) if arange.target != aten.arange.default else [0, arange.args[0]]
    start, end, step = (args + [1])[:3]
    end_val = end.meta.get("val") if isinstance(end, torch.fx.Node) else end
    tokens = token_count(gm)
    same_count = isinstance(end_val, torch.SymInt) and isinstance(tokens, torch.SymInt) \
        and end_val.node.expr == tokens.node.expr
    return start == 0 and step == 1 and same_count
