"""``CompiledModel``: the one contract the engine and the server use.

A compiled model runs one engine step: given the chunks of the scheduled sequences (see
``autodeploy.kvcache.metadata``), it returns one row of logits per sequence (at its chunk's last
token; a chunk may ask for its last ``num_logits`` tokens instead). It owns the KV pool;
block ids (and state slots, for a model with recurrent or convolution state) are handed out by
the caller (the engine's block manager).

A step runs one of four ways: a decode step that fits a captured decode graph replays it
(``autodeploy.cudagraph``); another step that fits a whole-step graph (at most the largest token
bucket, one logits row per chunk) is padded to its token and sequence buckets and replays it
(``autodeploy.mixed_graphs``); the others of at most the largest token bucket are padded to their
bucket and replay the pieces between eager attention calls (``autodeploy.piecewise``); the rest run
the graph eagerly.
"""

from __future__ import annotations

import functools
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import fx
from transformers import PretrainedConfig

from .config import CompileConfig
from .cudagraph import CudaGraphRunner
from .kvcache.metadata import BatchMetadata, DeferredTokens, Padding, SequenceChunk, StepBuffers
from .kvcache.pool import KVCapacity, KVPool
from .mixed_graphs import MixedGraphRunner
from .piecewise import PiecewiseRunner


@dataclass(frozen=True)
class CompileReport:
    """What compilation did and how long it took."""

    model_type: str
    architecture: str
    dtype: torch.dtype
    device: torch.device
    stage_seconds: dict[str, float]
    passes: list  # PassRecord, in order
    op_counts: dict[str, int] = field(default_factory=dict)
    quantization: tuple[str, ...] = ()  # what the quantize pass did (QuantSummary.lines()); () if nothing
    kv_cache: str = ""  # the KV cache's dtype and where it comes from (insert_kv_cache)

    def quantization_lines(self) -> list[str]:
        """What was quantized (format, layers, exclusions) and the KV cache's dtype."""
        dtype = str(self.dtype).removeprefix("torch.")
        return list(self.quantization) or [f"none (weights in {dtype}, KV cache {self.kv_cache or dtype})"]

    def pass_table(self) -> str:
        lines = [f"{'pass':<26}{'stage':<14}{'matches':>8}{'ms':>10}  detail"]
        for r in self.passes:
            ms = "-" if r.skipped else f"{r.ms:.1f}"
            lines.append(f"{r.name:<26}{r.stage:<14}{r.matches:>8}{ms:>10}  {r.detail}")
        return "\n".join(lines)


class CompiledModel:
    def __init__(
        self,
        gm: fx.GraphModule,
        pool: KVPool,
        capacity: KVCapacity,
        hf_config: PretrainedConfig,
        config: CompileConfig,
        report: CompileReport,
        model_dir: Path | None,
        cuda_graphs: CudaGraphRunner | None = None,
        piecewise: PiecewiseRunner | None = None,
        mixed_graphs: MixedGraphRunner | None = None,
    ):
        self.gm = gm
        self.pool = pool
        self.capacity = capacity
        self.hf_config = hf_config
        self.config = config
        self.report = report
        self.model_dir = model_dir
        self.cuda_graphs = cuda_graphs
        self.piecewise = piecewise
        self.mixed_graphs = mixed_graphs
        self.publisher = None  # tensor parallel, rank 0: a StepPublisher sends each step to the other ranks
        # metadata staging buffers sized for the largest step (max_num_tokens, max_batch_size, max_seq_len)
        largest = Padding(config.max_num_tokens, config.max_batch_size, capacity.max_blocks_per_seq)
        self._buffers = StepBuffers(largest.metadata_size, report.device)

    @property
    def device(self) -> torch.device:
        return self.report.device

    @property
    def block_size(self) -> int:
        return self.pool.block_size

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def max_seq_len(self) -> int:
        return self.capacity.max_seq_len

    @property
    def num_state_slots(self) -> int:
        """Sequences the state pool holds at once (0: no layer with recurrent or convolution state)."""
        return self.pool.state.num_slots if self.pool.state is not None else 0

    @functools.cached_property
    def vocab_size(self) -> int:
        return int(self.gm.graph.output_node().args[0].meta["val"].shape[-1])

    def prepare(self, chunks: list[SequenceChunk]) -> BatchMetadata:
        """Batch metadata of one step, on the device (one host-to-device copy); padded to a token
        bucket of the piecewise graphs when the step fits one."""
        if self.piecewise is not None and (pad := self.piecewise.padding(chunks)) is not None:
            return self.piecewise.prepare(chunks, pad)
        fits = sum(len(c.token_ids) for c in chunks) <= self.config.max_num_tokens and len(chunks) <= self.config.max_batch_size
        return BatchMetadata.build(chunks, self.block_size, self.device, buffers=self._buffers if fits else None)

    @torch.inference_mode()
    def forward(self, batch: BatchMetadata) -> torch.Tensor:
        """Logits ``[num_logits, vocab]``: one row per requested token (by default each chunk's last);
        through the piecewise graphs when the step's token count is one of their buckets (tensor
        parallel: every rank decides alike, from the step rank 0 publishes)."""
        if self.piecewise is not None and self.piecewise.takes(batch):
            return self.piecewise.run(batch)
        return self.gm(**batch.as_kwargs(), **self.pool.as_kwargs())

    @torch.inference_mode()
    def __call__(self, chunks: list[SequenceChunk], deferred: DeferredTokens | None = None) -> torch.Tensor:
        """One step: logits ``[len(chunks), vocab]``: a decode graph, a whole-step graph, the piecewise
        graphs or eagerly.

        ``deferred`` fills input ids that are still on the device (``PLACEHOLDER_TOKEN`` in the
        chunks). The returned tensor may be a view of a graph's static output: consume it before the
        next step.
        """
        if self.cuda_graphs is not None and self.cuda_graphs.fits(chunks):
            return self.cuda_graphs.run(chunks, deferred, self.publisher)
        if self.mixed_graphs is not None and (pad := self.mixed_graphs.padding(chunks)) is not None:
            return self.mixed_graphs.run(chunks, pad, deferred, self.publisher)
        batch = self.prepare(chunks)
        if deferred is not None:
            deferred.write(batch.input_ids)
        if self.publisher is not None:
            self.publisher.eager(batch)
        return self.forward(batch)


def canonical_op_counts(gm: fx.GraphModule) -> dict[str, int]:
    counts = Counter(
        n.target._opname if hasattr(n.target, "_opname") else str(n.target)
        for n in gm.graph.nodes
        if n.op == "call_function" and str(getattr(n.target, "namespace", "")) == "autodeploy"
    )
    return dict(sorted(counts.items()))
