"""The sharded groups of a model: their records, and how they are found in the canonical graph.

A group is one block that tensor parallelism splits and one collective completes: an attention
(its q/k/v projections by heads, its output projection by input features), a gated MLP (``swiglu``),
an MoE (``moe``: by intermediate size or by expert), a plain MLP (linear -> elementwise -> linear),
the LM head (by vocabulary). Projections are found by walking the graph from the canonical ops, and
every split is followed to where it is summed (``shard_split.SplitTracer``). A parameter stored
fused (q, k and v in one projection whose output is sliced; gate and up as two slices of one
tensor) is sharded per part, and the slices' bounds become the local ones (:class:`SliceFix`).
"""

from __future__ import annotations

import operator
import os
from dataclasses import dataclass

import torch
from torch import fx

from autodeploy.graph.matcher import schema_values

from .gather_logits import find_lm_head
from .shard_linears import Part, ParamShard, column_params, row_params
from .shard_split import (
    ELEMENTWISE_OPS,
    SAME_SPLIT_OPS,
    Fix,
    ShardError,
    SliceFix,
    Split,
    SplitTracer,
    Traced,
    is_param,
    linear_parts,
    op_arguments,
    val,
)

aten = torch.ops.aten
AD = torch.ops.autodeploy


@dataclass(frozen=True)
class ShardGroup:
    """One sharded block of the model: its parameters and the collective that completes it."""

    kind: str  # attention | gated_mlp | mlp | moe | lm_head
    name: str  # module path
    params: tuple[ParamShard, ...]
    collective: str  # all_reduce | all_gather
    after: tuple[str, ...]  # nodes whose outputs the collective completes
    detail: str
    fixes: tuple[Fix, ...] = ()
    experts: int = 0  # moe by expert: experts per rank (their ids are remapped per rank)



def find_groups(gm: fx.GraphModule, world: int, *, lm_head: bool, moe: str) -> tuple[list[ShardGroup], list[str]]:
    """Every group of ``gm`` over ``world`` ranks, and notes on what stays replicated and why."""
    tracer = SplitTracer(gm, world)
    groups = [_attention_group(tracer, n, world) for n in gm.graph.find_nodes(op="call_function", target=AD.attention.default)]
    groups += [_gated_mlp_group(n, world) for n in gm.graph.find_nodes(op="call_function", target=AD.swiglu.default)]
    groups += [_quantized_gated_mlp_group(n, world) for n in gm.graph.nodes if n.target in QUANTIZED_SWIGLU_DOWN]
    groups += [_moe_group(n, world, moe) for n in gm.graph.find_nodes(op="call_function", target=AD.moe.default)]
    notes: list[str] = []
    groups.extend(_plain_mlp_groups(gm, tracer, world, groups, notes))
    if lm_head:
        groups.extend(_lm_head_group(gm, world, notes))
    sharded = {p.name for g in groups for p in g.params}
    whole = [n.name for n in gm.graph.nodes if (a := linear_parts(n)) and str(getattr(a["weight"], "target", "")) not in sharded]
    if whole:
        notes.append(f"{len(whole)} linear layers stay whole on every rank (e.g. routers): {', '.join(whole[:6])}")
    return groups, notes


def _attention_group(tracer: SplitTracer, node: fx.Node, world: int) -> ShardGroup:
    q, k, v = node.args[:3]
    heads, kv_heads = int(val(q).shape[2]), int(val(k).shape[2])
    if heads % world:
        raise ShardError(f"{node.name}: {heads} attention heads cannot be split over {world} ranks")
    kv_factor = world if kv_heads % world == 0 else kv_heads
    if world % kv_heads and kv_heads % world:
        raise ShardError(f"{node.name}: {kv_heads} key/value heads can neither be split over nor replicated "
                         f"across {world} ranks")
    uses: dict[fx.Node, dict[fx.Node | None, int]] = {}  # projection -> {its output slice or None: factor}
    for tensor, factor in ((q, world), (k, kv_factor), (v, kv_factor)):
        linear, child = _source_linear(tensor, node)
        part = child if _slices_along(child, linear, val(linear).dim() - 1) else None
        if uses.setdefault(linear, {}).setdefault(part, factor) != factor:
            raise ShardError(f"{linear.name}: one projection feeds q and replicated key/value heads "
                             f"({kv_heads} kv heads over {world} ranks)")
    seeds, columns, fixes = {}, {}, []
    for linear, parts in uses.items():
        last = val(linear).dim() - 1
        if None in parts:  # one projection, or one whose output is viewed into q, k and v per head
            seeds[linear], columns[linear] = Split(last, parts[None]), (Part(0, val(linear).shape[-1], parts[None]),)
            continue
        columns[linear], slice_fixes = _fused_parts(linear, parts, last)
        seeds.update({s: Split(last, f) for s, f in parts.items()})
        fixes += slice_fixes
    traced = tracer.trace(seeds)
    if len(traced.sinks) != 1:
        raise ShardError(f"{node.name}: the attention output reaches {len(traced.sinks)} linears, expected one")
    detail = f"heads {heads} -> {heads // world}, kv heads {kv_heads} -> {kv_heads // kv_factor}"
    return _linear_group("attention", columns, traced, detail, world, fixes)


