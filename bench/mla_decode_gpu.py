"""GPU check and timing of multi-head latent attention (MLA) at DeepSeek-V3's attention shape.

DeepSeek-V3 has 128 heads, a latent of r = 512 and a rotary key of dr = 64 per token (nope 128, value
128). Its latent cache (``autodeploy.kvcache.pool``) holds r + dr = 576 values per token and layer; the
MHA cache of the same model would hold every head's key (128 + 64) and value (128): 40960 values.

1. bf16 check at batch 64 x context 4096 (and a mixed prefill/decode step with padding): the Triton op
   (``paged_mla_triton``: absorbed up-projections, latent cache write, flash-decoding) against the expanded
   torch reference (``paged_mla``, HF's math); the written cache must equal the reference's bit for bit.
2. One layer's decode step timed in a CUDA graph (``gpu_harness``): the op (with its W_UK / W_UV products),
   the kernel alone, and the Triton paged attention over an MHA cache of the same model's bytes (160 heads
   x 128 for K and for V = 40960 values per token: the kernel's best-tuned head size) at batch 64 x 4096;
   batch 1 x 4096 for the split path.
   The ``MB`` column is what each must read (caches, weights, activations once); the last rows give
   the latent/MHA ratios of the cache pages read (the allocated pools' bytes; done when <= 1/4) and of the
   measured times.
3. Capture: tiny deepseek_v3 (MLA) and gpt_oss (attention sinks, sliding window) compiled on CUDA with the
   triton backend, decode steps as CUDA graphs, pass the fp32 canary (FlashInfer's refusal of MLA and sinks
   is checked on the CPU: ``tests/kernels/test_mla_golden.py``, ``test_attention_backends.py``).

    python bench/mla_decode_gpu.py               # ~2 minutes on a fresh H100/H200
    python bench/mla_decode_gpu.py --no-canary   # kernels only

Exit status 1 if any check fails.
"""

from __future__ import annotations

import argparse
import math
import sys
import tempfile
from dataclasses import dataclass

import torch

try:  # the real package first (the canary compiles models); kernels_gpu stubs it only where it is missing
    import autodeploy  # noqa: F401
except ImportError:
    pass
import kernels_gpu as kg  # noqa: E402  (this folder: paged MHA batches)
from gpu_harness import DEV, Report, Row, rel_err, sets_for, timed  # noqa: E402

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


def check(step: LatentStep, pad_tokens: int = 0) -> float:
    """Relative error of the op against the reference; inf if the written caches differ or a padding row is
    not zero."""
    want_cache, got_cache = step.cache.clone(), step.cache.clone()
    want, got = step.reference(want_cache), step.op(got_cache)
    real = got.shape[0] - pad_tokens
    if not torch.equal(got_cache, want_cache) or (pad_tokens and got[real:].abs().max() != 0):
        return math.inf
    return rel_err(got[:real], want[:real])


def check_mla(report: Report) -> None:
    mixed = [(37, 5), (0, 70), (300, 1), (0, 0), (129, 1), (16, 33), (1000, 1)]
    report.add(Row("check mla mixed step + padding", check(latent_step(mixed, pad_tokens=5), pad_tokens=5),
                   note="prefill, chunked prefill, decodes, an empty sequence, 5 padding tokens"))
    for batch in (1, 64):
        report.add(Row(f"check mla decode b={batch} ctx=4096", check(latent_step([(4095, 1)] * batch)),
                       note="vs the expanded reference; written cache equal"))


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


def canaries(report: Report) -> None:
    from autodeploy.check import run_check
    from autodeploy.compiler import compile as compile_model
    from autodeploy.tiny import make_tiny_checkpoint

    tmp = tempfile.mkdtemp()
    for arch in ("deepseek_v3", "gpt_oss"):
        path = make_tiny_checkpoint(arch, f"{tmp}/{arch}")
        model = compile_model(path, device="cuda", dtype="float32", attention_backend="triton", max_batch_size=4,
                              max_seq_len=64)
        graphs = sorted(model.cuda_graphs.graphs) if model.cuda_graphs is not None else []
        result = run_check(path, compiled=model)
        ok = result.passed and bool(graphs)
        report.add(Row(f"canary {arch} (triton, CUDA graphs)", 0.0 if ok else math.inf,
                       note=f"graphs for batch sizes {graphs}; {result.summary()[:90]}"))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--no-canary", action="store_true", help="kernel checks and timings only")
    args = parser.parse_args()
    torch.manual_seed(0)
    print(f"{torch.cuda.get_device_name(DEV)}; torch {torch.__version__}", flush=True)
    report = Report()
    check_mla(report)
    time_decode(report, 1)
    mla_us, latent_pool, mha_us, mha_pool = time_decode(report, 64)
    ratio = latent_pool / mha_pool
    report.add(Row("latent / MHA cache bytes b=64 ctx=4096", 0.0 if ratio <= 0.25 else math.inf,
                   note=f"{ratio:.4f}: {latent_pool / 1e6:.0f} MB vs {mha_pool / 1e6:.0f} MB of pages allocated "
                        f"and read ({LATENT_VALUES} vs {MHA_VALUES} values per token); done when <= 0.25"))
    report.add(Row("MLA op / MHA time b=64 ctx=4096", None, note=f"{mla_us / mha_us:.3f} ({mla_us:.0f} us vs "
                                                                  f"{mha_us:.0f} us)"))
    if not args.no_canary:
        canaries(report)
    print(report.table())
    return 0 if all(row.ok for row in report.rows) else 1


if __name__ == "__main__":
    sys.exit(main())
