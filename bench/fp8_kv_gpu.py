"""GPU check of the FP8 KV cache (``kv_cache_dtype: fp8``): the e4m3 pool against the bf16 one.

1. Kernels, Llama-3.1-8B attention shape (32 q heads, 8 kv heads, head 128, page 16), one layer: a decode
   step at batch 64 x context 4096 (and 1 x 4096, 64 x 512) and a mixed prefill/decode step with padding.
   The bf16 pool is random; the FP8 pool is the same values quantized with per-tensor scales (amax / 448,
   what a calibrated checkpoint stores). Columns: ``kernel err`` = ||triton - reference|| / ||reference||
   on the same FP8 pool (the kernel's correctness; must stay below 1e-2 in bf16) and the cache bytes it
   wrote must equal the reference's; ``vs bf16 KV`` = the same for the FP8 result against the bf16 pool's
   reference (the quantization's cost: ~3-4e-2 on these random values, must stay below 8e-2); ``us`` = CUDA-graph time of one
   layer's launch; ``x bf16`` = the bf16 launch's time over the FP8 one. ``--flashinfer``: FlashInfer's
   FP8 KV cache beside it (kernel err against the same reference, eager time).
2. Model (CUDA, unless ``--no-model``): Llama-3.1-8B shape, random bf16 weights, compiled twice
   (``kv_cache_dtype`` auto and fp8); the bare decode step at batch 64 x context 4096 in ms, and each
   pool's token capacity at the same memory budget.

    python bench/fp8_kv_gpu.py [--flashinfer] [--no-model]   # exit 1 if a check fails
    TRITON_INTERPRET=1 python bench/fp8_kv_gpu.py            # on a CPU: the checks at small sizes, fp32

Expected on an H100/H200: kernel err ~1e-3 (bf16 output rounding), vs bf16 KV ~3-4e-2, the b=64 x 4096 decode launch ~1.6-1.9x
faster with the FP8 pool (it reads half the bytes), and the model step faster by the KV bytes saved.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass

import torch

from kernels_gpu import PagedBatch, paged_batch

import autodeploy.ops  # noqa: F401  (registers the ops)
from autodeploy.ops.paged_attention import to_cache_dtype

CUDA = torch.cuda.is_available()
DEV = torch.device("cuda" if CUDA else "cpu")
DTYPE = torch.bfloat16 if CUDA else torch.float32  # the interpreter gets bf16 wrong
HQ, HKV, D = (32, 8, 128) if CUDA else (4, 2, 32)  # (page 16: kernels_gpu's)
DECODES = [(64, 4096), (1, 4096), (64, 512)] if CUDA else [(4, 100)]
MIXED = [(37, 5), (0, 70), (300, 1), (0, 0), (129, 1), (16, 33)]
KERNEL_TOL, QUANT_TOL = 1e-2, 8e-2
FP8_MAX = 448.0


@dataclass
class Step:
    """One step's inputs (``kernels_gpu.PagedBatch``) run through a paged-attention op."""

    batch: PagedBatch

    @property
    def pool(self) -> torch.Tensor:
        return self.batch.cache

    def run(self, op, cache: torch.Tensor, scales=(1.0, 1.0)) -> torch.Tensor:
        b = self.batch
        return op(b.q, b.k, b.v, cache, b.query_lens, b.context_lens, b.cu_seqlens, b.block_table, b.slots,
                  D ** -0.5, None, None, None, None, None, False, None, None, *scales)


def make_step(seqs: list[tuple[int, int]], pad_tokens: int = 0) -> Step:
    """Sequences of (context_len, query_len) on shuffled pages of a random pool."""
    return Step(paged_batch(seqs, HQ, HKV, D, pad_tokens, device=DEV, dtype=DTYPE))


def fp8_pool(pool: torch.Tensor) -> tuple[torch.Tensor, tuple[float, float]]:
    """The pool quantized as a calibrated checkpoint's scales quantize it: one scale per K and per V."""
    scales = tuple(float(pool[:, i].abs().amax()) / FP8_MAX for i in (0, 1))
    fp8 = torch.empty(pool.shape, dtype=torch.float8_e4m3fn, device=pool.device)
    for i, scale in enumerate(scales):
        fp8[:, i] = to_cache_dtype(pool[:, i], torch.float8_e4m3fn, scale)
    return fp8, scales


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.double(), want.double()
    return float((got - want).norm() / want.norm().clamp_min(1e-30))


def graph_us(call, reps: int = 20) -> float:
    """Median time of one call replayed from a CUDA graph (NaN without CUDA)."""
    if not CUDA:
        return float("nan")
    from gpu_harness import graph_us as harness_graph_us

    return harness_graph_us([call], reps)


