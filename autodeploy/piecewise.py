"""Piecewise CUDA graphs: prefill and mixed steps replayed between eager attention calls.

Steps that are not decode-only launch hundreds of small kernels; eagerly, the host takes about
three times the kernels' time (an 8B mixed step of 248 decodes and 2 prompts on an H200: 12.7 ms of
kernels in a 43.7 ms span). So the step graph is split where it cannot be captured for a varying
token count (``autodeploy.graph.split``: paged attention, the logits gather and what follows it,
ops that synchronise with the host), every piece between those is captured once per token bucket
(``sizes``), and a step of T tokens is padded to the smallest bucket >= T: the pieces replay, the
eager nodes run with the step's own metadata in between.

Padding is sound because the graph is token-local outside attention: ``check_uncached_state``
proved that every other op keeps the token rows apart, so padding rows (input id 0 at position 0)
compute values only in their own rows. They write no KV slot (``slot_mapping`` -1), belong to no
sequence (past ``cu_seqlens[-1]``: attention gives them zero rows and no real token sees them), and
no logits row reads them. A real row's numbers can still differ in the last bits from an unpadded
step where a kernel picks another algorithm for another row count (as between any two step sizes).

What a replayed piece reads: ``input_ids``/``position_ids`` at fixed places of this runner's step
buffer (per bucket); outputs of earlier pieces at the addresses captured; tensors the eager nodes
make anew each step (attention outputs) copied into slots that every piece and bucket shares. All
graphs share one memory pool and hold their outputs weakly, so a piece's memory serves later
captures once the step is done with it: the pool holds about one step's activations at the
largest bucket, not one set per bucket.
"""

from __future__ import annotations

import bisect
import functools
import logging
import time
from dataclasses import dataclass
from typing import Callable

import torch
from torch import fx

from .cudagraph import CudaStepGraph, DirectStepGraph, weak
from .graph.split import SplitGraph, split_at_eager_ops
from .kvcache.metadata import BatchMetadata, Padding, SequenceChunk, StepBuffers
from .kvcache.pool import KVPool

log = logging.getLogger("autodeploy.piecewise")

REPLAY, CAPTURE, DIRECT = "replay", "capture", "direct"
DEFAULT_LARGEST = 2048  # beyond this many tokens a step's kernels outlast its eager launches anyway


def default_piecewise_sizes(max_num_tokens: int, largest: int = DEFAULT_LARGEST) -> list[int]:
    """Token buckets: 1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, every 32 to 256, every 64 to 1024, every
    256 to ``largest``; none above ``max_num_tokens``, which is one when it is smaller than ``largest``.
    Padding wastes at most a third of a step below 256 tokens (where its GEMMs stream weights, so
    extra rows are nearly free) and at most a quarter above."""
    sizes = {1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128}
    sizes.update(range(160, 257, 32))
    sizes.update(range(320, 1025, 64))
    sizes.update(range(1280, largest + 1, 256))
    top = min(max_num_tokens, largest)
    return sorted({s for s in sizes if s <= top} | {top})


@dataclass
class _StepState:
    """What the pieces of the step being run must do (shared by every piece of a runner)."""

    mode: str = REPLAY
    bucket: int = 0
    new_graph: Callable[[], object] = DirectStepGraph


class _Slots:
    """Device memory for the tensors eager nodes make each step, where the pieces reading them find
    them: one buffer per key, sized by the first (largest) capture."""

    def __init__(self):
        self.buffers: dict[tuple, torch.Tensor] = {}
        self.retired: list[torch.Tensor] = []  # outgrown, but graphs captured with them still read them

    def hold(self, key: tuple, value: torch.Tensor) -> torch.Tensor:
        buffer = self.buffers.get(key)
        if buffer is None or buffer.numel() < value.numel():
            if buffer is not None:
                self.retired.append(buffer)
            buffer = self.buffers[key] = torch.empty(value.numel(), dtype=value.dtype, device=value.device)
        static = buffer[: value.numel()].view(value.shape)
        static.copy_(value)
        return static


