"""The paged KV pool: one layout for every attention backend, defined here only.

Each attention layer owns one tensor ``[num_blocks, 2, block_size, num_kv_heads, head_dim]``
(K at index 0, V at index 1; FlashInfer's "NHD" paged layout). An MLA layer (``autodeploy.ops.mla``)
caches one entry per token shared by all heads instead: ``[num_blocks, block_size, r + dr]``, the
normalized latent (``kv_lora_rank`` r) then the rotary key (``qk_rope_head_dim`` dr). A cache slot is
``block * block_size + offset``; the same block ids index every layer's tensor. A model with
recurrent or convolution state also has a :class:`~.state_pool.StatePool` (``state``), whose tensors
the pool hands to the graph with its own.

The dtype is the model's, or ``float8_e4m3fn`` for an FP8 KV cache (``CompileConfig.kv_cache_dtype``):
one byte per element, so the same memory holds twice the tokens of a bf16 cache. Capacity counts
bytes per element of the dtype. The state pool keeps its own dtypes whatever the KV cache's
(``insert_state_cache``: a convolution window in the model's dtype, SSM and delta-rule state in fp32).
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass

import torch

from .state_pool import StatePool

# The Triton kernels address a layer's pool with 32-bit element offsets (page id x page stride in int32
# keeps registers free in the key loop): a layer's tensor holds at most this many elements. A pool sized
# by free memory can pass it (a small model on a large GPU: SmolLM2 on an H200 would), so it is capped.
MAX_ELEMENTS_PER_LAYER = 2**31 - 1


@dataclass(frozen=True)
class KVCacheSpec:
    """Shape of one attention layer's cache, read off the graph by insert_kv_cache. ``latent_rank``
    > 0: an MLA layer's latent cache (one entry of ``head_dim`` = latent + rotary key per token)."""

    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    latent_rank: int = 0

    @classmethod
    def latent(cls, rank: int, rope_dim: int, dtype: torch.dtype) -> "KVCacheSpec":
        return cls(num_kv_heads=1, head_dim=rank + rope_dim, dtype=dtype, latent_rank=rank)

    def shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        if self.latent_rank:
            return (num_blocks, block_size, self.head_dim)
        return (num_blocks, 2, block_size, self.num_kv_heads, self.head_dim)

    def bytes_per_token(self) -> int:
        entries = 1 if self.latent_rank else 2 * self.num_kv_heads
        return entries * self.head_dim * torch.empty((), dtype=self.dtype).element_size()

    def describe(self) -> str:
        if self.latent_rank:
            return f"MLA latent {self.latent_rank} + rotary key {self.head_dim - self.latent_rank}"
        return f"{self.num_kv_heads} kv heads x {self.head_dim}"


@dataclass(frozen=True)
class KVCapacity:
    num_blocks: int
    block_size: int
    max_seq_len: int
    layout: str = ""  # what one token holds (``KVPool.describe_layout``)
    dtype: torch.dtype | None = None  # the pool's (None: not said)
    model_dtype: torch.dtype | None = None  # the attention's, where the pool's differs (an FP8 cache)

    @property
    def num_tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def max_blocks_per_seq(self) -> int:
        """Blocks one sequence of ``max_seq_len`` tokens needs (block-table width)."""
        return -(-self.max_seq_len // self.block_size)

    @property
    def seqs_at_max_len(self) -> int:
        return self.num_tokens // self.max_seq_len

    def dtype_words(self) -> str:
        """The pool's dtype, and for a narrower one than the model's how many more tokens it holds."""
        if self.dtype is None:
            return "dtype not said"
        words = _name(self.dtype)
        if self.model_dtype is not None and self.model_dtype.itemsize > self.dtype.itemsize:
            words += (f", {self.model_dtype.itemsize // self.dtype.itemsize}x the tokens of a {_name(self.model_dtype)} "
                      "cache in the same memory")
        return words

    def describe(self) -> str:
        return (
            f"KV cache ({self.dtype_words()}): {self.num_blocks} blocks x {self.block_size} tokens = "
            f"{self.num_tokens} tokens, {self.seqs_at_max_len} sequences at max length {self.max_seq_len}"
            + (f"; per token: {self.layout}" if self.layout else "")
        )


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


class KVPool:
    """Owns the cache tensors of all attention layers."""

    def __init__(self, specs: list[KVCacheSpec], num_blocks: int, block_size: int, device: torch.device | str,
                 state: StatePool | None = None):
        self.specs = specs
        self.state = state
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.caches = [torch.zeros(s.shape(num_blocks, block_size), dtype=s.dtype, device=device) for s in specs]

    def as_kwargs(self) -> dict[str, torch.Tensor]:
        """The cache inputs of the compiled graph: ``kv_cache_<layer>`` (and ``state_cache_<op>``)."""
        caches = {f"kv_cache_{i}": cache for i, cache in enumerate(self.caches)}
        return caches if self.state is None else {**caches, **self.state.as_kwargs()}

    @staticmethod
    def describe_layout(specs: list[KVCacheSpec]) -> str:
        """What one token holds in the pool: bytes, and each kind of layer's entry."""
        kinds = Counter(f"{s.describe()} {str(s.dtype).removeprefix('torch.')}" for s in specs)
        layers = ", ".join(f"{n} x ({kind})" for kind, n in kinds.items())
        return f"{sum(s.bytes_per_token() for s in specs)} bytes over {len(specs)} layers: {layers}"

    @staticmethod
    def bytes_per_block(specs: list[KVCacheSpec], block_size: int) -> int:
        return block_size * sum(s.bytes_per_token() for s in specs)

    @classmethod
    def blocks_for_budget(cls, specs: list[KVCacheSpec], block_size: int, budget_bytes: int) -> int:
        return max(0, budget_bytes // max(1, cls.bytes_per_block(specs, block_size)))

    @staticmethod
    def max_addressable_blocks(specs: list[KVCacheSpec], block_size: int) -> int:
        """The most blocks a layer's tensor may have: the kernels address it with 32-bit element offsets."""
        return min(MAX_ELEMENTS_PER_LAYER // math.prod(s.shape(1, block_size)) for s in specs)
