"""shard: tensor parallelism, plan then apply (stage ``shard``: after canonicalize and quantize,
before fuse).

With ``tp_size`` 1 (the default) the pass does nothing. Otherwise it derives the plan from the
canonical graph (``shard_plan.derive_plan``; printable, testable without devices), checks it
against the model's own ``base_model_tp_plan`` where there is one (disagreements are logged, the
plan stays ours), and applies it for this process's rank:

- every planned parameter becomes its local shape on meta, and ``ctx.weight_slices`` tells
  ``load_weights`` which slice of the checkpoint tensor to read (a safetensors lazy slice: a rank
  reads and materializes only its shard). Fusion runs afterwards on the local shapes, so a fused
  q/k/v or gate/up parameter is stacked from the ranks' parts; quantization scales named with a
  weight are sliced with it, and the parameters of quantized linears (built by the quantize pass's
  load hooks) are cut through its writer (``shard_quantized.py``);
- literal sizes that count the whole split dimension (view shapes) are divided;
- an ``autodeploy::all_reduce`` follows every row-parallel output (a row-parallel linear's bias is
  added after it, once), an ``all_gather`` the vocabulary-parallel LM head; MoE by expert remaps
  the routing ids to the rank's experts;
- the graph's fake-tensor metadata is recomputed, so later passes see per-rank head counts (the KV
  cache of a rank holds its own key/value heads).
"""

from __future__ import annotations

import functools
import logging
from typing import Literal

import torch
from torch import fx

from autodeploy import distributed
from autodeploy.errors import ConfigError
from autodeploy.export import get_tensor_attr, set_tensor_attr
from autodeploy.graph.meta import fake_mode_of, propagate_meta
from autodeploy.ops.collectives import enable_fast_all_reduce
from autodeploy.pipeline.base import CompileContext, Pass, PassConfig, PassResult, Stage

from .shard_groups import ShardGroup
from .shard_plan import ShardPlan, derive_plan, hf_disagreements
from .shard_quantized import localize_written, written_params
from .shard_split import Fix, ShardError, SliceFix, linear_parts, op_arguments

log = logging.getLogger("autodeploy.shard")
aten = torch.ops.aten
AD = torch.ops.autodeploy


class ShardConfig(PassConfig):
    lm_head: bool = True  # vocabulary-parallel LM head (+ all_gather); else every rank holds it whole
    moe: Literal["tensor", "expert"] = "tensor"  # split each expert, or give each rank whole experts
    fast_all_reduce_max_bytes: int = 0  # > 0: symmetric-memory one-shot all-reduce up to this size (CUDA)


class Shard(Pass):
    name = "shard"
    stage = Stage.SHARD
    requires = ("attention_canonical",)
    ensures = ("sharded",)
    Config = ShardConfig

    def apply(self, ctx: CompileContext) -> PassResult:
        world = ctx.config.tp_size
        if world == 1:
            return PassResult(0, "tp_size 1: nothing to shard")
        plan = self.plan(ctx)
        written = written_params(ctx)
        built = [p.name for g in plan.groups for p in g.params if p.name in ctx.hook_targets and p.name not in written]
        if built:
            raise ShardError(f"{len(built)} planned parameters are built by an earlier pass's load hooks, which "
                             f"do not take slices (e.g. {built[0]}); use tp_size 1")
        job = distributed.current()
        if job is None or job.world_size != world:
            raise RuntimeError(f"tp_size {world}: this process has not joined a tensor-parallel job of {world} ranks")
        apply_plan(ctx, plan, job.rank)
        ctx.artifacts["shard_plan"] = plan
        if self.config.fast_all_reduce_max_bytes > 0:
            enable_fast_all_reduce(ctx.dtype, self.config.fast_all_reduce_max_bytes)
        return PassResult(len(plan.groups), plan.summary())

    def plan(self, ctx: CompileContext) -> ShardPlan:
        plan = derive_plan(ctx.gm, ctx.config.tp_size, lm_head=self.config.lm_head, moe=self.config.moe)
        for line in hf_disagreements(plan, getattr(ctx.hf_config, "base_model_tp_plan", None)):
            log.warning("shard plan vs HF: %s", line)
        return plan


def plan_for_checkpoint(model_dir, **options) -> ShardPlan:
    """The plan ``autodeploy.compile(model_dir, **options)`` would apply (``tp_size`` >= 2): the model
    built on meta, exported and run through the passes before ``shard``; no weights, no processes."""
    ctx, entries = context_before_shard(model_dir, **options)
    if ctx.config.tp_size < 2:
        raise ConfigError("a tensor-parallel plan needs tp_size of 2 or more (--tp_size)")
    shard = next((e for e in entries if e.name == Shard.name and e.config.enabled), None)
    if shard is None:
        raise ConfigError("the pipeline has no enabled 'shard' pass")
    return Shard(shard.config).plan(ctx)


