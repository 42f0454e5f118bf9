"""Optional FlashInfer backend of paged attention: ``autodeploy::paged_attention_flashinfer``.

Same schema as ``autodeploy::paged_attention``; no attention sinks, chunked attention or ALiBi
(FlashInfer's paged kernels have no chunk mask, and its built-in ALiBi slopes are its own, not the
model's: a layer using them is refused at compile time); head dims 64/128/256; a fused
rotary embedding runs as the ``rope_qk`` kernel before the cache write; an FP8 pool runs as FlashInfer's
FP8 KV cache with the per-tensor scales. It is
registered whether or not FlashInfer is installed (so graphs naming it stay loadable); choosing it
on a machine without ``flashinfer`` fails at compile time with the reason. Eager only: FlashInfer
plans each step on the host (see ``autodeploy.kernels.flashinfer_paged``).
"""

from __future__ import annotations

import importlib.util

import torch

from ..errors import UnsupportedPatternError
from .attention_backends import AttentionBackend
from .paged_attention import paged_attention_fake, rotate_qk


@torch.library.custom_op("autodeploy::paged_attention_flashinfer", mutates_args=("kv_cache",))
def paged_attention_flashinfer(
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
    unsupported = {"attention sinks": sinks, "chunked attention": chunk_size, "ALiBi": alibi_slopes}
    for feature, value in unsupported.items():
        if value is not None:
            raise UnsupportedPatternError(f"the flashinfer backend does not support {feature} (use triton)")
    from ..kernels.flashinfer_paged import flashinfer_paged_attention

    q, k = rotate_qk(q, k, rope_cos, rope_sin, rope_interleaved)  # FlashInfer's own RoPE takes positions
    return flashinfer_paged_attention(
        q, k, v, kv_cache, query_lens, context_lens, cu_seqlens, block_table, slot_mapping,
        scale, sliding_window, logit_softcap, k_scale, v_scale,
    )


paged_attention_flashinfer.register_fake(paged_attention_fake)


def flashinfer_runs_on(device: torch.device) -> str | None:
    if device.type != "cuda":
        return f"FlashInfer needs a CUDA device, not {device.type}"
    for module in ("flashinfer", "triton"):
        if importlib.util.find_spec(module) is None:
            return f"{module} is not installed (pip install 'autodeploy[flashinfer]')"
    return None


FLASHINFER_BACKEND = AttentionBackend(
    "flashinfer",
    torch.ops.autodeploy.paged_attention_flashinfer.default,
    availability=flashinfer_runs_on,
    unsupported=frozenset({"sinks", "chunk_size", "alibi_slopes"}),
    head_dims=(64, 128, 256),
)
