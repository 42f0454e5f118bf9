"""insert_state_cache: the state ops over one sequence -> their cached forms over the state pool.

Each ``causal_conv1d`` / ``ssm_scan`` / ``gated_delta_rule`` / ``lightning_attention`` (canonicalization's
ops: all T rows one sequence, zero initial state) becomes its ``*_cached`` op (``autodeploy.ops.state_ops``) reading
and writing its own state tensor, a new graph input ``state_cache_<i>`` [slots, *shape], at the
slots the batch metadata names (``state_slots``, with ``cu_seqlens`` and ``context_lens``). The
per-op state specs go to ``ctx.artifacts["state_specs"]`` for allocate_kv_cache, which sizes the
state pool beside the KV pool. A graph without state ops is left as it is.
"""

from __future__ import annotations

from collections import Counter

import torch
from torch import fx

from autodeploy.graph.meta import add_graph_input, propagate_meta
from autodeploy.kvcache.state_pool import StateSpec
from autodeploy.ops.state_ops import STATE_OPS
from autodeploy.pipeline.base import CompileContext, Pass, PassResult, Stage

ad = torch.ops.autodeploy
_STATE_METADATA = ("state_slots", "cu_seqlens", "context_lens")  # the cached ops' trailing inputs
_EXAMPLE_SLOTS = 2


class InsertStateCache(Pass):
    name = "insert_state_cache"
    stage = Stage.CACHE_INIT
    requires = ("kv_cache_inserted",)
    ensures = ("state_cache_inserted",)

    def apply(self, ctx: CompileContext) -> PassResult:
        gm = ctx.gm
        nodes = [n for n in gm.graph.nodes if n.op == "call_function" and n.target in STATE_OPS]
        ctx.artifacts["state_specs"] = []
        if not nodes:
            return PassResult(0, "no layer with recurrent or convolution state")
        meta = {name: add_graph_input(gm, name, torch.zeros(2, dtype=torch.int64)) for name in _STATE_METADATA}
        specs = []
        for index, node in enumerate(nodes):
            spec = state_spec(node)
            state = add_graph_input(gm, f"state_cache_{index}", torch.zeros(_EXAMPLE_SLOTS, *spec.shape, dtype=spec.dtype))
            _replace(gm, node, state, meta, index)
            specs.append(spec)
        gm.graph.eliminate_dead_code()
        gm.recompile()
        ctx.artifacts["state_specs"] = specs
        kinds = Counter(s.kind for s in specs)
        per_seq = sum(s.bytes_per_slot() for s in specs)
        detail = ", ".join(f"{count} {kind}" for kind, count in kinds.items())
        return PassResult(len(nodes), f"states: {detail}; {per_seq / 2**10:.1f} KiB per sequence")


def state_spec(node: fx.Node) -> StateSpec:
    """The state one plain state op keeps per sequence."""
    vals = [a.meta["val"] if isinstance(a, fx.Node) else a for a in node.args]
    if node.target == ad.causal_conv1d.default:
        x, weight = vals[0], vals[1]
        return StateSpec("conv", (int(x.shape[1]), int(weight.shape[1]) - 1), x.dtype)
    if node.target == ad.ssm_scan.default:
        x, B = vals[0], vals[3]
        return StateSpec("ssm", (int(x.shape[1]), int(x.shape[2]), int(B.shape[2])), torch.float32)
    k, v = vals[1], vals[2]
    if node.target == ad.lightning_attention.default:
        return StateSpec("lightning", (int(v.shape[1]), int(k.shape[2]), int(v.shape[2])), torch.float32)
    return StateSpec("delta", (int(v.shape[1]), int(k.shape[2]), int(v.shape[2])), torch.float32)


def _replace(gm: fx.GraphModule, node: fx.Node, state: fx.Node, meta: dict[str, fx.Node], index: int) -> None:
    with gm.graph.inserting_before(node):
        cached = gm.graph.call_function(STATE_OPS[node.target], (*node.args, state, *(meta[n] for n in _STATE_METADATA)))
    propagate_meta(gm, [cached])
    cached.meta["autodeploy_provenance"] = f"insert_state_cache/{index}"
    for key in ("stack_trace", "nn_module_stack"):
        if key in node.meta:
            cached.meta[key] = node.meta[key]
    node.replace_all_uses_with(cached)
    gm.graph.erase_node(node)
