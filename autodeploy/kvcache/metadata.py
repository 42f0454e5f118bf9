"""Batch metadata: the contract between the engine, the passes and the attention ops.

One engine step flattens every scheduled token (prefill chunks and decodes, mixed) into one token
dimension T. The compiled graph takes these inputs, in this order:

=================  ===========  ==========================================================
name               shape        meaning
=================  ===========  ==========================================================
input_ids          [T]          token ids of the step, sequence after sequence
position_ids       [T]          absolute position of each token in its sequence
query_lens         [B]          tokens of each sequence in this step
context_lens       [B]          tokens of each sequence already in the KV cache
cu_seqlens         [B + 1]      prefix sums of query_lens (token offsets into T)
block_table        [B, M]       KV blocks of each sequence, in order (-1 padded)
slot_mapping       [T]          cache slot (block * block_size + offset) each token writes; -1 = skip
logits_indices     [L]          indices into T of the tokens whose logits are returned: the last
                                ``num_logits`` tokens of each chunk (1 by default, so L = B)
=================  ===========  ==========================================================

All integer tensors are int64, built in one pinned host buffer and copied to the device in one copy.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

TOKEN_INPUTS = ("input_ids", "position_ids")
METADATA_INPUTS = ("query_lens", "context_lens", "cu_seqlens", "block_table", "slot_mapping", "logits_indices")
GRAPH_INPUTS = TOKEN_INPUTS + METADATA_INPUTS


@dataclass(frozen=True)
class SequenceChunk:
    """What one sequence contributes to a step: ``token_ids`` at positions ``context_len...``.

    ``num_logits`` asks for the logits of the chunk's last ``num_logits`` tokens instead of only
    the last one (prompt log-probabilities need every position).
    """

    token_ids: tuple[int, ...]
    context_len: int
    block_ids: tuple[int, ...]
    num_logits: int = 1

    @property
    def end(self) -> int:
        return self.context_len + len(self.token_ids)


@dataclass(frozen=True)
class BatchMetadata:
    """The tensors of one step, already on the target device (see the module docstring)."""

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    query_lens: torch.Tensor
    context_lens: torch.Tensor
    cu_seqlens: torch.Tensor
    block_table: torch.Tensor
    slot_mapping: torch.Tensor
    logits_indices: torch.Tensor

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]

    @property
    def num_seqs(self) -> int:
        return self.query_lens.shape[0]

    @property
    def num_logits(self) -> int:
        return self.logits_indices.shape[0]

    def as_kwargs(self) -> dict[str, torch.Tensor]:
        """Keyword inputs of the compiled graph (cache tensors come from the pool)."""
        return {name: getattr(self, name) for name in GRAPH_INPUTS}

    @classmethod
    def build(
        cls,
        chunks: list[SequenceChunk],
        block_size: int,
        device: torch.device | str,
        *,
        pad: "Padding | None" = None,
        buffers: "StepBuffers | None" = None,
    ) -> "BatchMetadata":
        """Flatten ``chunks`` into one step: one host buffer, one host-to-device copy.

        ``pad`` grows the step to fixed sizes (CUDA graphs): padding tokens write no cache slot
        (-1) and padding sequences have no tokens. ``buffers`` reuses pinned host and device memory.
        """
        if not chunks:
            raise ValueError("a step needs at least one sequence")
        shape = Padding.of(chunks) if pad is None else pad.covering(chunks)
        values = _values(chunks, block_size, shape)
        sizes = {name: len(v) for name, v in values.items()}
        total = sum(sizes.values())
        if buffers is None:
            host = torch.tensor([x for v in values.values() for x in v], dtype=torch.int64)
            dev = host.to(device)
        else:
            host, dev = buffers.stage(total)
            host.copy_(torch.tensor([x for v in values.values() for x in v], dtype=torch.int64))
            dev.copy_(host, non_blocking=True)
            buffers.record()
        views = dict(zip(sizes, torch.split(dev, list(sizes.values()))))
        views["block_table"] = views["block_table"].view(shape.num_seqs, shape.max_blocks)
        return cls(**views)


@dataclass(frozen=True)
class Padding:
    """Fixed step sizes: token count, sequence count, block-table width."""

    num_tokens: int
    num_seqs: int
    max_blocks: int

    @classmethod
    def of(cls, chunks: list[SequenceChunk]) -> "Padding":
        return cls(sum(len(c.token_ids) for c in chunks), len(chunks), max(len(c.block_ids) for c in chunks))

    @property
    def metadata_size(self) -> int:
        """Most int64 values a step of this shape needs (logits rows <= tokens)."""
        return 4 * self.num_tokens + 3 * self.num_seqs + 1 + self.num_seqs * self.max_blocks

    def covering(self, chunks: list[SequenceChunk]) -> "Padding":
        need = Padding.of(chunks)
        if need.num_tokens > self.num_tokens or need.num_seqs > self.num_seqs or need.max_blocks > self.max_blocks:
            raise ValueError(f"step {need} does not fit the padded shape {self}")
        return self


class StepBuffers:
    """Reused pinned host staging buffers (two, alternating) and one device buffer for metadata."""

    def __init__(self, capacity: int, device: torch.device | str):
        self.device = torch.device(device)
        pin = self.device.type == "cuda" and torch.cuda.is_available()
        self.hosts = [torch.empty(capacity, dtype=torch.int64, pin_memory=pin) for _ in range(2)]
        self.events = [torch.cuda.Event() if pin else None for _ in range(2)]
        self.dev = torch.empty(capacity, dtype=torch.int64, device=self.device)
        self.turn = 0

    def stage(self, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        if size > self.dev.numel():
            raise ValueError(f"step metadata of {size} values exceeds the buffer of {self.dev.numel()}")
        self.turn ^= 1
        if self.events[self.turn] is not None:
            self.events[self.turn].synchronize()  # the copy that last read this host buffer is done
        return self.hosts[self.turn][:size], self.dev[:size]

    def record(self) -> None:
        if self.events[self.turn] is not None:
            self.events[self.turn].record()


def _logits_indices(chunks: list[SequenceChunk], cu: list[int]) -> list[int]:
    """The last ``num_logits`` tokens of each chunk; a chunk without tokens (padding) gets row 0."""
    rows = []
    for chunk, end in zip(chunks, cu[1:]):
        rows.extend(range(end - chunk.num_logits, end) if chunk.token_ids else [0])
    return rows


def _values(chunks: list[SequenceChunk], block_size: int, shape: Padding) -> dict[str, list[int]]:
    ids, positions, slots, query_lens, context_lens, table = [], [], [], [], [], []
    for chunk in chunks:
        if chunk.end > len(chunk.block_ids) * block_size:
            raise ValueError(f"sequence needs {chunk.end} slots but has {len(chunk.block_ids)} blocks")
        if chunk.token_ids and not 1 <= chunk.num_logits <= len(chunk.token_ids):
            raise ValueError(f"num_logits must be in [1, {len(chunk.token_ids)}], got {chunk.num_logits}")
        ids.extend(chunk.token_ids)
        pos = range(chunk.context_len, chunk.end)
        positions.extend(pos)
        slots.extend(chunk.block_ids[p // block_size] * block_size + p % block_size for p in pos)
        query_lens.append(len(chunk.token_ids))
        context_lens.append(chunk.context_len)
        table.extend(list(chunk.block_ids) + [-1] * (shape.max_blocks - len(chunk.block_ids)))
    cu = [0]
    for n in query_lens:
        cu.append(cu[-1] + n)
    pad_tokens, pad_seqs = shape.num_tokens - len(ids), shape.num_seqs - len(chunks)
    return {
        "input_ids": ids + [0] * pad_tokens,
        "position_ids": positions + [0] * pad_tokens,
        "query_lens": query_lens + [0] * pad_seqs,
        "context_lens": context_lens + [0] * pad_seqs,
        "cu_seqlens": cu + [cu[-1]] * pad_seqs,
        "block_table": table + [-1] * (pad_seqs * shape.max_blocks),
        "slot_mapping": slots + [-1] * pad_tokens,
        "logits_indices": _logits_indices(chunks, cu) + [0] * pad_seqs,
    }
