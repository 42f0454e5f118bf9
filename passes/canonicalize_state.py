"""canonicalize_state: layers with recurrent or convolution state -> the state ops.

Applies the state rules (Mamba-2's SSD and causal convolution, Gated DeltaNet, lightning attention;
``autodeploy.ops.state_ops``). What they leave is not checked here: ``check_uncached_state``, right
after, refuses any layer whose tokens still depend on each other other than through attention and
these ops, naming it. A replaced layer may change the shapes the graph recorded after it (export saw
a token count of at most one lightning block, ``min(block, T)``), so its metadata is recomputed.
"""

from __future__ import annotations

from autodeploy.graph.meta import propagate_meta
from autodeploy.pipeline.base import CompileContext, PassResult

from .canonicalize import RuleSetPass


class CanonicalizeState(RuleSetPass):
    name = "canonicalize_state"
    layer_kind = "layer with recurrent or convolution state"
    ensures = ("state_canonical",)

    def apply(self, ctx: CompileContext) -> PassResult:
        result = super().apply(ctx)
        if result.matches:
            propagate_meta(ctx.gm, [n for n in ctx.gm.graph.nodes if n.op == "call_function"])
        return result