def _linear_group(kind: str, columns: dict[fx.Node, tuple[Part, ...]], traced: Traced, detail: str, world: int,
                  fixes: list[Fix] = ()) -> ShardGroup:
    params = [shard for linear, parts in columns.items() for shard in column_params(linear, parts, world)]
    for sink in traced.sinks:
        args = linear_parts(sink)
        params.extend(row_params(args, int(val(args["input"]).shape[-1]), traced.sink_splits[sink.name].factor, world))
    gm_params = dict(next(iter(columns)).graph.owning_module.named_parameters())
    for name, (dim, factor) in traced.params.items():
        shape = tuple(gm_params[name].shape)
        params.append(ParamShard(name, "head", shape, dim, (Part(0, shape[dim], factor),)))
    return ShardGroup(kind, _module_of(params), tuple(params), "all_reduce",
                      tuple(s.name for s in traced.sinks), detail, (*fixes, *traced.fixes))


def _source_linear(tensor: fx.Node, attention: fx.Node) -> tuple[fx.Node, fx.Node]:
    """The linear producing an attention input (through layout ops, RoPE, norms and casts), and the
    node after it on the way."""
    node, child = tensor, tensor
    while isinstance(node, fx.Node) and linear_parts(node) is None:
        node, child = _data_operand(node), node
    if node is None:
        raise ShardError(f"{attention.name}: cannot find the projection that produces {tensor.name} "
                         f"(the walk back stops at {child.name}, {child.target})")
    return node, child


def _data_operand(node: fx.Node) -> fx.Node | None:
    """The operand a layout/elementwise op carries forward: the one shaped like its output (not a weight)."""
    if node.op != "call_function":
        return None
    source = node.args[0]
    if node.target is operator.getitem and isinstance(source, fx.Node):
        return source.args[0] if source.op == "call_function" else None
    if node.target == aten.cat.default:  # e.g. partial rotary: rotated part + the rest
        return source[0]
    candidates = [a for a in node.args if isinstance(a, fx.Node) and not is_param(a) and val(a) is not None]
    out = val(node)
    for a in candidates:
        if isinstance(out, torch.Tensor) and a.meta["val"].shape == out.shape:
            return a
    return candidates[0] if candidates else None


def _slices_along(node, source: fx.Node, dim: int) -> bool:
    return (isinstance(node, fx.Node) and node.target == aten.slice.Tensor and node.args[0] is source
            and (node.args[1] if len(node.args) > 1 else 0) % val(source).dim() == dim)


