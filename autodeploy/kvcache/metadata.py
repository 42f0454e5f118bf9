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
state_slots        [B]          each sequence's slot in the state pool (models with recurrent or
                                convolution state; -1: none, e.g. padding)
=================  ===========  ==========================================================

All integer tensors are int64, built in one pinned host buffer and copied to the device in one copy.
``input_ids`` is the first field of that buffer. Some input ids may still be on the device when the
step is launched (the tokens the previous step is sampling): :class:`DeferredTokens` writes them into
the staged ``input_ids`` on the device, so the engine can launch step n + 1 before step n's tokens
reach the host.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np
import torch

TOKEN_INPUTS = ("input_ids", "position_ids")
ATTENTION_INPUTS = ("query_lens", "context_lens", "cu_seqlens", "block_table", "slot_mapping")  # paged attention's
METADATA_INPUTS = ATTENTION_INPUTS + ("logits_indices", "state_slots")
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
    state_slot: int = -1  # the sequence's slot in the state pool (-1: the model has no state)

    @property
    def end(self) -> int:
        return self.context_len + len(self.token_ids)


PLACEHOLDER_TOKEN = -1  # an input id still on the device (see DeferredTokens); never a valid id


@dataclass(frozen=True)
class DeferredTokens:
    """Input ids that are still on the device: token ``positions[i]`` of the step is ``values[rows[i]]``.

    ``values`` is what the previous step sampled (int64, on the model's device); writing happens on
    the device's stream, after the metadata copy and before the forward, so nothing waits.
    """

    values: torch.Tensor
    positions: tuple[int, ...]
    rows: tuple[int, ...]

    def write(self, input_ids: torch.Tensor) -> None:
        n = len(self.positions)
        if n == 0:
            return
        if self.positions == self.rows == tuple(range(n)):  # steady decode: same sequences, same order
            input_ids[:n].copy_(self.values[:n])
            return
        index = torch.tensor((self.positions, self.rows), dtype=torch.int64)
        if input_ids.is_cuda:
            index = index.pin_memory()
        index = index.to(input_ids.device, non_blocking=True)
        input_ids.index_copy_(0, index[0], self.values.index_select(0, index[1]))


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
    state_slots: torch.Tensor

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
        dev, sizes, shape = _stage(chunks, block_size, device, pad, buffers)
        views = dict(zip(sizes, torch.split(dev, list(sizes.values()))))
        views["block_table"] = views["block_table"].view(shape.num_seqs, shape.max_blocks)
        return cls(**views)

    @staticmethod
    def refill(chunks: list[SequenceChunk], block_size: int, pad: "Padding", buffers: "StepBuffers") -> None:
        """Write a step into ``buffers``' device memory (static tensors of a captured graph): no views."""
        _stage(chunks, block_size, buffers.device, pad, buffers)


@dataclass(frozen=True)
class Padding:
    """Fixed step sizes: token count, sequence count, block-table width."""

    num_tokens: int
    num_seqs: int
    max_blocks: int

    @classmethod
    def of(cls, chunks: list[SequenceChunk]) -> "Padding":
        return _Lengths(chunks).padding()

    @property
    def metadata_size(self) -> int:
        """Most int64 values a step of this shape needs (logits rows <= tokens)."""
        return sum(_field_sizes(self, self.num_tokens).values())

    def covering(self, need: "Padding") -> "Padding":
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

    def input_ids(self, num_tokens: int) -> torch.Tensor:
        """The device ``input_ids`` of the step staged last (the first field of the buffer)."""
        return self.dev[:num_tokens]

    def copy_in(self, size: int, fill) -> torch.Tensor:
        """``fill`` the next host buffer's first ``size`` values (as numpy), copy them to the device."""
        if size > self.dev.numel():
            raise ValueError(f"step metadata of {size} values exceeds the buffer of {self.dev.numel()}")
        self.turn ^= 1
        event = self.events[self.turn]
        if event is not None:
            event.synchronize()  # the copy that last read this host buffer is done
        host, dev = self.hosts[self.turn][:size], self.dev[:size]
        fill(host.numpy())
        dev.copy_(host, non_blocking=True)
        if event is not None:
            event.record()
        return dev


_DECODE_LIST_FILL_MAX = 64  # below this many sequences plain lists beat numpy's per-call overhead


def _stage(chunks, block_size, device, pad, buffers) -> tuple[torch.Tensor, dict[str, int], "Padding"]:
    if not chunks:
        raise ValueError("a step needs at least one sequence")
    if buffers is not None and pad is not None and len(chunks) <= _DECODE_LIST_FILL_MAX and _decode_only(chunks):
        return _stage_decode(chunks, block_size, pad, buffers)
    lens = _Lengths(chunks)
    shape = lens.padding() if pad is None else pad.covering(lens.padding())
    sizes = _field_sizes(shape, lens.num_logits + shape.num_seqs - lens.num_seqs)
    total = sum(sizes.values())
    if buffers is None:
        host = torch.empty(total, dtype=torch.int64)
        _fill(host.numpy(), chunks, lens, block_size, shape)
        return host.to(device), sizes, shape
    dev = buffers.copy_in(total, lambda out: _fill(out, chunks, lens, block_size, shape))
    return dev, sizes, shape


