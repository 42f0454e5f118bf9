"""One engine step on every rank: rank 0 publishes it, the other ranks follow.

Rank 0 owns the engine; its ``CompiledModel`` holds a :class:`StepPublisher` that sends each step
once, right before the forward runs: a header of :data:`HEADER_LEN` int64 on the control group
(host, gloo; rank 0 does not wait for it) and the step's batch metadata (``kvcache/metadata.py``,
the int64 values already on the device, input ids the previous step sampled included) on the device
group. Every other rank runs :func:`follow_steps`: wait for a header, receive the metadata, run the
same forward (eagerly, or by replaying the same captured CUDA graph: a decode graph, or a whole-step
graph of a prefill or mixed step), discard the logits. The
collectives inside the forward pair up because every rank runs the same graph on the same step.

Header: ``[kind, numel, num_tokens, num_seqs, max_blocks, num_logits, graph_size, step]``.
"""

from __future__ import annotations

import logging
from collections import Counter

import torch
import torch.distributed as dist

from .distributed import TensorParallel
from .kvcache.metadata import GRAPH_INPUTS, BatchMetadata

log = logging.getLogger("autodeploy.distributed")

EAGER, GRAPH, STOP, WHOLE_STEP = 1, 2, 3, 4
HEADER_LEN = 8


class StepPublisher:
    """Rank 0's side: sends every step's inputs to the other ranks."""

    def __init__(self, job: TensorParallel):
        self.job = job
        self.steps = 0
        self.kinds: Counter[int] = Counter()  # steps sent, by kind
        self._in_flight: tuple | None = None  # the last header's (work, tensor): kept alive until sent

    def eager(self, batch: BatchMetadata) -> None:
        """An eagerly run step: its metadata fields, flattened into one tensor."""
        flat = torch.cat([getattr(batch, name).reshape(-1) for name in GRAPH_INPUTS])
        dims = [batch.num_tokens, batch.num_seqs, batch.block_table.shape[1], batch.num_logits, 0]
        self._send(EAGER, dims, flat)

    def graph(self, size: int, staged: torch.Tensor) -> None:
        """A replayed decode graph of ``size`` sequences: its staged input buffer as it is."""
        self._send(GRAPH, [0, 0, 0, 0, size], staged)

    def whole_step(self, tokens: int, seqs: int, staged: torch.Tensor) -> None:
        """A replayed whole-step graph of ``tokens`` x ``seqs``: its staged input buffer as it is."""
        self._send(WHOLE_STEP, [tokens, seqs, 0, 0, 0], staged)

    def stop(self) -> None:
        """Tell the other ranks to leave :func:`follow_steps`."""
        self._send(STOP, [0, 0, 0, 0, 0], None)
        self._wait_header()

    def _send(self, kind: int, dims: list[int], payload: torch.Tensor | None) -> None:
        self._wait_header()
        numel = 0 if payload is None else payload.numel()
        header = torch.tensor([kind, numel, *dims, self.steps], dtype=torch.int64)
        work = dist.broadcast(header, 0, group=self.job.control_group, async_op=True)
        self._in_flight = (work, header)
        self.kinds[kind] += 1
        if payload is not None:
            dist.broadcast(payload, 0, group=self.job.device_group)
        self.steps += 1

    def _wait_header(self) -> None:
        if self._in_flight is not None:
            self._in_flight[0].wait()
            self._in_flight = None


def follow_steps(model, job: TensorParallel) -> int:
    """Run the steps rank 0 publishes until it says stop; returns how many ran.

    ``model`` is this rank's ``CompiledModel`` (the same graph as rank 0's, its own weight shard). A
    failed collective (a peer died) raises.
    """
    header = torch.empty(HEADER_LEN, dtype=torch.int64)
    steps = 0
    while True:
        dist.broadcast(header, 0, group=job.control_group)
        kind, numel, tokens, seqs, max_blocks, logits, graph_size, _ = header.tolist()
        if kind == STOP:
            return steps
        if kind == GRAPH:
            staged = model.cuda_graphs.staged_input(graph_size)[:numel]
            dist.broadcast(staged, 0, group=job.device_group)
            model.cuda_graphs.replay(graph_size)
        elif kind == WHOLE_STEP:
            staged = model.mixed_graphs.staged_input(tokens, seqs)[:numel]
            dist.broadcast(staged, 0, group=job.device_group)
            model.mixed_graphs.replay(tokens, seqs)
        elif kind == EAGER:
            flat = torch.empty(numel, dtype=torch.int64, device=model.device)
            dist.broadcast(flat, 0, group=job.device_group)
            model.forward(batch_from_flat(flat, tokens, seqs, max_blocks, logits))
        else:
            raise RuntimeError(f"unknown step kind {kind} from rank 0 (header {header.tolist()})")
        steps += 1


def batch_from_flat(flat: torch.Tensor, tokens: int, seqs: int, max_blocks: int, logits: int) -> BatchMetadata:
    """The inverse of :meth:`StepPublisher.eager`: views of ``flat``, one per metadata field."""
    sizes = [tokens, tokens, seqs, seqs, seqs + 1, seqs * max_blocks, tokens, logits, seqs]  # (state_slots last)
    assert len(sizes) == len(GRAPH_INPUTS)
    fields = dict(zip(GRAPH_INPUTS, torch.split(flat, sizes)))
    fields["block_table"] = fields["block_table"].view(seqs, max_blocks)
    return BatchMetadata(**fields)