@dataclass
class Row:
    name: str
    kernel_err: float
    quant_err: float = float("nan")
    us: float = float("nan")
    bf16_us: float = float("nan")
    note: str = ""

    @property
    def ok(self) -> bool:
        return self.kernel_err < KERNEL_TOL and not self.quant_err >= QUANT_TOL

    def line(self) -> str:
        speedup = self.bf16_us / self.us if self.us == self.us and self.us > 0 else float("nan")
        return (f"{self.name:<38}{self.kernel_err:>11.2e}{self.quant_err:>11.2e}{self.us:>10.1f}{self.bf16_us:>10.1f}"
                f"{speedup:>8.2f}  {'ok' if self.ok else 'FAIL'}  {self.note}")


HEADER = f"{'check':<38}{'kernel err':>11}{'vs bf16 KV':>11}{'fp8 us':>10}{'bf16 us':>10}{'x bf16':>8}"


def check_step(name: str, step: Step, flashinfer: bool) -> list[Row]:
    """The Triton op on the FP8 pool against the reference op on it (output and written bytes) and
    against the reference on the bf16 pool; both pools timed."""
    reference, triton_op = torch.ops.autodeploy.paged_attention.default, torch.ops.autodeploy.paged_attention_triton.default
    fp8, scales = fp8_pool(step.pool)
    want_bf16 = step.run(reference, step.pool.clone())
    want_cache, got_cache = fp8.clone(), fp8.clone()
    want = step.run(reference, want_cache, scales)
    got = step.run(triton_op, got_cache, scales)
    same_bytes = torch.equal(got_cache.view(torch.uint8), want_cache.view(torch.uint8))
    row = Row(f"triton {name}", rel_err(got, want) if same_bytes else float("inf"), rel_err(got, want_bf16),
              note=f"k_scale {scales[0]:.2e}, v_scale {scales[1]:.2e}" + ("" if same_bytes else "; CACHE BYTES DIFFER"))
    row.us = graph_us(lambda: step.run(triton_op, got_cache, scales))
    row.bf16_us = graph_us(lambda: step.run(triton_op, step.pool))
    rows = [row]
    if flashinfer:
        rows.append(flashinfer_row(name, step, fp8, scales, want, want_bf16))
    return rows


def flashinfer_row(name: str, step: Step, fp8: torch.Tensor, scales, want, want_bf16) -> Row:
    """FlashInfer's FP8 KV cache on the same step (eager: FlashInfer plans on the host)."""
    import triton.testing

    op = torch.ops.autodeploy.paged_attention_flashinfer.default
    try:
        cache = fp8.clone()
        got = step.run(op, cache, scales)
        row = Row(f"flashinfer {name}", rel_err(got, want), rel_err(got, want_bf16), note="eager times")
        bench = lambda call: triton.testing.do_bench(call, warmup=5, rep=30, return_mode="median") * 1e3  # noqa: E731
        row.us, row.bf16_us = bench(lambda: step.run(op, cache, scales)), bench(lambda: step.run(op, step.pool))
        return row
    except Exception as exc:  # optional comparison: report, keep checking
        return Row(f"flashinfer {name}", float("inf"), note=f"failed: {type(exc).__name__}: {str(exc)[:100]}")


def model_rows(batch: int = 64, context: int = 4096, steps: int = 20) -> list[Row]:
    """The bare decode step of the 8B shape with a bf16 and an FP8 KV cache (same blocks, random weights)."""
    from decode_bench import bench_autodeploy, compile_autodeploy, free_memory, llama_config

    cfg, times, bytes_per_token = llama_config("llama8b"), {}, {}
    for setting in ("auto", "fp8"):
        model, _ = compile_autodeploy(cfg, batch, context, {"kv_cache_dtype": setting})
        times[setting] = bench_autodeploy(model, batch, context, steps) * 1e3  # us
        bytes_per_token[setting] = sum(spec.bytes_per_token() for spec in model.pool.specs)
        del model
        free_memory()
    row = Row(f"model decode step b={batch} ctx={context}", 0.0, us=times["fp8"], bf16_us=times["auto"])
    row.note = (f"KV bytes per token {bytes_per_token['fp8']} vs {bytes_per_token['auto']}: "
                f"{bytes_per_token['auto'] / bytes_per_token['fp8']:.0f}x the tokens in the same memory")
    return [row]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--flashinfer", action="store_true", help="FlashInfer's FP8 KV cache beside it")
    parser.add_argument("--no-model", action="store_true", help="skip the compiled 8B-shape decode step")
    args = parser.parse_args()
    torch.manual_seed(0)
    print(f"{torch.cuda.get_device_name() if CUDA else 'CPU (interpreter, small sizes, fp32)'}; {DTYPE}")
    rows = []
    for batch, context in DECODES:
        rows += check_step(f"decode b={batch} ctx={context}", make_step([(context - 1, 1)] * batch), args.flashinfer)
    rows += check_step("mixed prefill+decode, padding", make_step(MIXED, pad_tokens=5), args.flashinfer)
    if CUDA and not args.no_model:
        rows += model_rows()
    print(HEADER, *(row.line() for row in rows), sep="\n")
    failed = [row.name for row in rows if not row.ok]
    print(f"checks: {len(rows) - len(failed)} ok, {len(failed)} failed {failed if failed else ''}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