class _Lengths:
    """Per-chunk lengths as arrays (one pass over the chunks)."""

    def __init__(self, chunks: list[SequenceChunk]):
        n = len(chunks)
        self.num_seqs = n
        self.query = np.fromiter((len(c.token_ids) for c in chunks), np.int64, n)
        self.context = np.fromiter((c.context_len for c in chunks), np.int64, n)
        self.blocks = np.fromiter((len(c.block_ids) for c in chunks), np.int64, n)
        wanted = np.fromiter((c.num_logits for c in chunks), np.int64, n)
        bad = (self.query > 0) & ((wanted < 1) | (wanted > self.query))
        if bad.any():
            i = int(np.argmax(bad))
            raise ValueError(f"num_logits must be in [1, {self.query[i]}], got {wanted[i]}")
        self.logits = np.where(self.query > 0, wanted, 1)  # a chunk without tokens (padding) gets row 0
        self.num_tokens = int(self.query.sum())
        self.num_logits = int(self.logits.sum())

    def padding(self) -> "Padding":
        return Padding(self.num_tokens, self.num_seqs, int(self.blocks.max()))


def _field_sizes(shape: "Padding", num_logits: int) -> dict[str, int]:
    t, s = shape.num_tokens, shape.num_seqs
    return {"input_ids": t, "position_ids": t, "query_lens": s, "context_lens": s, "cu_seqlens": s + 1,
            "block_table": s * shape.max_blocks, "slot_mapping": t, "logits_indices": num_logits, "state_slots": s}


def _fill(out: np.ndarray, chunks: list[SequenceChunk], lens: _Lengths, block_size: int, shape: "Padding") -> None:
    """Write every field, padded to ``shape``, into ``out`` (vectorized: no per-token Python)."""
    n, t, m = lens.num_seqs, lens.num_tokens, shape.max_blocks
    ends = lens.context + lens.query
    if (ends > lens.blocks * block_size).any():
        i = int(np.argmax(ends > lens.blocks * block_size))
        raise ValueError(f"sequence needs {ends[i]} slots but has {lens.blocks[i]} blocks")
    cu = np.zeros(shape.num_seqs + 1, np.int64)
    np.cumsum(lens.query, out=cu[1 : n + 1])
    cu[n + 1 :] = cu[n]
    seq = np.repeat(np.arange(n), lens.query)
    positions = lens.context[seq] + np.arange(t) - cu[seq]
    table = np.full((shape.num_seqs, m), -1, np.int64)
    table[:n][np.arange(m)[None, :] < lens.blocks[:, None]] = np.fromiter(
        itertools.chain.from_iterable(c.block_ids for c in chunks), np.int64, int(lens.blocks.sum()))
    fields = _Writer(out, shape.num_tokens)
    fields.tokens(np.fromiter(itertools.chain.from_iterable(c.token_ids for c in chunks), np.int64, t), 0)
    fields.tokens(positions, 0)
    fields.seqs(lens.query, shape.num_seqs, 0)
    fields.seqs(lens.context, shape.num_seqs, 0)
    fields.put(cu)
    fields.put(table.reshape(-1))
    fields.tokens(table[seq, positions // block_size] * block_size + positions % block_size, -1)
    starts = np.where(lens.query > 0, cu[1 : n + 1] - lens.logits, 0)
    offsets = np.arange(lens.num_logits) - np.repeat(np.cumsum(lens.logits) - lens.logits, lens.logits)
    fields.seqs(np.repeat(starts, lens.logits) + offsets, lens.num_logits + shape.num_seqs - n, 0)
    fields.seqs(np.fromiter((c.state_slot for c in chunks), np.int64, n), shape.num_seqs, -1)


def _decode_only(chunks: list[SequenceChunk]) -> bool:
    return all(len(c.token_ids) == 1 and c.num_logits == 1 for c in chunks)


def _stage_decode(chunks, block_size, pad, buffers) -> tuple[torch.Tensor, dict[str, int], "Padding"]:
    """The hot path of small CUDA-graph decode steps (one token per sequence), list-based."""
    shape = pad.covering(Padding(len(chunks), len(chunks), max(len(c.block_ids) for c in chunks)))
    sizes = _field_sizes(shape, shape.num_seqs)
    dev = buffers.copy_in(sum(sizes.values()), lambda out: _fill_decode(out, chunks, block_size, shape))
    return dev, sizes, shape


def _fill_decode(out: np.ndarray, chunks: list[SequenceChunk], block_size: int, shape: "Padding") -> None:
    n, s, m = len(chunks), shape.num_seqs, shape.max_blocks
    ctx = [c.context_len for c in chunks]
    for c, pos in zip(chunks, ctx):
        if pos // block_size >= len(c.block_ids):
            raise ValueError(f"sequence needs {pos + 1} slots but has {len(c.block_ids)} blocks")
    table: list[int] = []
    for c in chunks:
        table.extend(c.block_ids)
        table.extend([-1] * (m - len(c.block_ids)))
    pad_t, pad_s = shape.num_tokens - n, s - n
    values = (
        [c.token_ids[0] for c in chunks] + [0] * pad_t
        + ctx + [0] * pad_t
        + [1] * n + [0] * pad_s
        + ctx + [0] * pad_s
        + list(range(n + 1)) + [n] * pad_s
        + table + [-1] * (pad_s * m)
        + [c.block_ids[p // block_size] * block_size + p % block_size for c, p in zip(chunks, ctx)] + [-1] * pad_t
        + list(range(n)) + [0] * pad_s
        + [c.state_slot for c in chunks] + [-1] * pad_s
    )
    out[: len(values)] = values


class _Writer:
    """Appends fields one after the other into a flat buffer, padding each to its size."""

    def __init__(self, out: np.ndarray, num_tokens: int):
        self.out, self.at, self.num_tokens = out, 0, num_tokens

    def put(self, values: np.ndarray) -> None:
        self.out[self.at : self.at + len(values)] = values
        self.at += len(values)

    def tokens(self, values: np.ndarray, fill: int) -> None:
        self.seqs(values, self.num_tokens, fill)

    def seqs(self, values: np.ndarray, size: int, fill: int) -> None:
        self.out[self.at : self.at + len(values)] = values
        self.out[self.at + len(values) : self.at + size] = fill
        self.at += size
