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

Every split is followed through the graph (``shard_split.SplitTracer``); what cannot be followed
exactly is an error naming the node. Parameters outside the groups stay whole on every rank.
"""

from __future__ import annotations

import fnmatch
import operator
import os
from dataclasses import dataclass

import torch
from torch import fx

from .gather_logits import find_lm_head
from .shard_split import LiteralFix, ShardError, Split, SplitTracer, Traced, is_param, linear_parts, val

AD = torch.ops.autodeploy


@dataclass(frozen=True)
class Part:
    """``size`` entries from ``start`` along a sharded dimension, cut into ``factor`` equal blocks;
    rank r of ``world`` holds block ``r * factor // world`` (fewer blocks than ranks: replicated)."""

    start: int
    size: int
    factor: int

    def local(self, rank: int, world: int) -> tuple[int, int]:
        block = self.size // self.factor
        return self.start + (rank * self.factor // world) * block, block


@dataclass(frozen=True)
class ParamShard:
    """One parameter (named as in the checkpoint) sliced along ``dim``; ``role`` says why."""

    name: str
    role: str  # column | row | expert | vocab | head
    shape: tuple[int, ...]
    dim: int
    parts: tuple[Part, ...]

    def local_shape(self) -> tuple[int, ...]:
        shape = list(self.shape)
        shape[self.dim] = sum(p.size // p.factor for p in self.parts)
        return tuple(shape)

    def read(self, source, rank: int, world: int) -> torch.Tensor:
        """This rank's slice of ``source``: a safetensors lazy slice (only the slice is read) or a tensor."""
        shape = tuple(source.get_shape()) if hasattr(source, "get_shape") else tuple(source.shape)
        if shape != self.shape:
            raise RuntimeError(f"{self.name}: checkpoint shape {shape} != planned {self.shape}")
        pieces = []
        for start, length in (p.local(rank, world) for p in self.parts):
            index = [slice(None)] * len(shape)
            index[self.dim] = slice(start, start + length)
            pieces.append(source[tuple(index)])
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=self.dim)


@dataclass(frozen=True)
class ShardGroup:
    """One sharded block of the model: its parameters and the collective that completes it."""

    kind: str  # attention | gated_mlp | mlp | moe | lm_head
    name: str  # module path
    params: tuple[ParamShard, ...]
    collective: str  # all_reduce | all_gather
    after: tuple[str, ...]  # nodes whose outputs the collective completes
    detail: str
    fixes: tuple[LiteralFix, ...] = ()
    experts: int = 0  # moe by expert: experts per rank (their ids are remapped per rank)


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
    tracer = SplitTracer(gm, world)
    groups: list[ShardGroup] = []
    for node in gm.graph.find_nodes(op="call_function", target=AD.attention.default):
        groups.append(_attention_group(tracer, node, world))
    for node in gm.graph.find_nodes(op="call_function", target=AD.swiglu.default):
        groups.append(_gated_mlp_group(node, world))
    for node in gm.graph.find_nodes(op="call_function", target=AD.moe.default):
        groups.append(_moe_group(node, world, moe))
    notes: list[str] = []
    groups.extend(_plain_mlp_groups(gm, tracer, world, groups, notes))
    if lm_head:
        groups.extend(_lm_head_group(gm, world, notes))
    order = {n.name: i for i, n in enumerate(gm.graph.nodes)}
    groups.sort(key=lambda g: order[g.after[0]])  # layer by layer, as the model runs
    sharded = {p.name for g in groups for p in g.params}
    used = {str(n.target) for n in gm.graph.find_nodes(op="get_attr")}
    replicated = tuple(name for name, _ in gm.named_parameters() if name in used and name not in sharded)
    return ShardPlan(world, tuple(groups), replicated, tuple(notes))


def _attention_group(tracer: SplitTracer, node: fx.Node, world: int) -> ShardGroup:
    q, k, v = node.args[:3]
    heads, kv_heads = int(val(q).shape[2]), int(val(k).shape[2])
    if heads % world:
        raise ShardError(f"{node.name}: {heads} attention heads cannot be split over {world} ranks")
    kv_factor = world if kv_heads % world == 0 else kv_heads
    if world % kv_heads and kv_heads % world:
        raise ShardError(f"{node.name}: {kv_heads} key/value heads can neither be split over nor replicated "
                         f"across {world} ranks")
    seeds: dict[fx.Node, Split] = {}
    for tensor, factor in ((q, world), (k, kv_factor), (v, kv_factor)):
        linear = _source_linear(tensor, node)
        split = Split(val(linear).dim() - 1, factor)
        if seeds.setdefault(linear, split) != split:
            raise ShardError(f"{linear.name}: one projection feeds q and replicated key/value heads "
                             f"({kv_heads} kv heads over {world} ranks)")
    traced = tracer.trace(seeds)
    if len(traced.sinks) != 1:
        raise ShardError(f"{node.name}: the attention output reaches {len(traced.sinks)} linears, expected one")
    detail = f"heads {heads} -> {heads // world}, kv heads {kv_heads} -> {kv_heads // kv_factor}"
    return _linear_group("attention", seeds, traced, detail)


def _linear_group(kind: str, seeds: dict[fx.Node, Split], traced: Traced, detail: str) -> ShardGroup:
    params = [shard for linear, split in seeds.items() for shard in _column_params(linear, split)]
    for sink in traced.sinks:
        params.extend(_row_params(sink, traced.sink_splits[sink.name]))
    gm_params = dict(next(iter(seeds)).graph.owning_module.named_parameters())
    for name, (dim, factor) in traced.params.items():
        shape = tuple(gm_params[name].shape)
        params.append(ParamShard(name, "head", shape, dim, (Part(0, shape[dim], factor),)))
    return ShardGroup(kind, _module_of(params), tuple(params), "all_reduce",
                      tuple(s.name for s in traced.sinks), detail, tuple(traced.fixes))


def _column_params(linear: fx.Node, split: Split) -> list[ParamShard]:
    parts = linear_parts(linear)
    out_features = val(parts["weight"]).shape[0]
    shards = []
    for key, arg in parts.items():
        if key == "input" or not is_param(arg):
            continue
        shape = tuple(val(arg).shape)
        if shape and shape[0] == out_features and len(shape) <= 2:
            shards.append(ParamShard(str(arg.target), "column", shape, 0, (Part(0, shape[0], split.factor),)))
        elif key in ("weight", "bias"):
            raise ShardError(f"{linear.name}: cannot shard its {key} of shape {list(shape)}")
    return shards


def _row_params(linear: fx.Node, split: Split) -> list[ParamShard]:
    """The weight (and 2-d per-block scales) along the input features; bias and per-channel scales whole."""
    parts = linear_parts(linear)
    out_features = val(parts["weight"]).shape[0]
    shards = []
    for key, arg in parts.items():
        if key in ("input", "bias") or not is_param(arg):
            continue
        shape = tuple(val(arg).shape)
        if len(shape) == 2 and shape[0] == out_features:
            if shape[1] % split.factor:
                raise ShardError(f"{linear.name}: {key} of shape {list(shape)} cannot be cut in {split.factor}")
            shards.append(ParamShard(str(arg.target), "row", shape, 1, (Part(0, shape[1], split.factor),)))
    return shards


def _source_linear(tensor: fx.Node, attention: fx.Node) -> fx.Node:
    """The linear producing an attention input, through layout ops, RoPE, norms and casts."""
    node = tensor
    while isinstance(node, fx.Node) and linear_parts(node) is None:
        node = _data_operand(node)
    if node is None:
        raise ShardError(f"{attention.name}: cannot find the projection that produces {tensor.name}")
    return node


def _data_operand(node: fx.Node) -> fx.Node | None:
    """The operand a layout/elementwise op carries forward: the one shaped like its output (not a weight)."""
    if node.op != "call_function":
        return None
    source = node.args[0]
    if node.target is operator.getitem and isinstance(source, fx.Node):
        return source.args[0] if source.op == "call_function" else None
    candidates = [a for a in node.args if isinstance(a, fx.Node) and not is_param(a) and val(a) is not None]
    out = val(node)
    for a in candidates:
        if isinstance(out, torch.Tensor) and a.meta["val"].shape == out.shape:
            return a
    return candidates[0] if candidates else None


def _gated_mlp_group(node: fx.Node, world: int) -> ShardGroup:
    x, w_gate, w_up, w_down = node.args[:4]
    if not all(is_param(w) and len(w.users) == 1 for w in (w_gate, w_up, w_down)):
        raise ShardError(f"{node.name}: gate/up/down weights that are not plain parameters (e.g. gate and up "
                         "stored as one tensor) are not sharded yet")
    inter = int(val(w_gate).shape[0])
    _divisible(node, "intermediate size", inter, world)
    params = (
        ParamShard(str(w_gate.target), "column", tuple(val(w_gate).shape), 0, (Part(0, inter, world),)),
        ParamShard(str(w_up.target), "column", tuple(val(w_up).shape), 0, (Part(0, inter, world),)),
        ParamShard(str(w_down.target), "row", tuple(val(w_down).shape), 1, (Part(0, inter, world),)),
    )
    return ShardGroup("gated_mlp", _module_of(params), params, "all_reduce", (node.name,),
                      f"intermediate {inter} -> {inter // world}")


def _moe_group(node: fx.Node, world: int, mode: str) -> ShardGroup:
    w_gate_up, w_down = node.args[3:5]
    if not (is_param(w_gate_up) and is_param(w_down)):
        raise ShardError(f"{node.name}: expert weights that are not parameters")
    experts, inter = int(val(w_down).shape[0]), int(val(w_down).shape[2])
    gu_shape, down_shape = tuple(val(w_gate_up).shape), tuple(val(w_down).shape)
    if mode == "expert":
        _divisible(node, "number of experts", experts, world)
        params = (ParamShard(str(w_gate_up.target), "expert", gu_shape, 0, (Part(0, experts, world),)),
                  ParamShard(str(w_down.target), "expert", down_shape, 0, (Part(0, experts, world),)))
        return ShardGroup("moe", _module_of(params), params, "all_reduce", (node.name,),
                          f"experts {experts} -> {experts // world} per rank", experts=experts // world)
    _divisible(node, "expert intermediate size", inter, world)
    params = (ParamShard(str(w_gate_up.target), "column", gu_shape, 1, (Part(0, inter, world), Part(inter, inter, world))),
              ParamShard(str(w_down.target), "row", down_shape, 2, (Part(0, inter, world),)))
    return ShardGroup("moe", _module_of(params), params, "all_reduce", (node.name,),
                      f"{experts} experts, intermediate {inter} -> {inter // world}")


def _plain_mlp_groups(gm, tracer: SplitTracer, world: int, groups: list[ShardGroup], notes: list[str]):
    claimed = {p.name for g in groups for p in g.params}
    lm_head = _find_lm_head(gm)
    for node in list(gm.graph.nodes):
        parts = linear_parts(node)
        if parts is None or node is lm_head or str(getattr(parts["weight"], "target", "")) in claimed:
            continue
        sources = _mlp_sources(parts["input"])
        if not sources or any(str(linear_parts(s)["weight"].target) in claimed for s in sources):
            continue
        try:
            for s in sources:
                _divisible(s, "output features", int(val(s).shape[-1]), world)
            seeds = {s: Split(val(s).dim() - 1, world) for s in sources}
            traced = tracer.trace(seeds)
        except ShardError as exc:
            notes.append(f"{node.name} and {', '.join(s.name for s in sources)} stay replicated: {exc}")
            continue
        if traced.sinks != [node]:
            continue
        group = _linear_group("mlp", seeds, traced, f"intermediate {val(sources[0]).shape[-1]} -> "
                                                    f"{val(sources[0]).shape[-1] // world}")
        claimed |= {p.name for p in group.params}
        yield group


def _mlp_sources(x) -> list[fx.Node] | None:
    """The linears whose outputs alone make ``x`` through elementwise ops (activation, gating)."""
    from .shard_split import _ELEMENTWISE, _SAME

    stack, seen, found = [x], set(), []
    while stack:
        node = stack.pop()
        if not isinstance(node, fx.Node) or node in seen:
            continue
        seen.add(node)
        if linear_parts(node) is not None:
            found.append(node)
        elif node.op == "call_function" and node.target in _ELEMENTWISE | _SAME:
            stack.extend(a for a in node.args if isinstance(a, fx.Node) and not is_param(a))
        else:
            return None
    return found


def _find_lm_head(gm) -> fx.Node | None:
    try:
        return find_lm_head(gm)
    except RuntimeError:
        return None


def _lm_head_group(gm, world: int, notes: list[str]):
    head = _find_lm_head(gm)
    parts = linear_parts(head) if head is not None else None
    if parts is None:
        notes.append("LM head not found: replicated")
        return
    weight = parts["weight"]
    vocab = int(val(weight).shape[0])
    if not is_param(weight) or len(gm.graph.find_nodes(op="get_attr", target=weight.target)) != 1 or len(weight.users) != 1:
        notes.append("LM head replicated: its weight is shared (tied to the embedding)")
        return
    if vocab % world:
        notes.append(f"LM head replicated: vocabulary {vocab} is not divisible by {world}")
        return
    params = tuple(_column_params(head, Split(val(head).dim() - 1, world)))
    yield ShardGroup("lm_head", _module_of(params), params, "all_gather", (head.name,),
                     f"vocabulary {vocab} -> {vocab // world}")


def _divisible(node: fx.Node, what: str, size: int, world: int) -> None:
    if size % world:
        raise ShardError(f"{node.name}: {what} {size} cannot be split over {world} ranks")


def _module_of(params) -> str:
    modules = [p.name.split(".")[:-1] for p in params]
    common = os.path.commonprefix(modules)
    return ".".join(common) or params[0].name


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
