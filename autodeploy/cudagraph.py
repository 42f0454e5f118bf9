"""CUDA graphs for decode steps (one token per sequence).

Launch overhead dominates small decode steps, so each decode batch size in ``batch_sizes`` is
captured once (largest first, all graphs sharing one memory pool) and replayed: a step of ``B``
sequences runs the graph of the smallest captured size ``>= B``, padded (padding tokens write no
cache slot, padding sequences have no tokens). Static inputs live in one device buffer per graph,
refilled by a single host-to-device copy. Steps that are not decode-only, or larger, run eagerly.
"""

from __future__ import annotations

import logging
import time

import torch
from torch import fx

from .kvcache.metadata import BatchMetadata, DeferredTokens, Padding, SequenceChunk, StepBuffers
from .kvcache.pool import KVPool

log = logging.getLogger("autodeploy.cudagraph")


def default_batch_sizes(max_batch_size: int) -> list[int]:
    """1, 2, 4, 8, 16, 32, then every 32 up to max_batch_size (vLLM/TRT-LLM use similar ladders)."""
    sizes = {s for s in (1, 2, 4, 8, 16, 32) if s <= max_batch_size}
    sizes.update(range(64, max_batch_size + 1, 32))
    sizes.add(max_batch_size)
    return sorted(sizes)


class _Captured:
    def __init__(self, graph: torch.cuda.CUDAGraph, buffers: StepBuffers, pad: Padding, output: torch.Tensor):
        self.graph, self.buffers, self.pad, self.output = graph, buffers, pad, output


class CudaGraphRunner:
    def __init__(self, gm: fx.GraphModule, pool: KVPool, batch_sizes: list[int], max_blocks: int):
        self.gm, self.pool, self.max_blocks = gm, pool, max_blocks
        self.batch_sizes = sorted(batch_sizes)
        self.graphs: dict[int, _Captured] = {}
        self.capture_seconds = 0.0
        self.precompiled = 0  # kernels compiled on threads before the captures

    def capture(self, compile_threads: int = 1, compile_workers=None) -> None:
        """Capture every batch size, largest first. With ``compile_threads`` > 1 the Triton kernels the
        warm-up forwards would compile one at a time (a fresh host: 1-3 s each) compile on that many
        threads first (``kernels/precompile.py``; with ``compile_workers``, in those processes first)."""
        from .kernels.precompile import precompile

        start = time.perf_counter()
        sizes = sorted(self.batch_sizes, reverse=True)
        statics = {size: self._static_step(size) for size in sizes}

        def forwards():
            with torch.inference_mode():
                for _, _, inputs in statics.values():
                    self.gm(**inputs)

        self.precompiled = precompile(forwards, self.pool.caches[0].device, compile_threads, compile_workers)
        memory_pool = torch.cuda.graph_pool_handle()
        for size in sizes:
            self.graphs[size] = self._capture_one(*statics[size], memory_pool)
        torch.cuda.synchronize()
        self.capture_seconds = time.perf_counter() - start
        log.info("captured CUDA graphs for decode batch sizes %s in %.1f s", self.batch_sizes, self.capture_seconds)

    def _static_step(self, size: int) -> tuple[StepBuffers, Padding, dict[str, torch.Tensor]]:
        """The captured step's input buffers: one real dummy sequence writing block 0 (overwritten
        before anyone reads it), the rest padding."""
        pad = Padding(num_tokens=size, num_seqs=size, max_blocks=self.max_blocks)
        device = self.pool.caches[0].device
        buffers = StepBuffers(pad.metadata_size, device)
        static = BatchMetadata.build([SequenceChunk((0,), 0, (0,))], self.pool.block_size, device, pad=pad,
                                     buffers=buffers)
        return buffers, pad, {**static.as_kwargs(), **self.pool.as_kwargs()}

    def _capture_one(self, buffers: StepBuffers, pad: Padding, inputs: dict, memory_pool) -> _Captured:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream), torch.inference_mode():
            for _ in range(1):  # warm up: kernel compilation, lazy initialisation, allocator
                self.gm(**inputs)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.inference_mode(), torch.cuda.graph(graph, pool=memory_pool):
            output = self.gm(**inputs)
        return _Captured(graph, buffers, pad, output)

    def fits(self, chunks: list[SequenceChunk]) -> bool:
        return (
            bool(self.graphs)
            and len(chunks) <= self.batch_sizes[-1]
            and all(len(c.token_ids) == 1 and c.num_logits == 1 for c in chunks)
            and max(len(c.block_ids) for c in chunks) <= self.max_blocks
        )

    def run(self, chunks: list[SequenceChunk], deferred: DeferredTokens | None = None, publisher=None) -> torch.Tensor:
        """Logits of a decode step; valid until the next replay of the same graph. ``publisher``
        (tensor parallel, rank 0) sends the staged inputs to the other ranks before the replay."""
        size = next(s for s in self.batch_sizes if s >= len(chunks))
        captured = self.graphs[size]
        BatchMetadata.refill(chunks, self.pool.block_size, captured.pad, captured.buffers)
        if deferred is not None:
            deferred.write(captured.buffers.input_ids(captured.pad.num_tokens))
        if publisher is not None:
            publisher.graph(size, self.staged_input(size))
        captured.graph.replay()
        return captured.output[: len(chunks)]

    def staged_input(self, size: int) -> torch.Tensor:
        """The device buffer the graph of ``size`` sequences reads its metadata from."""
        captured = self.graphs[size]
        return captured.buffers.dev[: captured.pad.metadata_size]

    def replay(self, size: int) -> torch.Tensor:
        """Replay the graph of ``size`` sequences on whatever its staged input holds (the other
        tensor-parallel ranks receive rank 0's staged input, then replay)."""
        captured = self.graphs[size]
        captured.graph.replay()
        return captured.output
