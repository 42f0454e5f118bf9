"""insert_kv_cache: canonical attention -> paged-KV attention over the shared pool layout.

Each ``autodeploy::attention`` (flattened layout: batch 1, T tokens) becomes the paged-attention op
of the configured backend (``CompileConfig.attention_backend``, see
``autodeploy.ops.attention_backends``; all share the schema of ``autodeploy::paged_attention``) on
[T, H, D] views, reading the batch metadata and its layer's
cache from new graph inputs (``autodeploy.kvcache.metadata`` names them). The per-layer cache specs
go to ``ctx.artifacts["kv_specs"]`` for allocate_kv_cache. Each ``autodeploy::mla`` becomes the
backend's paged MLA op (``autodeploy.ops.mla.MLA_OPS``) over a latent cache (one entry of latent +
rotary key per token, ``KVCacheSpec.latent``); layers are numbered in graph order, whatever their kind.

The cache dtype is ``CompileConfig.kv_cache_dtype`` resolved against the checkpoint's quantization
(``autodeploy.quantization.kv_cache``). An FP8 cache's per-tensor ``k_scale``/``v_scale`` (the
checkpoint's, found under each attention's HF module, or 1.0) become arguments of each layer's op;
other graphs are unchanged. MLA layers keep the model's dtype (an FP8 latent cache is refused).
"""

from __future__ import annotations

import logging

import torch
from torch import fx

from autodeploy.graph.meta import add_graph_input, propagate_meta
from autodeploy.graph.modules import layer_of
from autodeploy.kvcache.metadata import ATTENTION_INPUTS, METADATA_INPUTS
from autodeploy.kvcache.pool import KVCacheSpec
from autodeploy.ops.attention_backends import AttentionBackend, resolve_attention_backend
from autodeploy.ops.mla import mla_op_for
from autodeploy.pipeline.base import CompileContext, Pass, PassResult, Stage
from autodeploy.quantization.kv_cache import KVCacheFormat, kv_cache_format, read_kv_scales
from autodeploy.quantization.source import stored_tensors

log = logging.getLogger("autodeploy.kv_cache")
aten = torch.ops.aten
_EXAMPLE_BLOCKS, _EXAMPLE_BLOCK = 4, 16


class InsertKVCache(Pass):
    name = "insert_kv_cache"
    stage = Stage.CACHE_INIT
    requires = ("attention_canonical", "logits_gathered")
    ensures = ("kv_cache_inserted",)

    def apply(self, ctx: CompileContext) -> PassResult:
        gm = ctx.gm
        layers = [n for n in gm.graph.nodes if n.op == "call_function" and n.target in _CACHED_OPS]
        if not layers:
            raise RuntimeError("no canonical attention in the graph; nothing to cache")
        backend = resolve_attention_backend(ctx.config.attention_backend, ctx.device)
        kv_format = kv_cache_format(ctx.config.kv_cache_dtype, ctx.checkpoint.path if ctx.checkpoint else None,
                                    ctx.dtype)
        _check_layers(layers, backend, kv_format)
        attentions = [n for n in layers if n.target != _MLA]
        scales, scale_words = _kv_scales(ctx, kv_format, attentions)
        scales_of = dict(zip(attentions, scales)) if scales else {}
        meta = {name: add_graph_input(gm, name, _example_metadata(name)) for name in METADATA_INPUTS}
        specs = []
        for layer, node in enumerate(layers):
            if node.target == _MLA:
                spec = _mla_spec(node)
                cache = add_graph_input(gm, f"kv_cache_{layer}", _example_cache(spec))
                _replace_mla(gm, node, cache, meta, layer, backend)
            else:
                spec = _spec(node, kv_format)
                cache = add_graph_input(gm, f"kv_cache_{layer}", _example_cache(spec))
                _replace(gm, node, cache, meta, layer, backend, scales_of.get(node))
            specs.append(spec)
        gm.graph.eliminate_dead_code()
        gm.recompile()
        ctx.artifacts["kv_specs"] = specs
        ctx.artifacts["attention_backend"] = backend.name
        ctx.artifacts["kv_cache_words"] = kv_format.describe() + scale_words
        kinds = ", ".join(dict.fromkeys(s.describe() for s in specs))
        return PassResult(len(layers), f"{len(layers)} layers, {kinds}, backend {backend.name}, "
                                       f"KV cache {kv_format.describe()}{scale_words}")


_MLA = torch.ops.autodeploy.mla.default
_CACHED_OPS = (torch.ops.autodeploy.attention.default, _MLA)
_ATTENTION_ARGS = ("scale", "causal", "sliding_window", "logit_softcap", "sinks", "chunk_size", "alibi_slopes")
_CARRIED = ("sliding_window", "logit_softcap", "sinks")  # always passed (None: off)
_CARRIED_IF_USED = ("chunk_size", "alibi_slopes")  # passed only when used: other graphs stay as they were


def _check_layers(layers: list[fx.Node], backend: AttentionBackend, kv_format: KVCacheFormat) -> None:
    """Refuse, before the graph changes, a layer the backend or the cache dtype cannot serve."""
    for node in layers:
        if node.target != _MLA:
            backend.check_layer(int(node.args[0].meta["val"].shape[-1]), _attention_kwargs(node), node.name)
            continue
        mla_op_for(backend.name, node.name)
        if kv_format.fp8:
            raise RuntimeError(f"{node.name}: an FP8 KV cache is not supported for MLA layers (their latent "
                               "cache); use --kv_cache_dtype auto")


