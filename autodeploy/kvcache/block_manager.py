"""KV block manager: ref-counted paged blocks with automatic prefix reuse.

A sequence's KV cache is a list of block ids (its block table). Once a block is *full* and its
tokens are computed, it gets a key: ``sha256(key of the previous block + its token ids)``, so a key
names the whole prefix up to the end of that block, not just the block's own tokens. Keyed blocks
are listed in a table; a new sequence whose tokens start with the same prefix takes those blocks
(ref count + 1) instead of recomputing them.

A block whose ref count drops to zero keeps its key and content and waits, least recently used
first, until a fresh block is needed and the free list is empty; only then is it evicted (its key
dropped). With prefix caching off, nothing is keyed and blocks go straight back to the free list.

A model with recurrent or convolution state also needs one state slot per running sequence
(``num_state_slots``, see ``state_pool``): the manager hands those out beside the blocks. Its
prefix caching must be off: a cached prefix has KV blocks but no state to resume from.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import Sequence

from .allocator import OutOfBlocks, blocks_needed

__all__ = ["BlockManager", "OutOfBlocks", "PrefixMatch", "blocks_needed"]


@dataclass(frozen=True)
class PrefixMatch:
    """Cached blocks found for a token prefix; they are already referenced for the caller."""

    block_ids: tuple[int, ...]
    keys: tuple[bytes, ...]
    num_tokens: int


class BlockManager:
    """Hands out KV block ids ``0..num_blocks-1``; see the module docstring."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 num_state_slots: int = 0):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need at least one block of one token, got {num_blocks} x {block_size}")
        if num_state_slots and enable_prefix_caching:
            raise ValueError("prefix caching cannot serve a model with state slots (a prefix comes without its state)")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._refs = [0] * num_blocks
        self._key_of: list[bytes | None] = [None] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))  # unkeyed, unreferenced
        self._evictable: OrderedDict[int, None] = OrderedDict()  # keyed, unreferenced; oldest first
        self._by_key: dict[bytes, int] = {}
        self.prefix_queries = 0  # tokens looked up in the prefix cache
        self.prefix_hits = 0  # of those, tokens found
        self.num_state_slots = num_state_slots
        self._free_slots: deque[int] = deque(range(num_state_slots))

    # ---- capacity -------------------------------------------------------------------------------

    @property
    def num_free(self) -> int:
        """Blocks that can be handed out now (free or evictable)."""
        return len(self._free) + len(self._evictable)

    @property
    def num_used(self) -> int:
        """Blocks referenced by at least one sequence."""
        return self.num_blocks - self.num_free

    @property
    def usage(self) -> float:
        return self.num_used / self.num_blocks

    @property
    def hit_rate(self) -> float:
        return self.prefix_hits / self.prefix_queries if self.prefix_queries else 0.0

    # ---- allocation -----------------------------------------------------------------------------

    def allocate(self, n: int) -> list[int]:
        """``n`` fresh blocks (ref count 1); evicts cached blocks, oldest first, when needed."""
        if n > self.num_free:
            raise OutOfBlocks(f"need {n} KV blocks, {self.num_free} free")
        blocks = []
        for _ in range(n):
            block = self._free.popleft() if self._free else self._evict_oldest()
            self._refs[block] = 1
            blocks.append(block)
        return blocks

    def free(self, block_ids: Sequence[int]) -> None:
        """Drop one reference to each block. Tail blocks go first so they are evicted first."""
        for block in reversed(block_ids):
            self._refs[block] -= 1
            if self._refs[block] < 0:
                raise RuntimeError(f"KV block {block} freed more often than it was taken")
            if self._refs[block] == 0:
                if self._key_of[block] is None:
                    self._free.append(block)
                else:
                    self._evictable[block] = None

    def _evict_oldest(self) -> int:
        block, _ = self._evictable.popitem(last=False)
        del self._by_key[self._key_of[block]]
        self._key_of[block] = None
        return block

    # ---- state slots ----------------------------------------------------------------------------

    @property
    def num_free_state_slots(self) -> int:
        return len(self._free_slots)

    def allocate_state_slot(self) -> int:
        if not self._free_slots:
            raise OutOfBlocks(f"all {self.num_state_slots} state slots are in use")
        return self._free_slots.popleft()

    def free_state_slot(self, slot: int) -> None:
        if not 0 <= slot < self.num_state_slots or slot in self._free_slots:
            raise RuntimeError(f"state slot {slot} freed but not taken")
        self._free_slots.append(slot)

    # ---- prefix reuse ---------------------------------------------------------------------------

    def match_prefix(self, token_ids: Sequence[int], max_blocks: int) -> PrefixMatch:
        """Take (reference) the cached blocks holding the longest prefix of ``token_ids``.

        At most ``max_blocks`` blocks are matched: the caller keeps the tokens it must still run.
        The hit statistics count a lookup only when the caller reports it (:meth:`count_lookup`),
        so a sequence that retries admission is not counted twice.
        """
        if not self.enable_prefix_caching:
            return PrefixMatch((), (), 0)
        blocks, keys, parent = [], [], b""
        for i in range(min(max_blocks, len(token_ids) // self.block_size)):
            key = block_key(parent, token_ids[i * self.block_size : (i + 1) * self.block_size])
            block = self._by_key.get(key)
            if block is None:
                break
            blocks.append(block)
            keys.append(key)
            parent = key
        for block in blocks:
            self._take(block)
        return PrefixMatch(tuple(blocks), tuple(keys), len(blocks) * self.block_size)

    def count_lookup(self, num_tokens: int, match: PrefixMatch) -> None:
        """Record a prefix lookup of ``num_tokens`` tokens that found ``match``."""
        if self.enable_prefix_caching:
            self.prefix_queries += num_tokens
            self.prefix_hits += match.num_tokens

    def cache_full_blocks(
        self, block_ids: Sequence[int], token_ids: Sequence[int], num_computed: int, known_keys: Sequence[bytes]
    ) -> list[bytes]:
        """Key the blocks of a sequence that became full; returns their keys (to extend ``known_keys``).

        ``known_keys`` are the keys of the sequence's first blocks, computed earlier. When another
        block already holds the same prefix (computed concurrently), that one stays the cached copy.
        """
        if not self.enable_prefix_caching:
            return []
        new_keys = []
        parent = known_keys[-1] if known_keys else b""
        for i in range(len(known_keys), num_computed // self.block_size):
            parent = block_key(parent, token_ids[i * self.block_size : (i + 1) * self.block_size])
            new_keys.append(parent)
            block = block_ids[i]
            if parent not in self._by_key and self._key_of[block] is None:
                self._by_key[parent] = block
                self._key_of[block] = parent
        return new_keys

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix (referenced blocks keep their content, unkeyed)."""
        for block in list(self._evictable):
            self._free.append(block)
        self._evictable.clear()
        self._by_key.clear()
        self._key_of = [None] * self.num_blocks

    def _take(self, block: int) -> None:
        if self._refs[block] == 0:
            del self._evictable[block]
        self._refs[block] += 1


def block_key(parent: bytes, token_ids: Sequence[int]) -> bytes:
    """The key of a full block: a digest of the previous block's key and this block's tokens."""
    return hashlib.sha256(parent + array("q", token_ids).tobytes()).digest()
