"""fuse_rope_attention (stage ``cache_init``, after ``insert_kv_cache``): each layer's ``rope_qk``
folded into its paged attention, so q and the new keys are rotated inside the attention kernel
(``transforms/fuse_rope_attention.py``). On by default on every device: the torch and FlashInfer
backends rotate with the ``rope_qk`` op first, the Triton kernel as it loads q and the new keys.
Not over an FP8 KV pool unless ``fp8_pools`` (see ``FuseRoPEAttentionConfig``).
"""

from __future__ import annotations

import torch

from autodeploy.pipeline.base import CompileContext, Pass, PassConfig, PassResult, Stage
from autodeploy.transforms.fuse_rope_attention import fuse_rope_attention


class FuseRoPEAttentionConfig(PassConfig):
    # Fold into attentions over an FP8 pool too. Off: the Triton decode kernel over an FP8 pool keeps 168-228
    # registers with RoPE where it keeps 128 without (3 or 2 programs an SM instead of 4; sm_90 compile), and
    # measured (H100, 2026-12-07 13:09, bench/probes/fp8_kv_decode.py, CUDA graphs) 312.4 µs folded against 223.9
    # plain at 64 x 4096 and 73.2 against 48.6 at 64 x 512: the separate rope_qk launch costs a few µs.
    fp8_pools: bool = False


class FuseRoPEAttention(Pass):
    name = "fuse_rope_attention"
    stage = Stage.CACHE_INIT
    requires = ("kv_cache_inserted",)
    ensures = ("rope_attention_fused",)
    Config = FuseRoPEAttentionConfig

    def apply(self, ctx: CompileContext) -> PassResult:
        result = fuse_rope_attention(ctx.gm, fp8_pools=self.config.fp8_pools)
        left = len(ctx.gm.graph.find_nodes(op="call_function", target=torch.ops.autodeploy.rope_qk.default))
        why = f" ({'; '.join(result.reasons[:3])})" if result.reasons else ""
        return PassResult(result.matches, f"{result.matches} rope_qk folded into attention, "
                                          f"{result.rejected} rejected, {left} left{why}")