def _attention_kwargs(node: fx.Node) -> dict:
    return dict(zip(_ATTENTION_ARGS, node.args[3:]), **node.kwargs)


def _kv_scales(ctx: CompileContext, kv_format: KVCacheFormat,
               attentions: list[fx.Node]) -> tuple[list[tuple[float, float]] | None, str]:
    """Each layer's (k_scale, v_scale) of an FP8 cache (None for another dtype), and words for the report."""
    if not kv_format.fp8:
        return None, ""
    checkpoint = ctx.checkpoint
    stored = False
    if checkpoint is not None and ctx.config.weights == "checkpoint" and checkpoint.is_safetensors:
        modules = [layer[0] if (layer := layer_of(node)) else None for node in attentions]
        scales, stored = read_kv_scales(checkpoint.weight_files, modules, stored_tensors(checkpoint))
    if stored:
        return scales, ", per-tensor k/v scales from the checkpoint"
    asks = "asks for an FP8 KV cache but " if kv_format.checkpoint_asks else ""
    log.warning("FP8 KV cache: the checkpoint %sstores no calibrated k_scale/v_scale; every layer uses 1.0 (vLLM's "
                "default): keys and values are stored as e4m3 as they are, saturating at +-448 and losing precision "
                "below 2^-6. A checkpoint calibrated by llm-compressor (kv_cache_scheme) or ModelOpt "
                "(kv_cache_quant_algo FP8) brings its own scales", asks)
    return [(1.0, 1.0)] * len(attentions), ", scales 1.0 (the checkpoint has none)"


def _spec(node: fx.Node, kv_format: KVCacheFormat) -> KVCacheSpec:
    q, k, v = (a.meta["val"] for a in node.args[:3])
    kwargs = _attention_kwargs(node)
    if not kwargs.get("causal", True):
        raise RuntimeError(f"{node.name}: non-causal attention cannot use a KV cache")
    if k.shape[-1] != v.shape[-1] or q.shape[-1] != k.shape[-1]:
        raise RuntimeError(f"{node.name}: q/k/v head dims differ ({q.shape[-1]}, {k.shape[-1]}, {v.shape[-1]})")
    dtype = k.dtype if kv_format.model_dtype else kv_format.dtype
    return KVCacheSpec(num_kv_heads=int(k.shape[2]), head_dim=int(k.shape[3]), dtype=dtype)


def _replace(
    gm: fx.GraphModule, node: fx.Node, cache: fx.Node, meta: dict[str, fx.Node], layer: int, backend: AttentionBackend,
    kv_scales: tuple[float, float] | None,
) -> None:
    graph = gm.graph
    q, k, v = node.args[:3]
    kwargs = _attention_kwargs(node)
    with graph.inserting_before(node):
        flat = [graph.call_function(aten.squeeze.dim, (t, 0)) for t in (q, k, v)]  # [1, T, H, D] -> [T, H, D]
        out = graph.call_function(
            backend.op,
            (*flat, cache, *(meta[n] for n in ATTENTION_INPUTS)),
            {
                "scale": kwargs["scale"],
                **{name: kwargs.get(name) for name in _CARRIED},
                **{name: kwargs[name] for name in _CARRIED_IF_USED if kwargs.get(name) is not None},
                **(dict(zip(("k_scale", "v_scale"), kv_scales)) if kv_scales else {}),  # an FP8 cache only
            },
        )
        restored = graph.call_function(aten.unsqueeze.default, (out, 0))
    _swap_in(gm, node, [*flat, out, restored], f"insert_kv_cache/layer{layer}/{backend.name}")


def _example_metadata(name: str) -> torch.Tensor:
    return torch.zeros((2, 2) if name == "block_table" else (2,), dtype=torch.int64)


def _example_cache(spec: KVCacheSpec) -> torch.Tensor:
    return torch.zeros(spec.shape(_EXAMPLE_BLOCKS, _EXAMPLE_BLOCK), dtype=spec.dtype)


def _mla_spec(node: fx.Node) -> KVCacheSpec:
    c_kv, k_pe = (a.meta["val"] for a in node.args[2:4])
    return KVCacheSpec.latent(int(c_kv.shape[-1]), int(k_pe.shape[-1]), c_kv.dtype)


def _replace_mla(
    gm: fx.GraphModule, node: fx.Node, cache: fx.Node, meta: dict[str, fx.Node], layer: int, backend: AttentionBackend
) -> None:
    """``mla`` (batch 1) -> the backend's paged MLA op on the flattened step."""
    graph = gm.graph
    q_nope, q_pe, c_kv, k_pe, w_kv_b, scale = node.args
    with graph.inserting_before(node):
        flat = [graph.call_function(aten.squeeze.dim, (t, 0)) for t in (q_nope, q_pe, c_kv, k_pe)]
        step = [meta[n] for n in ATTENTION_INPUTS]
        out = graph.call_function(mla_op_for(backend.name, node.name), (*flat, w_kv_b, cache, *step, scale))
        restored = graph.call_function(aten.unsqueeze.default, (out, 0))
    _swap_in(gm, node, [*flat, out, restored], f"insert_kv_cache/layer{layer}/{backend.name}")


def _swap_in(gm: fx.GraphModule, node: fx.Node, new_nodes: list[fx.Node], provenance: str) -> None:
    """Give ``new_nodes`` metadata and provenance; the last replaces ``node``."""
    propagate_meta(gm, new_nodes)
    for n in new_nodes:
        n.meta["autodeploy_provenance"] = provenance
    node.replace_all_uses_with(new_nodes[-1])
    gm.graph.erase_node(node)