def _fused_parts(source: fx.Node, factors: dict[fx.Node, int], dim: int) -> tuple[tuple[Part, ...], list[SliceFix]]:
    """``source`` read only through ``factors``' slices along ``dim``, covering it in order: one part
    per slice, and the slices' bounds in the rank's local layout (each part's share, one after the other)."""
    size = int(val(source).shape[dim])
    if set(source.users) != set(factors):
        raise ShardError(f"{source.name}: a fused projection read beyond its q/k/v (or gate/up) slices")
    bounds = sorted((min(s.args[2] or 0, size), min(s.args[3], size), s) for s in factors)
    parts, fixes, local = [], [], 0
    for expected, (start, end, piece) in zip([0] + [b[1] for b in bounds], bounds):
        factor = factors[piece]
        if start != expected or (end - start) % factor:
            raise ShardError(f"{piece.name}: fused parts that do not tile {source.name} in whole blocks")
        parts.append(Part(start, end - start, factor))
        fixes.append(SliceFix(piece.name, local, local + (end - start) // factor))
        local += (end - start) // factor
    if bounds[-1][1] != size:
        raise ShardError(f"{source.name}: its slices do not cover it")
    return tuple(parts), fixes


def _gated_mlp_group(node: fx.Node, world: int) -> ShardGroup:
    w_gate, w_up, w_down = node.args[1:4]
    if not is_param(w_down) or len(w_down.users) != 1:
        raise ShardError(f"{node.name}: a down projection that is not a parameter of its own")
    inter = int(val(w_gate).shape[0])
    _divisible(node, "intermediate size", inter, world)
    fused = w_gate.args[0] if w_gate.target == aten.slice.Tensor else None
    if is_param(fused) and _slices_along(w_gate, fused, 0) and _slices_along(w_up, fused, 0):  # one tensor
        parts, fixes = _fused_parts(fused, {w_gate: world, w_up: world}, 0)
        columns = [ParamShard(str(fused.target), "column", tuple(val(fused).shape), 0, parts)]
    elif all(is_param(w) and len(w.users) == 1 for w in (w_gate, w_up)):
        columns, fixes = [ParamShard(str(w.target), "column", tuple(val(w).shape), 0, (Part(0, inter, world),))
                          for w in (w_gate, w_up)], []
    else:
        raise ShardError(f"{node.name}: gate/up weights that are neither parameters nor slices of one")
    params = (*columns, ParamShard(str(w_down.target), "row", tuple(val(w_down).shape), 1, (Part(0, inter, world),)))
    return ShardGroup("gated_mlp", _module_of(params), params, "all_reduce", (node.name,),
                      f"intermediate {inter} -> {inter // world}", tuple(fixes))


QUANTIZED_SWIGLU_DOWN = (AD.fp8_swiglu_down.default, AD.nvfp4_swiglu_down.default)


def _quantized_gated_mlp_group(node: fx.Node, world: int) -> ShardGroup:
    """A quantized gated MLP (the quantize pass's form): one GEMM on the stacked gate/up rows,
    column-parallel per part (each rank keeps its gate rows, then its up rows), and the fused
    ``act(gate) * up`` + down projection, row-parallel."""
    gate_up = node.args[0]
    if linear_parts(gate_up) is None or len(gate_up.users) != 1:
        raise ShardError(f"{node.name}: its gate/up input is not a linear of its own")
    inter = int(val(gate_up).shape[-1]) // 2
    _divisible(node, "intermediate size", inter, world)
    columns = column_params(gate_up, (Part(0, inter, world), Part(inter, inter, world)), world)
    params = (*columns, *row_params(op_arguments(node), inter, world, world))
    return ShardGroup("gated_mlp", _module_of(params), params, "all_reduce", (node.name,),
                      f"intermediate {inter} -> {inter // world}")


def _moe_group(node: fx.Node, world: int, mode: str) -> ShardGroup:
    w_gate_up, w_down = node.args[3:5]
    layout = {k: v for k, v in schema_values(node) if k in _MOE_LAYOUT_OPTIONS and v not in (None, False)}
    if layout:
        raise ShardError(f"{node.name}: experts with {', '.join(sorted(layout))} (gpt-oss's layout) cannot be "
                         "sharded yet; run them with tp_size 1")
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


_MOE_LAYOUT_OPTIONS = ("b_gate_up", "b_down", "transposed", "interleaved")


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
            traced = tracer.trace({s: Split(val(s).dim() - 1, world) for s in sources})
        except ShardError as exc:
            notes.append(f"{node.name} and {', '.join(s.name for s in sources)} stay replicated: {exc}")
            continue
        if traced.sinks != [node]:
            continue
        inter = int(val(sources[0]).shape[-1])
        columns = {s: (Part(0, int(val(s).shape[-1]), world),) for s in sources}
        group = _linear_group("mlp", columns, traced, f"intermediate {inter} -> {inter // world}", world)
        claimed |= {p.name for p in group.params}
        yield group


def _mlp_sources(x) -> list[fx.Node] | None:
    """The linears whose outputs alone make ``x`` through elementwise ops (activation, gating)."""
    stack, seen, found = [x], set(), []
    while stack:
        node = stack.pop()
        if not isinstance(node, fx.Node) or node in seen:
            continue
        seen.add(node)
        if linear_parts(node) is not None:
            found.append(node)
        elif node.op == "call_function" and node.target in ELEMENTWISE_OPS | SAME_SPLIT_OPS:
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
    params = tuple(column_params(head, (Part(0, vocab, world),), world))
    yield ShardGroup("lm_head", _module_of(params), params, "all_gather", (head.name,),
                     f"vocabulary {vocab} -> {vocab // world}")


def _divisible(node: fx.Node, what: str, size: int, world: int) -> None:
    if size % world:
        raise ShardError(f"{node.name}: {what} {size} cannot be split over {world} ranks")


def _module_of(params) -> str:
    modules = [p.name.split(".")[:-1] for p in params]
    common = os.path.commonprefix(modules)
    return ".".join(common) or params[0].name


