"""The paged KV pool: one layout for every attention backend, defined here only.

Each attention layer owns one tensor ``[num_blocks, 2, block_size, num_kv_heads, head_dim]``
(K at index 0, V at index 1; FlashInfer's "NHD" paged layout). A cache slot is
``block * block_size + offset``; the same block ids index every layer's tensor. A model with
recurrent or convolution state also has a :class:`~.state_pool.StatePool` (``state``), whose tensors
the pool hands to the graph with its own.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .state_pool import StatePool


@dataclass(frozen=True)
class KVCacheSpec:
    """Shape of one attention layer's cache, read off the graph by insert_kv_cache."""

    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    def bytes_per_token(self) -> int:
        return 2 * self.num_kv_heads * self.head_dim * torch.empty((), dtype=self.dtype).element_size()


@dataclass(frozen=True)
class KVCapacity:
    num_blocks: int
    block_size: int
    max_seq_len: int

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

    def describe(self) -> str:
        return (
            f"KV cache: {self.num_blocks} blocks x {self.block_size} tokens = {self.num_tokens} tokens, "
            f"{self.seqs_at_max_len} sequences at max length {self.max_seq_len}"
        )


class KVPool:
    """Owns the cache tensors of all attention layers."""

    def __init__(self, specs: list[KVCacheSpec], num_blocks: int, block_size: int, device: torch.device | str,
                 state: StatePool | None = None):
        self.specs = specs
        self.state = state
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.caches = [
            torch.zeros(num_blocks, 2, block_size, s.num_kv_heads, s.head_dim, dtype=s.dtype, device=device)
            for s in specs
        ]

    def as_kwargs(self) -> dict[str, torch.Tensor]:
        """The cache inputs of the compiled graph: ``kv_cache_<layer>`` (and ``state_cache_<op>``)."""
        caches = {f"kv_cache_{i}": cache for i, cache in enumerate(self.caches)}
        return caches if self.state is None else {**caches, **self.state.as_kwargs()}

    @staticmethod
    def bytes_per_block(specs: list[KVCacheSpec], block_size: int) -> int:
        return block_size * sum(s.bytes_per_token() for s in specs)

    @classmethod
    def blocks_for_budget(cls, specs: list[KVCacheSpec], block_size: int, budget_bytes: int) -> int:
        return max(0, budget_bytes // max(1, cls.bytes_per_block(specs, block_size)))
