"""The attention kernels the warm-up will need, guessed from the HF config and compiled during the export.

The ``warm_up`` pass compiles every Triton attention launch variant an engine can meet (about a dozen
for the 8B shape, 2-4 s of one core each on an H200 host and 6-12 s on slow ones): the slowest part of
its compiles. Which variants those are follows from the step limits and a few facts of each attention
layer (heads, KV heads, head dim, dtype, KV cache dtype, page size, window, softcap, chunk, ALiBi, whether its RoPE is
folded in), and all but the last can be read off the HF config before ``torch.export`` starts; the RoPE
is guessed folded wherever the config names a rotary embedding (``fuse_rope_attention`` folds it for
the rotate-half RoPE of the Llama family), except on the layers ``no_rope_layers`` marks 0 (NoPE) and where the
pass will not fold it (turned off, or an FP8 pool without its ``fp8_pools``). So, while the main thread exports,
the compile workers compile the guessed variants into Triton's disk cache, and when the warm-up records the real
ones, those guessed right are already there (or still compiling: the warm-up then waits for that same job).

A wrong guess costs worker time that the export leaves idle, nothing else: the kernels that run are
the warm-up's, compiled or loaded from the disk cache exactly as without this. ``early_compiles=False``
(CompileConfig) turns it off.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass, replace

import torch
from transformers import PretrainedConfig

from .config import CompileConfig

log = logging.getLogger("autodeploy")


@dataclass(frozen=True)
class AttentionKind:
    """What sets an attention layer's Triton kernels, besides the step shapes."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    sliding_window: int | None = None
    logit_softcap: float | None = None
    rope: tuple[int, torch.dtype, bool] | None = None  # (rotary dim, cos/sin dtype, interleaved)
    chunk_size: int | None = None
    alibi: bool = False


def guess_attention_kinds(hf_config: PretrainedConfig, dtype: torch.dtype) -> list[AttentionKind]:
    """The attention layer kinds the compiled graph most likely holds, read off the config ([] if the
    config does not say how many heads it has, or its attention is MLA)."""
    heads = getattr(hf_config, "num_attention_heads", None)
    hidden = getattr(hf_config, "hidden_size", None)
    if not isinstance(heads, int) or heads <= 0 or getattr(hf_config, "kv_lora_rank", None):
        return []  # (MLA layers, DeepSeek's kv_lora_rank, run paged_mla: no paged attention to guess)
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
    head_dim = getattr(hf_config, "head_dim", None) or (hidden // heads if isinstance(hidden, int) else None)
    if not isinstance(head_dim, int) or heads % kv_heads:
        return []
    softcap = getattr(hf_config, "attn_logit_softcapping", None)
    softcap = float(softcap) if isinstance(softcap, (int, float)) and softcap > 0 else None
    rope, alibi = _rope(hf_config, head_dim, dtype), _alibi(hf_config)
    windows = [None]
    window = getattr(hf_config, "sliding_window", None)
    if isinstance(window, int) and window > 0 and getattr(hf_config, "use_sliding_window", True) is not False:
        windows.append(window)
    kinds = [AttentionKind(heads, kv_heads, head_dim, w, softcap, rope, alibi=alibi) for w in windows]
    chunk = _chunk_size(hf_config)
    if chunk is not None:
        kinds.append(AttentionKind(heads, kv_heads, head_dim, None, softcap, rope, chunk, alibi))
    if rope is not None and 0 in (getattr(hf_config, "no_rope_layers", None) or ()):  # NoPE layers: full attention
        kinds.append(AttentionKind(heads, kv_heads, head_dim, None, softcap, None, alibi=alibi))
    return kinds


def _chunk_size(hf_config: PretrainedConfig) -> int | None:
    """Llama-4's ``attention_chunk_size``, where some layer is a chunked one (all, without ``layer_types``)."""
    chunk = getattr(hf_config, "attention_chunk_size", None)
    layer_types = getattr(hf_config, "layer_types", None) or ("chunked_attention",)
    return chunk if isinstance(chunk, int) and chunk > 0 and "chunked_attention" in layer_types else None


def _alibi(hf_config: PretrainedConfig) -> bool:
    """Whether the config says its attention has ALiBi (``alibi``, or MPT's ``attn_config.alibi``)."""
    flags = (getattr(hf_config, "alibi", None), getattr(getattr(hf_config, "attn_config", None), "alibi", None))
    return any(flag is True for flag in flags)


def _rope(hf_config: PretrainedConfig, head_dim: int, dtype: torch.dtype) -> tuple[int, torch.dtype, bool] | None:
    """The folded RoPE's (rotary dim, table dtype, interleaved), if the config names a rotary embedding:
    transformers' rotary modules return cos/sin in the model's dtype."""
    named = any(getattr(hf_config, key, None) is not None for key in ("rope_theta", "rope_parameters", "rope_scaling"))
    if not named:
        return None
    factor = getattr(hf_config, "partial_rotary_factor", None) or 1.0
    rot_dim = int(head_dim * factor) // 2 * 2
    return (rot_dim, dtype, False) if rot_dim > 0 else None


def guess_compiled_kinds(hf_config: PretrainedConfig, config: CompileConfig, dtype: torch.dtype,
                         kv_dtype: torch.dtype) -> list[AttentionKind]:
    """``guess_attention_kinds``, without the RoPE where ``fuse_rope_attention`` will not fold it."""
    kinds = guess_attention_kinds(hf_config, dtype)
    return kinds if _rope_folded(config, kv_dtype) else list(dict.fromkeys(replace(k, rope=None) for k in kinds))


def _rope_folded(config: CompileConfig, kv_dtype: torch.dtype) -> bool:
    """Whether ``fuse_rope_attention`` (as ``config.passes`` sets it) folds the RoPE over a ``kv_dtype`` pool."""
    from .passes.fuse_rope_attention import FuseRoPEAttentionConfig

    fold = FuseRoPEAttentionConfig(**config.passes.get("fuse_rope_attention", {}))
    return fold.enabled and (kv_dtype.itemsize > 1 or fold.fp8_pools)


def start_early_attention_compiles(hf_config: PretrainedConfig, config: CompileConfig, device: torch.device,
                                   dtype: torch.dtype, max_seq_len: int, workers,
                                   kv_dtype: torch.dtype | None = None) -> int:
    """Record the launch variants of every guessed kind (nothing runs) and hand them to ``workers``
    without waiting; returns how many kernels were handed over. ``kv_dtype``: the KV cache's (an FP8
    cache is a variant of its own; default ``dtype``)."""
    from .kernels.attention_warmup import warm_up_launches
    from .kernels.precompile import recording_compiles
    from .kvcache.allocator import blocks_needed

    kinds = guess_compiled_kinds(hf_config, config, dtype, kv_dtype or dtype)
    if not kinds:
        return 0
    page = config.tokens_per_block
    max_blocks = blocks_needed(max_seq_len, page)
    on_device = torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()
    with on_device, recording_compiles() as specs:
        for kind in kinds:
            # two pages: the launches are recorded, not run, and the pool's size is no kernel argument
            cache = torch.empty(2, 2, page, kind.num_kv_heads, kind.head_dim, dtype=kv_dtype or dtype, device=device)
            warm_up_launches(cache, kind.num_heads, dtype, kind.head_dim ** -0.5, kind.sliding_window,
                             kind.logit_softcap, None, config.max_batch_size, config.max_num_tokens, max_blocks,
                             kind.rope, kind.chunk_size, kind.alibi)
    workers.prefetch(specs)
    log.info("compiling %d guessed attention kernels during the export (%s)", len(specs), kinds)
    return len(specs)
