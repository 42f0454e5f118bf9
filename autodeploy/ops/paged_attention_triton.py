"""Triton backend of paged attention: ``autodeploy::paged_attention_triton``.

Same schema and semantics as the reference ``autodeploy::paged_attention`` (cache write, then
causal paged attention, optionally rotating q and k first; an FP8 pool quantized with the
per-tensor ``k_scale``/``v_scale``; ``query_lens`` is implied by ``cu_seqlens``). The kernels live in
``autodeploy.kernels.paged_attention`` and are imported on first call. The op never synchronises
with the host, so it can run inside a captured CUDA graph.
"""

from __future__ import annotations

import torch

from .attention_backends import AttentionBackend, triton_runs_on
from .paged_attention import paged_attention_fake


@torch.library.custom_op("autodeploy::paged_attention_triton", mutates_args=("kv_cache",))
def paged_attention_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    query_lens: torch.Tensor,
    context_lens: torch.Tensor,
    cu_seqlens: torch.Tensor,
    block_table: torch.Tensor,
    slot_mapping: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    logit_softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    rope_cos: torch.Tensor | None = None,
    rope_sin: torch.Tensor | None = None,
    rope_interleaved: bool = False,
    chunk_size: int | None = None,
    alibi_slopes: torch.Tensor | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    from ..kernels.paged_attention import paged_attention_fwd

    return paged_attention_fwd(
        q, k, v, kv_cache, cu_seqlens, context_lens, block_table, slot_mapping,
        scale, sliding_window, logit_softcap, sinks, rope_cos, rope_sin, rope_interleaved,
        chunk_size=chunk_size, alibi_slopes=alibi_slopes, k_scale=k_scale, v_scale=v_scale,
    )


paged_attention_triton.register_fake(paged_attention_fake)


TRITON_BACKEND = AttentionBackend(
    "triton", torch.ops.autodeploy.paged_attention_triton.default, capturable=True, availability=triton_runs_on
)
