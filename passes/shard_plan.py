"""The tensor-parallel plan: which parameter each rank slices, and where the collectives go.

Derived from the canonical graph alone (no weights, no ranks, no devices), so it can be printed
(``autodeploy compile MODEL --tp_size 2 --print-plan``) and tested anywhere:

- each ``autodeploy::attention``: the projections producing q, k and v (found by walking back from
  the op) are column-parallel by heads, the linear its output reaches is row-parallel, an
  ``all_reduce`` follows it; key/value heads fewer than the ranks are replicated in groups;
- each ``swiglu`` (gated MLP): gate and up column-parallel, down row-parallel, ``all_reduce`` after;
- each ``moe``: every expert split by its intermediate size (``tensor``) or whole experts per rank
  (``expert``), ``all_reduce`` after;
- plain MLPs (linear -> elementwise -> linear): the same column/row pair;
- the LM head, optionally: vocabulary-parallel, ``all_gather`` after.

A parameter the checkpoint stores fused (q/k/v in one projection, gate and up in one tensor) is
sharded per part: each rank holds its slice of every part. The groups are found by
``shard_groups.py``; every split is followed through the graph (``shard_split.SplitTracer``); what cannot be followed
exactly is an error naming the node. Parameters outside the groups stay whole on every rank.
"""

from __future__ import annotations

import fnmatch
from collections import Counter
from dataclasses import dataclass

from torch import fx

from .shard_groups import ShardGroup, find_groups


@dataclass(frozen=True)
class ShardPlan:
    tp_size: int
    groups: tuple[ShardGroup, ...]
    replicated: tuple[str, ...]
    notes: tuple[str, ...] = ()

    def lines(self) -> list[str]:
        out = [f"tensor-parallel plan over {self.tp_size} ranks"]
        for g in self.groups:
            out.append(f"{g.kind:<10} {g.name}  {g.detail}; {g.collective} after {', '.join(g.after)}")
            out.extend(f"  {p.role:<7} {p.name}  {list(p.shape)} -> {list(p.local_shape())}" for p in g.params)
        out.append(f"replicated ({len(self.replicated)}): {', '.join(self.replicated)}")
        out.extend(f"note: {n}" for n in self.notes)
        return out

    def summary(self) -> str:
        kinds: dict[str, int] = {}
        for g in self.groups:
            kinds[g.kind] = kinds.get(g.kind, 0) + 1
        first = next((g.detail for g in self.groups if g.kind == "attention"), "")
        parts = [f"{n} {k}" for k, n in kinds.items()]
        return f"{self.tp_size} ranks: {', '.join(parts)} ({first}); {len(self.replicated)} parameters replicated"


def derive_plan(gm: fx.GraphModule, world: int, *, lm_head: bool = True, moe: str = "tensor") -> ShardPlan:
    """The plan of ``gm`` (a canonical graph) over ``world`` ranks; :class:`ShardError` if it cannot be split."""
    groups, notes = find_groups(gm, world, lm_head=lm_head, moe=moe)
    notes.extend(_quantized_note(gm))
    order = {n.name: i for i, n in enumerate(gm.graph.nodes)}
    groups.sort(key=lambda g: order[g.after[0]])  # layer by layer, as the model runs
    sharded = {p.name for g in groups for p in g.params}
    used = {str(n.target) for n in gm.graph.find_nodes(op="get_attr")}
    replicated = tuple(name for name, _ in gm.named_parameters() if name in used and name not in sharded)
    return ShardPlan(world, tuple(groups), replicated, tuple(notes))


def _quantized_note(gm: fx.GraphModule) -> list[str]:
    """How many quantized linear ops the plan cuts (their scales are listed with their weights)."""
    ops = Counter(str(n.target._schema.name).removeprefix("autodeploy::") for n in gm.graph.nodes
                  if n.op == "call_function" and getattr(n.target, "_schema", None) is not None
                  and str(n.target._schema.name).startswith(("autodeploy::fp8_", "autodeploy::nvfp4_")))
    if not ops:
        return []
    counts = ", ".join(f"{count} {op}" for op, count in sorted(ops.items()))
    return [f"quantized linears ({counts}): scales cut with their weights, per-tensor scales whole on every rank"]


def hf_disagreements(plan: ShardPlan, hf_plan: dict[str, str] | None) -> list[str]:
    """Where the plan shards a linear weight against the model's own ``base_model_tp_plan``
    (``colwise``/``rowwise`` entries only): a cross-check, the plan stays ours."""
    if not hf_plan:
        return []
    expected = {"column": "colwise", "row": "rowwise"}
    out = []
    for shard in (p for g in plan.groups for p in g.params if p.role in expected and len(p.shape) == 2):
        module = shard.name.rsplit(".", 1)[0].removeprefix("model.")
        style = next((s for pattern, s in hf_plan.items() if fnmatch.fnmatchcase(module, pattern)), None)
        if style in ("colwise", "rowwise") and style != expected[shard.role]:
            out.append(f"{shard.name}: {shard.role}-parallel here, '{style}' in the model's base_model_tp_plan")
    return out