def context_before_shard(model_dir, **options) -> tuple[CompileContext, list]:
    """A compile context as the ``shard`` pass receives it (on meta), and the pipeline's entries."""
    from autodeploy.compiler import model_max_len
    from autodeploy.config import CompileConfig, validate
    from autodeploy.export import export_model
    from autodeploy.model_loading import build_meta_model, open_checkpoint, resolve_dtype, resolve_model_path
    from autodeploy.pipeline import load_pipeline, run_pipeline

    config = validate(CompileConfig, options, "compile options")
    checkpoint = open_checkpoint(resolve_model_path(model_dir), trust_remote_code=config.trust_remote_code,
                                 require_weights=False)
    dtype = resolve_dtype(checkpoint.config, config.dtype)
    model, buffers = build_meta_model(checkpoint.config, dtype, config.attn_implementation, config.trust_remote_code)
    ctx = CompileContext(gm=export_model(model), hf_config=checkpoint.config, config=config,
                         device=torch.device("cpu"), dtype=dtype, checkpoint=checkpoint, buffers=buffers)
    ctx.artifacts["max_seq_len"] = config.max_seq_len or model_max_len(checkpoint.config)
    entries = load_pipeline(config.pipeline, config.passes)
    run_pipeline(ctx, [e for e in entries if e.pass_cls.stage < Stage.SHARD])
    return ctx, entries


def apply_plan(ctx: CompileContext, plan: ShardPlan, rank: int) -> None:
    """Rewrite ``ctx.gm`` into rank ``rank``'s part of ``plan`` and register the weight slices."""
    gm, written = ctx.gm, written_params(ctx)
    nodes = {n.name: n for n in gm.graph.nodes}
    for group in plan.groups:
        for shard in group.params:
            _localize_parameter(gm, shard.name, shard.local_shape())
            if shard.name in written:  # quantized linears: their writer places the rank's pieces
                localize_written(ctx, shard, rank, plan.tp_size)
            else:
                ctx.weight_slices[shard.name] = functools.partial(shard.read, rank=rank, world=plan.tp_size)
        for fix in group.fixes:
            _fix(nodes[fix.node], fix)
        for name in group.after:
            _complete(gm, nodes[name], group)
        if group.experts:
            _remap_experts(gm, nodes[group.after[0]], rank * group.experts, group.experts)
    propagate_meta(gm, list(gm.graph.nodes))
    gm.graph.lint()
    gm.recompile()


def _localize_parameter(gm: fx.GraphModule, name: str, shape: tuple[int, ...]) -> None:
    old = get_tensor_attr(gm, name)
    set_tensor_attr(gm, name, torch.empty(shape, dtype=old.dtype, device="meta"), as_parameter=True)
    with fake_mode_of(gm):
        for reader in gm.graph.find_nodes(op="get_attr", target=name):
            reader.meta["val"] = torch.empty(shape, dtype=old.dtype, device=reader.meta["val"].device)


def _fix(node: fx.Node, fix: Fix) -> None:
    """A size that counted the whole split dimension becomes the rank's."""
    if isinstance(fix, SliceFix):
        node.args = (node.args[0], node.args[1], fix.start, fix.end, *node.args[4:])
        return
    shape = list(node.args[1])
    shape[fix.position] = shape[fix.position] // fix.factor
    node.args = (node.args[0], shape, *node.args[2:])


def _complete(gm: fx.GraphModule, node: fx.Node, group: ShardGroup) -> None:
    """The collective after ``node`` (a row-parallel output, or the split LM head)."""
    graph, job = gm.graph, distributed.current()
    bias = _take_bias(node) if group.collective == "all_reduce" else None
    with graph.inserting_after(node):
        if group.collective == "all_reduce":
            done = graph.call_function(AD.all_reduce.default, (node, job.group_name))
        else:
            done = graph.call_function(AD.all_gather.default, (node, -1, job.group_name))
    node.replace_all_uses_with(done, delete_user_cb=lambda user: user is not done)
    last = done
    if bias is not None:
        with graph.inserting_after(done):
            last = graph.call_function(aten.add.Tensor, (done, bias))
        done.replace_all_uses_with(last, delete_user_cb=lambda user: user is not last)
    for new in {done, last}:
        new.meta["autodeploy_provenance"] = f"shard/{group.kind}/{group.name}"


def _take_bias(node: fx.Node) -> fx.Node | None:
    """Remove a row-parallel linear's bias (each rank would add it: it is added after the sum)."""
    schema = getattr(node.target, "_schema", None)
    has_bias = schema is not None and "bias" in [a.name for a in schema.arguments]
    parts = linear_parts(node) or (op_arguments(node) if has_bias else None)  # also *_swiglu_down
    bias = parts.get("bias") if parts else None
    if not isinstance(bias, fx.Node):
        return None
    if node.target == aten.linear.default:
        node.args = node.args[:2]
    else:
        index = [a.name for a in node.target._schema.arguments].index("bias")
        if index < len(node.args):
            node.args = (*node.args[:index], None, *node.args[index + 1:])
        else:
            node.kwargs = {**node.kwargs, "bias": None}
    return bias


def _remap_experts(gm: fx.GraphModule, moe: fx.Node, first: int, count: int) -> None:
    """Routing ids -> this rank's expert indices; tokens routed elsewhere get weight 0 (their sum
    comes from the rank holding the expert)."""
    graph = gm.graph
    ids, weights = moe.args[1], moe.args[2]
    with graph.inserting_before(moe):
        local = graph.call_function(aten.sub.Tensor, (ids, first))
        inside = graph.call_function(aten.bitwise_and.Tensor, (
            graph.call_function(aten.ge.Scalar, (local, 0)), graph.call_function(aten.lt.Scalar, (local, count))))
        new_ids = graph.call_function(aten.mul.Tensor, (local, inside))
        new_weights = graph.call_function(aten.mul.Tensor, (weights, inside))
    moe.args = (moe.args[0], new_ids, new_weights, *moe.args[3:])
