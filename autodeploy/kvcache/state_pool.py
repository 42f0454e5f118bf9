"""The state pool: per-sequence slots for recurrent and convolution state, beside the KV pool.

A layer with state (Mamba-2's SSM, Gated DeltaNet, lightning attention, their causal convolutions)
owns one tensor ``[num_slots, *shape]``; a running sequence holds one slot id, the same in every
layer's tensor, handed out and taken back by the block manager together with its KV blocks (the
scheduler frees both on finish, abort and preemption). State is not paged and not shared: it is the
whole history of a sequence in a fixed size, valid only at the sequence's current position, so
prefix caching is off for models with state (a cached prefix's KV blocks would come without the
state after them) and a preempted sequence rebuilds its state by prefilling again.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class StateSpec:
    """One stateful op's state per sequence, read off the graph by insert_state_cache."""

    kind: str  # "conv", "ssm", "delta" or "lightning": which cached op reads it
    shape: tuple[int, ...]
    dtype: torch.dtype

    def bytes_per_slot(self) -> int:
        numel = 1
        for size in self.shape:
            numel *= size
        return numel * torch.empty((), dtype=self.dtype).element_size()


@dataclass(frozen=True)
class StateCapacity:
    num_slots: int
    bytes_per_slot: int

    def describe(self) -> str:
        per_seq = self.bytes_per_slot / 2**20
        total = self.num_slots * self.bytes_per_slot / 2**30
        return (f"{self.num_slots} sequences x {per_seq:.3f} MiB = {total:.3f} GiB "
                "(recurrent + conv state, one slot per running sequence; prefix caching off)")


class StatePool:
    """Owns the state tensors of all stateful ops (zero-filled; a slot is read only after its
    sequence wrote it)."""

    def __init__(self, specs: list[StateSpec], num_slots: int, device: torch.device | str):
        self.specs = specs
        self.num_slots = num_slots
        self.states = [torch.zeros(num_slots, *s.shape, dtype=s.dtype, device=device) for s in specs]

    def as_kwargs(self) -> dict[str, torch.Tensor]:
        """The state inputs of the compiled graph: ``state_cache_<op>``."""
        return {f"state_cache_{i}": state for i, state in enumerate(self.states)}

    def capacity(self) -> StateCapacity:
        return StateCapacity(self.num_slots, self.bytes_per_slot(self.specs))

    @staticmethod
    def bytes_per_slot(specs: list[StateSpec]) -> int:
        return sum(s.bytes_per_slot() for s in specs)
