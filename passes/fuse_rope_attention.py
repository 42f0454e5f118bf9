"""fuse_rope_attention (stage ``cache_init``, after ``insert_kv_cache``): each layer's ``rope_qk``
folded into its paged attention, so q and the new keys are rotated inside the attention kernel
(``transforms/fuse_rope_attention.py``). On by default on every device: the torch and FlashInfer
backends rotate with the ``rope_qk`` op first, the Triton kernel as it loads q and the new keys.
"""

from __future__ import annotations

import torch

from autodeploy.pipeline.base import CompileContext, Pass, PassResult, Stage
from autodeploy.transforms.fuse_rope_attention import fuse_rope_attention


class FuseRoPEAttention(Pass):
    name = "fuse_rope_attention"
    stage = Stage.CACHE_INIT
    requires = ("kv_cache_inserted",)
    ensures = ("rope_attention_fused",)

    def apply(self, ctx: CompileContext) -> PassResult:
        result = fuse_rope_attention(ctx.gm)
        left = len(ctx.gm.graph.find_nodes(op="call_function", target=torch.ops.autodeploy.rope_qk.default))
        why = f" ({'; '.join(result.reasons[:3])})" if result.reasons else ""
        return PassResult(result.matches, f"{result.matches} rope_qk folded into attention, "
                                          f"{result.rejected} rejected, {left} left{why}")
