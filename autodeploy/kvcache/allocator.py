"""A minimal block allocator (free list). The engine's block manager adds prefix reuse on top."""

from __future__ import annotations


class OutOfBlocks(RuntimeError):
    """Raised when a sequence needs more KV blocks than are free."""


class BlockAllocator:
    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise OutOfBlocks(f"need {n} KV blocks, {len(self._free)} free")
        return [self._free.pop() for _ in range(n)]

    def free(self, blocks: list[int]) -> None:
        self._free.extend(reversed(blocks))


def blocks_needed(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)
