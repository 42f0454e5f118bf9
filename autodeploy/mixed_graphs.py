"""Whole-step CUDA graphs of prefill and mixed (prefill chunks + decodes) steps.

The piecewise graphs (``autodeploy.piecewise``) replay the layers between eager attention calls: an
8B mixed step still costs ~8 ms of host time (32 attention launches of ~50 arguments, 33 replays, the
copies into slots). A whole step can be one graph when every op's launch follows from tensor shapes
alone and nothing synchronises with the host: the Triton paged-attention kernel derives its grid and
configuration from the token count T and the sequence count B only (``kernels/attention_config.py``),
handles padding tokens (past ``cu_seqlens[B]``) and padding sequences (no tokens, no blocks), and
never reads a metadata value on the host. So a step of ``n`` sequences and ``t`` tokens replays the
graph of the smallest token bucket ``T >= t`` (the piecewise buckets) and of the smallest sequence
bucket ``B >= n`` captured for that ``T``.

Sequence buckets: two per token bucket at most. ``AttentionLaunch.choose`` picks its decode launch
(16-row tiles) when ``T <= 4 B`` and its prefill launch (128-row tiles) otherwise, so padding the
sequences changes the launch a step gets unless the bucket keeps the side of that line the real
step is on: the *prefill bucket* ``B = min(max_batch_size, (T - 1) // 4)`` (the most sequences a
prefill launch at ``T`` admits) takes steps of at most that many sequences, the *mixed bucket*
``B = min(max_batch_size, T - 1)`` the others. Each step gets the launch the piecewise path gives it
(which runs attention at ``T`` tokens and the real sequence count). ``B`` stays below ``T``: with as
many logits rows as tokens the logits gather is the identity (``passes/gather_logits.py``), right
only for a step of single-token chunks, so a decode-only step of exactly ``T`` sequences is left to
the decode graphs (or the piecewise path), and no step of one token has a graph here. The LM head
runs on ``B`` rows (padding sequences read row 0): for an 8B model at most a few hundred rows,
about the cost of streaming its weights once.

Static inputs: every graph reads its metadata from one shared device buffer (graphs replay one at a
time, each after its own refill: ``BatchMetadata.refill``, one host-to-device copy). The graphs share
the memory pool of the decode and piecewise graphs and hold their logits weakly (valid until the next
step, as ``CompiledModel.__call__`` says), so they add about one step's activations at the largest
bucket to the pool, which the piecewise graphs need anyway.

Steps that do not fit stay piecewise or eager: a chunk asking for several logits rows, more tokens
than the largest bucket, more blocks than a sequence may have; models whose ops synchronise with the
host or loop over the sequences on it (MoE's reference routing, the state ops of hybrids), attention
backends that do (torch, flashinfer) get no whole-step graphs at all (``passes/compile_cuda_graphs.py``
says why in the pass table). Tensor parallel: rank 0 publishes the shape and the staged buffer, the
other ranks replay the same graph (``autodeploy.distributed_steps``).
"""

from __future__ import annotations

import bisect
import logging
import time

import torch
from torch import fx

from .cudagraph import CudaStepGraph, DirectStepGraph, dummy_step_inputs
from .kernels.attention_config import DECODE_TOKENS_PER_SEQ
from .kvcache.metadata import BatchMetadata, DeferredTokens, Padding, SequenceChunk, StepBuffers
from .kvcache.pool import KVPool

log = logging.getLogger("autodeploy.mixed_graphs")


