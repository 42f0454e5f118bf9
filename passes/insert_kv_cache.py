"""insert_kv_cache: canonical attention -> paged-KV attention over the shared pool layout.

Each ``autodeploy::attention`` (flattened layout: batch 1, T tokens) becomes the paged-attention op
of the configured backend (``CompileConfig.attention_backend``, see
``autodeploy.ops.attention_backends``; all share the schema of ``autodeploy::paged_attention``) on
[T, H, D] views, reading the batch metadata and its layer's
cache from new graph inputs (``autodeploy.kvcache.metadata`` names them). The per-layer cache specs
go to ``ctx.artifacts["kv_specs"]`` for allocate_kv_cache.
"""

from __future__ import annotations

import torch
from torch import fx

from autodeploy.graph.meta import add_graph_input, propagate_meta
from autodeploy.kvcache.metadata import ATTENTION_INPUTS, METADATA_INPUTS
from autodeploy.kvcache.pool import KVCacheSpec
from autodeploy.ops.attention_backends import AttentionBackend, resolve_attention_backend
from autodeploy.pipeline.base import CompileContext, Pass, PassConfig, PassResult, Stage

aten = torch.ops.aten
_EXAMPLE_BLOCKS, _EXAMPLE_BLOCK = 4, 16


class InsertKVCacheConfig(PassConfig):
    cache_dtype: str | None = None  # default: the attention's dtype


class InsertKVCache(Pass):
    name = "insert_kv_cache"
    stage = Stage.CACHE_INIT
    requires = ("attention_canonical", "logits_gathered")
    ensures = ("kv_cache_inserted",)
    Config = InsertKVCacheConfig

    def apply(self, ctx: CompileContext) -> PassResult:
        gm = ctx.gm
        attentions = list(gm.graph.find_nodes(op="call_function", target=torch.ops.autodeploy.attention.default))
        if not attentions:
            raise RuntimeError("no canonical attention in the graph; nothing to cache")
        backend = resolve_attention_backend(ctx.config.attention_backend, ctx.device)
        for node in attentions:
            backend.check_layer(int(node.args[0].meta["val"].shape[-1]), _attention_kwargs(node), node.name)
        meta = {name: add_graph_input(gm, name, _example_metadata(name)) for name in METADATA_INPUTS}
        specs = []
        for layer, node in enumerate(attentions):
            spec = _spec(node, self.config.cache_dtype)
            cache = add_graph_input(gm, f"kv_cache_{layer}", _example_cache(spec))
            _replace(gm, node, cache, meta, layer, backend)
            specs.append(spec)
        gm.graph.eliminate_dead_code()
        gm.recompile()
        ctx.artifacts["kv_specs"] = specs
        ctx.artifacts["attention_backend"] = backend.name
        return PassResult(
            len(attentions),
            f"{len(attentions)} layers, {specs[0].num_kv_heads} kv heads x {specs[0].head_dim}, backend {backend.name}",
        )


_ATTENTION_ARGS = ("scale", "causal", "sliding_window", "logit_softcap", "sinks", "chunk_size", "alibi_slopes")
_CARRIED = ("sliding_window", "logit_softcap", "sinks")  # always passed (None: off)
_CARRIED_IF_USED = ("chunk_size", "alibi_slopes")  # passed only when used: other graphs stay as they were


def _attention_kwargs(node: fx.Node) -> dict:
    return dict(zip(_ATTENTION_ARGS, node.args[3:]), **node.kwargs)


def _spec(node: fx.Node, cache_dtype: str | None) -> KVCacheSpec:
    q, k, v = (a.meta["val"] for a in node.args[:3])
    kwargs = _attention_kwargs(node)
    if not kwargs.get("causal", True):
        raise RuntimeError(f"{node.name}: non-causal attention cannot use a KV cache")
    if k.shape[-1] != v.shape[-1] or q.shape[-1] != k.shape[-1]:
        raise RuntimeError(f"{node.name}: q/k/v head dims differ ({q.shape[-1]}, {k.shape[-1]}, {v.shape[-1]})")
    dtype = getattr(torch, cache_dtype) if cache_dtype else k.dtype
    return KVCacheSpec(num_kv_heads=int(k.shape[2]), head_dim=int(k.shape[3]), dtype=dtype)


def _replace(
    gm: fx.GraphModule, node: fx.Node, cache: fx.Node, meta: dict[str, fx.Node], layer: int, backend: AttentionBackend
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
            },
        )
        restored = graph.call_function(aten.unsqueeze.default, (out, 0))
    new_nodes = [*flat, out, restored]
    propagate_meta(gm, new_nodes)
    for n in new_nodes:
        n.meta["autodeploy_provenance"] = f"insert_kv_cache/layer{layer}/{backend.name}"
    node.replace_all_uses_with(restored)
    graph.erase_node(node)


def _example_metadata(name: str) -> torch.Tensor:
    return torch.zeros((2, 2) if name == "block_table" else (2,), dtype=torch.int64)


def _example_cache(spec: KVCacheSpec) -> torch.Tensor:
    return torch.zeros(_EXAMPLE_BLOCKS, 2, _EXAMPLE_BLOCK, spec.num_kv_heads, spec.head_dim, dtype=spec.dtype)