class _Entry:
    """One bucket's graph of a piece and the inputs it was captured with (their memory, not kept
    allocated here: an earlier piece's output returns to the pool once the capture is done with it)."""

    def __init__(self, graph, args: tuple):
        self.graph = graph
        self.tensors = tuple((i, weak(a)) for i, a in enumerate(args) if isinstance(a, torch.Tensor))
        self.values = tuple((i, a) for i, a in enumerate(args) if not isinstance(a, torch.Tensor))

    def replay(self, args: tuple, name: str):
        for i, static in self.tensors:
            arg = args[i]
            if arg.data_ptr() != static.data_ptr():
                if arg.shape != static.shape:
                    raise RuntimeError(f"{name}: input {i} of shape {tuple(arg.shape)} replayed where "
                                       f"{tuple(static.shape)} was captured")
                static.copy_(arg)
        for i, value in self.values:
            if args[i] != value:
                raise RuntimeError(f"{name}: input {i} is {args[i]} where {value} was captured")
        return self.graph.replay()


class _Piece(torch.nn.Module):
    """A captured piece in the outer graph: replays its graph of the step's bucket, captures it, or
    calls the piece directly, as the runner's state says."""

    def __init__(self, name: str, module: fx.GraphModule, state: _StepState, slots: _Slots, fresh: tuple[int, ...]):
        super().__init__()
        self.name, self.module, self.state, self.slots, self.fresh = name, module, state, slots, fresh
        self.entries: dict[int, _Entry] = {}

    def forward(self, *args):
        mode = self.state.mode
        if mode == REPLAY:
            return self.entries[self.state.bucket].replay(args, self.name)
        if mode == CAPTURE:
            return self._capture(args)
        return self.module(*args)

    def _capture(self, args: tuple):
        what = f"piece {self.name} at {self.state.bucket} tokens"
        static = self._held(args, shared=True)
        graph = self.state.new_graph()
        outputs = graph.capture(self.module, static, what, "piecewise=false")
        if self._escapes(outputs, static):  # an output views a shared slot, which the next piece overwrites
            static = self._held(args, shared=False)
            graph = self.state.new_graph()
            outputs = graph.capture(self.module, static, what, "piecewise=false")
        self.entries[self.state.bucket] = _Entry(graph, static)
        return outputs

    def _held(self, args: tuple, shared: bool) -> tuple:
        """``args`` with the tensors eager nodes made copied into slots (shared by all pieces, or this one's)."""
        static = list(args)
        for ordinal, i in enumerate(self.fresh):
            if isinstance(args[i], torch.Tensor):
                key = (ordinal, args[i].dtype) if shared else (self.name, ordinal)
                static[i] = self.slots.hold(key, args[i])
        return tuple(static)

    def _escapes(self, outputs, static: tuple) -> bool:
        slots = {static[i].untyped_storage().data_ptr() for i in self.fresh if isinstance(static[i], torch.Tensor)}
        values = outputs if isinstance(outputs, (tuple, list)) else (outputs,)
        return any(isinstance(v, torch.Tensor) and v.untyped_storage().data_ptr() in slots for v in values)