def sequence_buckets(num_tokens: int, max_batch_size: int) -> list[int]:
    """The sequence counts captured at token bucket ``num_tokens``: the prefill bucket (the most
    sequences for which the attention kernel still takes its prefill launch), then the mixed bucket
    (fewer sequences than tokens: see the module docstring)."""
    prefill = min(max_batch_size, (num_tokens - 1) // DECODE_TOKENS_PER_SEQ)
    mixed = min(max_batch_size, num_tokens - 1)
    return sorted({b for b in (prefill, mixed) if b >= 1})


class MixedGraphRunner:
    """Whole-step graphs of ``(token bucket, sequence bucket)`` shapes over ``token_sizes``."""

    def __init__(self, gm: fx.GraphModule, pool: KVPool, token_sizes: list[int], max_batch_size: int,
                 max_blocks: int):
        if not any(sequence_buckets(t, max_batch_size) for t in token_sizes):
            raise ValueError(f"whole-step graphs need a token bucket of more than one token, got {token_sizes}")
        self.gm, self.pool, self.max_blocks, self.max_batch_size = gm, pool, max_blocks, max_batch_size
        self.token_sizes = sorted(set(token_sizes))
        self.seq_sizes = {t: sequence_buckets(t, max_batch_size) for t in self.token_sizes}
        self.shapes = [Padding(t, b, max_blocks) for t in self.token_sizes for b in self.seq_sizes[t]]
        self.buffers = StepBuffers(max(p.metadata_size for p in self.shapes), pool.caches[0].device)
        self.graphs: dict[tuple[int, int], CudaStepGraph | DirectStepGraph] = {}  # by (tokens, sequences)
        self.capture_seconds = 0.0
        self.precompiled = 0  # kernels compiled on threads before the captures
        self.memory_bytes = 0  # device memory reserved during the captures

    @property
    def num_captures(self) -> int:
        return len(self.shapes)

    @property
    def buffer_bytes(self) -> int:
        """The static metadata buffers: one on the device, two pinned on the host."""
        return 3 * self.buffers.dev.numel() * self.buffers.dev.element_size()

    def padding(self, chunks: list[SequenceChunk]) -> Padding | None:
        """The captured shape a step replays (None: no graph takes it)."""
        if not self.graphs or len(chunks) > self.max_batch_size or any(c.num_logits != 1 for c in chunks):
            return None
        if max(len(c.block_ids) for c in chunks) > self.max_blocks:
            return None
        tokens = sum(len(c.token_ids) for c in chunks)
        at = bisect.bisect_left(self.token_sizes, tokens)
        if at == len(self.token_sizes):
            return None
        size = self.token_sizes[at]
        seqs = next((b for b in self.seq_sizes[size] if b >= len(chunks)), None)  # None: decodes filling T
        return Padding(size, seqs, self.max_blocks) if seqs is not None else None

    def run(self, chunks: list[SequenceChunk], pad: Padding, deferred: DeferredTokens | None = None,
            publisher=None) -> torch.Tensor:
        """Logits of the step (one row per chunk), a view of the graph's output: consume it before the
        next step (any replay may reuse its memory). ``publisher`` (tensor parallel, rank 0) sends the
        staged inputs to the other ranks before the replay."""
        BatchMetadata.refill(chunks, self.pool.block_size, pad, self.buffers)
        if deferred is not None:
            deferred.write(self.buffers.input_ids(pad.num_tokens))
        if publisher is not None:
            publisher.whole_step(pad.num_tokens, pad.num_seqs, self.staged_input(pad.num_tokens, pad.num_seqs))
        return self.replay(pad.num_tokens, pad.num_seqs)[: len(chunks)]

    def staged_input(self, tokens: int, seqs: int) -> torch.Tensor:
        """The device buffer the graph of ``tokens`` x ``seqs`` reads its metadata from (its first values)."""
        return self.buffers.dev[: Padding(tokens, seqs, self.max_blocks).metadata_size]

    @torch.inference_mode()  # (the CPU stand-in's replay writes into its inference-mode outputs)
    def replay(self, tokens: int, seqs: int) -> torch.Tensor:
        """Replay the graph of ``tokens`` x ``seqs`` on whatever the buffer holds (the other tensor-parallel
        ranks receive rank 0's staged input, then replay); its whole output, padding rows included."""
        return self.graphs[(tokens, seqs)].replay()

    def capture(self, compile_threads: int = 1, compile_workers=None, memory_pool=None) -> None:
        """Every shape, largest first, into ``memory_pool`` (default: a new one); on the CPU the direct
        stand-in. The Triton kernels of every shape compile on ``compile_threads`` first."""
        from .kernels.precompile import precompile

        start, device = time.perf_counter(), self.buffers.device
        cuda = device.type == "cuda"
        reserved = torch.cuda.memory_reserved(device) if cuda else 0
        shapes = sorted(self.shapes, key=lambda p: (p.num_tokens, p.num_seqs), reverse=True)
        with torch.inference_mode():
            self.precompiled = precompile(lambda: [self.gm(*self._static_step(p)) for p in shapes], device,
                                          compile_threads, compile_workers)
            pool = (memory_pool if memory_pool is not None else torch.cuda.graph_pool_handle()) if cuda else None
            stream = torch.cuda.Stream(device) if cuda else None
            for pad in shapes:
                graph = CudaStepGraph(pool, stream, weak_outputs=True) if cuda else DirectStepGraph()
                what = f"the whole step of {pad.num_tokens} tokens and {pad.num_seqs} sequences"
                graph.capture(self.gm, self._static_step(pad), what, "mixed_graphs=false")
                self.graphs[(pad.num_tokens, pad.num_seqs)] = graph
        if cuda:
            torch.cuda.synchronize(device)
            self.memory_bytes = torch.cuda.memory_reserved(device) - reserved
        self.capture_seconds = time.perf_counter() - start
        log.info("captured whole-step graphs %s in %.1f s", self.describe(), self.capture_seconds)

    def _static_step(self, pad: Padding) -> tuple[torch.Tensor, ...]:
        """The graph's inputs for ``pad``, staged in the shared buffer (``cudagraph.dummy_step_inputs``)."""
        return dummy_step_inputs(self.gm, self.pool, pad, self.buffers)

    def describe(self) -> str:
        return (f"{self.num_captures} shapes over {len(self.token_sizes)} token buckets "
                f"({self.token_sizes[0]}-{self.token_sizes[-1]} tokens, up to {self.max_batch_size} sequences)")
