"""check_uncached_state: refuse a model whose tokens depend on each other other than through attention.

After canonicalization, the canonical attention (history in the paged KV cache) and the state ops
(Mamba-2 SSM scan, gated delta rule, causal convolution: history in the state pool) are the only
ops that may read other tokens. A layer whose output depends on earlier tokens through anything
else (a spelling no state rule knows, a cache object left in the graph) would lose that state
between engine steps and compute something else, silently. This pass proves
every other live op token-local (``autodeploy.graph.token_flow``) or stops the compile naming the HF
module of the first layer it cannot prove, before any weight is loaded.
"""

from __future__ import annotations

from autodeploy.errors import UnsupportedLayerError
from autodeploy.graph.modules import layers_of
from autodeploy.graph.token_flow import token_mixing
from autodeploy.pipeline.base import CompileContext, Pass, PassResult, Stage



class CheckUncachedState(Pass):
    name = "check_uncached_state"
    stage = Stage.CANONICALIZE
    requires = ("attention_canonical",)
    ensures = ("state_is_kv_only",)

    def apply(self, ctx: CompileContext) -> PassResult:
        found = token_mixing(ctx.gm)
        if found:
            node, why = found[0]
            more = f"; {len(found) - 1} more node(s) it cannot prove token-local" if len(found) > 1 else ""
            raise UnsupportedLayerError(
                "layer with state the KV cache does not hold",
                _layers_first_one_first(node, [n for n, _ in found]),
                f"its output depends on other tokens through something other than attention ({node.name} {why}{more}); "
                "decoding step by step would silently drop that state (linear attention, a recurrent or "
                "convolution state, a cache object) and no rule of canonicalize_state recognized the layer",
            )
        return PassResult(0, "only attention and the state ops carry state across tokens")


def _layers_first_one_first(first, nodes) -> list[str]:
    head = layers_of([first])
    return head + [layer for layer in layers_of(nodes) if layer not in head]