class PiecewiseRunner:
    """Steps of at most ``max(sizes)`` tokens through the split graph, padded to a token bucket."""

    def __init__(self, gm: fx.GraphModule, pool: KVPool, sizes: list[int], max_batch_size: int, max_blocks: int):
        if not sizes or min(sizes) < 1:
            raise ValueError(f"piecewise token buckets must be positive and at least one, got {sizes}")
        self.split: SplitGraph = split_at_eager_ops(gm)
        self.pool, self.sizes = pool, sorted(set(sizes))
        self.max_batch_size, self.max_blocks = max_batch_size, max_blocks
        self._size_set = frozenset(self.sizes)
        largest = Padding(self.sizes[-1], max_batch_size, max_blocks)
        self.buffers = StepBuffers(largest.metadata_size, pool.caches[0].device)
        self.state = _StepState()
        slots = _Slots()
        for name in self.split.captured:
            module = getattr(self.split.outer, name)
            setattr(self.split.outer, name, _Piece(name, module, self.state, slots, self.split.fresh_args[name]))
        self.capture_seconds = 0.0
        self.precompiled = 0  # kernels compiled on threads before the captures
        self.memory_bytes = 0  # device memory reserved during the captures

    @property
    def num_pieces(self) -> int:
        return len(self.split.captured)

    @property
    def num_captures(self) -> int:
        return len(self.sizes) * self.num_pieces

    def padding(self, chunks: list[SequenceChunk]) -> Padding | None:
        """The padded shape of a step these graphs run (None: the step does not fit them)."""
        if len(chunks) > self.max_batch_size:
            return None
        tokens = sum(len(c.token_ids) for c in chunks)
        at = bisect.bisect_left(self.sizes, tokens)
        blocks = max(len(c.block_ids) for c in chunks)
        if at == len(self.sizes) or blocks > self.max_blocks:
            return None
        return Padding(self.sizes[at], len(chunks), blocks)

    def prepare(self, chunks: list[SequenceChunk], pad: Padding) -> BatchMetadata:
        """The step's metadata in this runner's buffer (``input_ids`` first, where the pieces read it)."""
        return BatchMetadata.build(chunks, self.pool.block_size, self.buffers.device, pad=pad, buffers=self.buffers)

    def takes(self, batch: BatchMetadata) -> bool:
        return batch.num_tokens in self._size_set

    def run(self, batch: BatchMetadata) -> torch.Tensor:
        """Logits of a step of a captured bucket's token count (padded by :meth:`prepare`, or received
        from tensor-parallel rank 0: inputs elsewhere are copied to where the graphs read them)."""
        return self._run(batch, REPLAY)

    def _run(self, batch: BatchMetadata, mode: str) -> torch.Tensor:
        self.state.mode, self.state.bucket = mode, batch.num_tokens
        try:
            return self.split.outer(**batch.as_kwargs(), **self.pool.as_kwargs())
        finally:
            self.state.mode = REPLAY

    def capture(self, compile_threads: int = 1, compile_workers=None, memory_pool=None) -> None:
        """Every piece at every bucket, largest bucket first; on the CPU the direct stand-in. The
        Triton kernels of every bucket compile on ``compile_threads`` first (``kernels/precompile.py``)."""
        from .kernels.precompile import precompile

        start, device = time.perf_counter(), self.buffers.device
        sizes = sorted(self.sizes, reverse=True)
        cuda = device.type == "cuda"
        reserved = torch.cuda.memory_reserved(device) if cuda else 0
        with torch.inference_mode():
            forwards = functools.partial(self._run_each, sizes, DIRECT)
            self.precompiled = precompile(forwards, device, compile_threads, compile_workers)
            if cuda:
                pool = memory_pool if memory_pool is not None else torch.cuda.graph_pool_handle()
                self.state.new_graph = functools.partial(CudaStepGraph, pool, torch.cuda.Stream(device), True)
            self._run_each(sizes, CAPTURE)
        if cuda:
            torch.cuda.synchronize(device)
            self.memory_bytes = torch.cuda.memory_reserved(device) - reserved
        self.capture_seconds = time.perf_counter() - start
        log.info("captured %d pieces at token buckets %s in %.1f s", self.num_pieces, self.sizes, self.capture_seconds)

    def _run_each(self, sizes: list[int], mode: str) -> None:
        """One step per bucket: a dummy sequence writing slot 0 of block 0 (overwritten before anyone
        reads it), the rest padding."""
        for size in sizes:
            pad = Padding(size, 1, 1)
            self._run(self.prepare([SequenceChunk((0,), 0, (0,))], pad), mode)

    def describe(self) -> str:
        return (f"{self.num_pieces} pieces x {len(self.sizes)} token buckets ({self.sizes[0]}-{self.sizes[-1]}), "
                f"{len(self.split.eager)} eager parts between them")
