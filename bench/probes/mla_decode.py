"""Multi-head latent attention (MLA) at DeepSeek-V3's attention shape: one layer's decode timed in a CUDA graph
against an MHA cache of the same model's bytes (the question: how much less does the latent cache read?).

DeepSeek-V3 has 128 heads, a latent of r = 512 and a rotary key of dr = 64 per token (nope 128, value 128). Its
latent cache holds r + dr = 576 values per token and layer; the MHA cache of the same model would hold every
head's key (128 + 64) and value (128): 40960 values. Timed: the op (with its W_UK / W_UV products), the kernel
alone, and the Triton paged attention over an MHA cache of those bytes (160 heads x 128 for K and for V) at
batch 64 x 4096, and batch 1 x 4096 for the split path; then the latent/MHA ratios of the pages read and of
the times. Answered 2026-12-07 (docs/perf.md: 0.0141 of the bytes, 845 vs ~7,032 us). The op's correctness on
CUDA: ``tests/gpu/test_mla_gpu.py``.

    PYTHONPATH=bench python bench/probes/mla_decode.py
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass

import torch

import kernel_bench as kg  # (bench/: paged MHA batches)
from gpu_harness import DEV, Report, Row, sets_for, timed

from autodeploy.kernels.mla_attention import MLALaunch, mla_attention_fwd  # noqa: E402
from autodeploy.kvcache.pool import MAX_ELEMENTS_PER_LAYER  # noqa: E402
from autodeploy.ops.mla import split_kv_b  # noqa: E402

HEADS, RANK, ROPE, NOPE, V = 128, 512, 64, 128, 128  # DeepSeek-V3
MHA_VALUES = HEADS * (NOPE + ROPE + V)  # per token: every head's key and value
MHA_HEADS, MHA_DIM = MHA_VALUES // 256, 128  # the same values per token as K and V of head size 128
LATENT_VALUES = RANK + ROPE


@dataclass
class LatentStep:
    """One paged MLA step: inputs, the latent cache and the batch metadata (``autodeploy.kvcache.metadata``)."""

    q_nope: torch.Tensor
    q_pe: torch.Tensor
    c_kv: torch.Tensor
    k_pe: torch.Tensor
    w_kv_b: torch.Tensor
    cache: torch.Tensor
    meta: tuple[torch.Tensor, ...]  # query_lens, context_lens, cu_seqlens, block_table, slot_mapping
    scale: float

    def op(self, cache: torch.Tensor | None = None) -> torch.Tensor:
        return torch.ops.autodeploy.paged_mla_triton(*self.inputs(), self.cache if cache is None else cache,
                                                     *self.meta, self.scale)

    def reference(self, cache: torch.Tensor) -> torch.Tensor:
        return torch.ops.autodeploy.paged_mla(*self.inputs(), cache, *self.meta, self.scale)

    def inputs(self) -> tuple[torch.Tensor, ...]:
        return self.q_nope, self.q_pe, self.c_kv, self.k_pe, self.w_kv_b

    def kernel_call(self):
        """The kernel alone, on queries already taken onto the latent (what the op hands it)."""
        w_uk, _ = split_kv_b(self.w_kv_b, self.q_nope.shape[1], self.q_nope.shape[2])
        q_lat = torch.bmm(self.q_nope.transpose(0, 1), w_uk).transpose(0, 1).contiguous()
        _, context_lens, cu, table, slots = self.meta
        return lambda: mla_attention_fwd(q_lat, self.q_pe, self.c_kv, self.k_pe, self.cache, cu, context_lens,
                                         table, slots, self.scale)


def latent_step(seqs: list[tuple[int, int]], heads=HEADS, rank=RANK, rope=ROPE, nope=NOPE, v=V, pad_tokens=0,
                dtype=torch.bfloat16, device=DEV) -> LatentStep:
    """Sequences of (context_len, query_len) on shuffled pages of a random latent cache."""
    meta, pages = kg.paged_metadata(seqs, pad_tokens, device)
    tokens = meta[-1].shape[0]
    rand = lambda *shape: torch.randn(*shape, device=device, dtype=dtype)  # noqa: E731
    return LatentStep(rand(tokens, heads, nope), rand(tokens, heads, rope), rand(tokens, rank), rand(tokens, rope),
                      rand(heads * (nope + v), rank) * rank**-0.5, rand(pages, kg.PAGE, rank + rope), meta,
                      (nope + rope) ** -0.5)


def _io_bytes(tokens: int, *widths: int) -> int:
    return tokens * sum(widths) * 2


def time_decode(report: Report, batch: int, ctx: int = 4096) -> tuple[float, int, float, int]:
    """One layer's decode step at ``batch`` x ``ctx``: the MLA op's graph time and the bytes of the latent
    cache it reads (the allocated pages), the same for the MHA cache."""
    latent = batch * ctx * LATENT_VALUES * 2
    steps = [latent_step([(ctx - 1, 1)] * batch) for _ in range(sets_for(latent, cap=16))]
    launch = MLALaunch.choose(batch, batch, HEADS, steps[0].meta[3].shape[1] * kg.PAGE, DEV)
    note = f"latent cache {latent / 1e6:.0f} MB; tile {launch.block_h}h x {launch.block_q}t, splits {launch.num_splits}"
    weights = HEADS * (NOPE + V) * RANK * 2
    op_bytes = latent + weights + _io_bytes(batch, HEADS * NOPE, HEADS * ROPE, RANK, ROPE, HEADS * V)
    op = timed(Row(f"mla op decode b={batch} ctx={ctx}", note=note), lambda i: steps[i % len(steps)].op, None,
               op_bytes)
    report.add(op)
    kernel_bytes = latent + _io_bytes(batch, 2 * HEADS * RANK, HEADS * ROPE, RANK, ROPE)
    report.add(timed(Row(f"mla kernel decode b={batch} ctx={ctx}"), lambda i: steps[i % len(steps)].kernel_call(),
                     None, kernel_bytes))
    latent_pool = steps[0].cache.nbytes
    del steps
    # An MHA pool of 64 x 4096 tokens at these widths passes the 2^31 elements one layer's tensor may hold
    # (the kernels' 32-bit offsets, autodeploy/kvcache/pool.py): time the most sequences that fit, and scale
    # (decode attention reads each sequence's pages once: its time grows with the batch).
    page_values = 2 * kg.PAGE * MHA_HEADS * MHA_DIM
    fits = min(batch, (MAX_ELEMENTS_PER_LAYER // page_values - 1) // -(-ctx // kg.PAGE))
    mha_bytes = fits * ctx * MHA_VALUES * 2
    mha = kg.paged_batch([(ctx - 1, 1)] * fits, heads=MHA_HEADS, kv_heads=MHA_HEADS, head_dim=MHA_DIM)
    scaled = f"; timed at b={fits}, x{batch / fits:.0f}" if fits < batch else ""
    row = timed(Row(f"mha decode b={fits} ctx={ctx} (same bytes per token)",
                    note=f"K+V cache {mha_bytes / 1e9:.2f} GB{scaled}"),
                lambda i: mha.triton, None, mha_bytes + _io_bytes(fits, 4 * MHA_HEADS * MHA_DIM))
    report.add(row)
    mha_pool = mha.cache.nbytes * batch // fits
    del mha
    torch.cuda.empty_cache()
    return op.graph_us, latent_pool, row.graph_us * batch / fits, mha_pool


def main() -> int:
    torch.manual_seed(0)
    print(f"{torch.cuda.get_device_name(DEV)}; torch {torch.__version__}", flush=True)
    report = Report()
    time_decode(report, 1)
    mla_us, latent_pool, mha_us, mha_pool = time_decode(report, 64)
    ratio = latent_pool / mha_pool
    report.add(Row("latent / MHA cache bytes b=64 ctx=4096", 0.0 if ratio <= 0.25 else math.inf,
                   note=f"{ratio:.4f}: {latent_pool / 1e6:.0f} MB vs {mha_pool / 1e6:.0f} MB of pages allocated "
                        f"and read ({LATENT_VALUES} vs {MHA_VALUES} values per token); done when <= 0.25"))
    report.add(Row("MLA op / MHA time b=64 ctx=4096", None, note=f"{mla_us / mha_us:.3f} ({mla_us:.0f} us vs "
                                                                  f"{mha_us:.0f} us)"))
    print(report.table())
    return 0 if all(row.ok for row in report.rows) else 1


if __name__ == "__main__":
    sys.exit(main())
