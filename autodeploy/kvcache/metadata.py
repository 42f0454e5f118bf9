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
    def build(cls, chunks: list[SequenceChunk], block_size: int, device: torch.device | str) -> "BatchMetadata":
        """Flatten ``chunks`` into one step; one host buffer, one host-to-device copy."""
        if not chunks:
            raise ValueError("a step needs at least one sequence")
        num_seqs = len(chunks)
        max_blocks = max(len(c.block_ids) for c in chunks)
        num_tokens = sum(len(c.token_ids) for c in chunks)
        num_logits = sum(c.num_logits for c in chunks)
        sizes = _field_sizes(num_tokens, num_seqs, max_blocks, num_logits)
        host = torch.empty(sum(sizes.values()), dtype=torch.int64, pin_memory=_can_pin(device))
        fields = dict(zip(sizes, torch.split(host, list(sizes.values()))))
        _fill(fields, chunks, block_size, max_blocks)
        dev = host.to(device, non_blocking=True)
        views = dict(zip(sizes, torch.split(dev, list(sizes.values()))))
        views["block_table"] = views["block_table"].view(num_seqs, max_blocks)
        return cls(**views)


def _field_sizes(num_tokens: int, num_seqs: int, max_blocks: int, num_logits: int) -> dict[str, int]:
    return {
        "input_ids": num_tokens,
        "position_ids": num_tokens,
        "query_lens": num_seqs,
        "context_lens": num_seqs,
        "cu_seqlens": num_seqs + 1,
        "block_table": num_seqs * max_blocks,
        "slot_mapping": num_tokens,
        "logits_indices": num_logits,
    }


def _fill(fields: dict[str, torch.Tensor], chunks: list[SequenceChunk], block_size: int, max_blocks: int) -> None:
    ids, positions, slots, query_lens, context_lens, table = [], [], [], [], [], []
    for chunk in chunks:
        if chunk.end > len(chunk.block_ids) * block_size:
            raise ValueError(f"sequence needs {chunk.end} slots but has {len(chunk.block_ids)} blocks")
        if not 1 <= chunk.num_logits <= len(chunk.token_ids):
            raise ValueError(f"num_logits must be in [1, {len(chunk.token_ids)}], got {chunk.num_logits}")
        ids.extend(chunk.token_ids)
        pos = range(chunk.context_len, chunk.end)
        positions.extend(pos)
        slots.extend(chunk.block_ids[p // block_size] * block_size + p % block_size for p in pos)
        query_lens.append(len(chunk.token_ids))
        context_lens.append(chunk.context_len)
        table.extend(list(chunk.block_ids) + [-1] * (max_blocks - len(chunk.block_ids)))
    cu = [0]
    for n in query_lens:
        cu.append(cu[-1] + n)
    values = {
        "input_ids": ids,
        "position_ids": positions,
        "query_lens": query_lens,
        "context_lens": context_lens,
        "cu_seqlens": cu,
        "block_table": table,
        "slot_mapping": slots,
        "logits_indices": [i for c, end in zip(chunks, cu[1:]) for i in range(end - c.num_logits, end)],
    }
    for name, vals in values.items():
        fields[name].copy_(torch.tensor(vals, dtype=torch.int64))


def _can_pin(device: torch.device | str) -> bool:
    return torch.device(device).type == "cuda" and torch.cuda.is_available()
