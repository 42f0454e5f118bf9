"""GPU check and timing of the attention variants: chunked attention (Llama-4) and ALiBi (Bloom, MPT).

1. The Triton paged attention against the reference op in bf16, on the 8B attention shape (32/8 heads,
   head 128, page 16): mixed steps (prefill, chunked prefill, decodes, padding, an empty sequence) with
   chunks, ALiBi, and both with a window and a softcap; the written cache must equal the reference's bit
   for bit; decode-shaped launches with 3 and 16 splits (preloaded first block) and a prefill launch.
2. Timings in a CUDA graph (``kernels_gpu.py``'s harness): the plain kernel's decode at batch 1 and 64
   (ctx 512 and 4096), the path the variants must leave unchanged (its sm_90 code is byte-identical:
   ``compile_sm90.py --sass``; compare these rows with ``kernels_gpu.py``'s on the commit before), then
   the chunked and ALiBi variants beside them (bytes: the plain cost; a chunk reads fewer keys).
3. The canary (fp32, compiled vs HF eager) on CUDA for tiny llama4_text (chunks of 8, query
   temperature), bloom, mpt (ALiBi), gpt_neo and xglm with each backend of ``--backends``; FlashInfer
   must refuse the chunked and ALiBi models at compile time (and refuses the others' head dim of 16).

    python bench/attention_variants_gpu.py                       # triton + torch backends
    python bench/attention_variants_gpu.py --backends triton torch flashinfer
    python bench/attention_variants_gpu.py --no-canary           # kernels only (needs no transformers)

Exit status 1 if any check fails.
"""

from __future__ import annotations

import argparse
import math
import sys
import tempfile

import torch

try:  # the real package first (the canary compiles models); kernels_gpu stubs it only where it is missing
    import autodeploy  # noqa: F401
except ImportError:
    pass
import kernels_gpu as kg  # noqa: E402  (this folder: the paged batches and the bf16 8B attention shape)
from gpu_harness import DEV, Report, Row, rel_err, sets_for, timed  # noqa: E402

from autodeploy.kernels.attention_config import AttentionLaunch  # noqa: E402

SLOPES = 2.0 ** -torch.arange(1, kg.HQ + 1, dtype=torch.float32)  # Bloom's slopes for 32 heads
VARIANTS = {
    "chunk64": dict(chunk_size=64),
    "chunk1024": dict(chunk_size=1024),
    "alibi": dict(alibi_slopes=SLOPES * 4),  # steeper than Bloom's: the bias matters within a few keys
    "chunk48 window20 softcap30 alibi": dict(chunk_size=48, sliding_window=20, logit_softcap=30.0,
                                             alibi_slopes=SLOPES * 4),
}


def reference(batch: "kg.PagedBatch", cache: torch.Tensor, **features) -> torch.Tensor:
    return torch.ops.autodeploy.paged_attention(
        batch.q, batch.k, batch.v, cache, batch.query_lens, batch.context_lens, batch.cu_seqlens,
        batch.block_table, batch.slots, kg.D ** -0.5, features.get("sliding_window"), features.get("logit_softcap"),
        None, chunk_size=features.get("chunk_size"), alibi_slopes=features.get("alibi_slopes"))


def on_device(features: dict) -> dict:
    return {k: v.to(DEV) if isinstance(v, torch.Tensor) else v for k, v in features.items()}


def check_variants(report: Report) -> None:
    """Mixed steps with every variant: output, padding rows, written cache, forced split counts."""
    mixed = [(37, 5), (0, 70), (300, 1), (0, 0), (129, 1), (16, 33), (1000, 1), (500, 40)]
    for name, features in VARIANTS.items():
        features = on_device(features)
        batch = kg.paged_batch(mixed, pad_tokens=5)
        want_cache, got_cache = batch.cache.clone(), batch.cache.clone()
        want = reference(batch, want_cache, **features)
        got = batch.triton(cache=got_cache, **features)
        err = rel_err(got, want)
        if got[-5:].abs().max() != 0 or not torch.equal(got_cache, want_cache):
            err = float("inf")  # padding rows must be zero; the new k/v where the reference writes them
        for launch in (AttentionLaunch(16, 32, 3, decode=True),
                       AttentionLaunch(16, 32, 16, decode=True, preload_kv=True), AttentionLaunch(32, 32, 3)):
            err = max(err, rel_err(batch.triton(launch, **features), want))
        report.add(Row(f"check {name}", err, note="mixed step, padding, cache; default + 3/16 splits + prefill"))


def time_attention(report: Report) -> None:
    plain = [(f"decode b={b} ctx={c}", [(c - 1, 1)] * b, {}) for c in (512, 4096) for b in (1, 64)]
    variants = [(f"decode+{name} b={b} ctx=4096", [(4095, 1)] * b, VARIANTS[name])
                for name in ("chunk1024", "alibi") for b in (1, 64)]
    prefill = [(f"prefill+{name} 4x1024", [(0, 1024)] * 4, VARIANTS[name]) for name in ("chunk64", "alibi")]
    for name, seqs, features in plain + variants + prefill:
        features = on_device(features)
        nbytes, flops = kg.attention_cost(seqs)
        batches = [kg.paged_batch(seqs) for _ in range(sets_for(nbytes, cap=16))]
        err = rel_err(batches[0].triton(**features), reference(batches[0], batches[0].cache.clone(), **features))
        row = timed(Row(name, err), lambda i: lambda: batches[i % len(batches)].triton(**features), None, nbytes)
        row.flops = flops if name.startswith("prefill") else 0.0
        report.add(row)
        del batches


def canaries(report: Report, backends: list[str]) -> None:
    from autodeploy.check import run_check
    from autodeploy.errors import PassError
    from autodeploy.tiny import make_tiny_checkpoint

    tmp = tempfile.mkdtemp()
    for arch in ("llama4_text", "bloom", "mpt", "gpt_neo", "xglm"):
        path = make_tiny_checkpoint(arch, f"{tmp}/{arch}")
        for backend in backends:
            try:
                result = run_check(path, device="cuda", attention_backend=backend)
                ok, note = result.passed, result.summary()
            except PassError as exc:  # FlashInfer: no chunk mask, its own ALiBi slopes, head dims 64/128/256
                ok = backend == "flashinfer" and ("does not support" in str(exc) or "supports head dims" in str(exc))
                note = f"{'refused as expected' if ok else 'FAILED'}: {str(exc).splitlines()[0][:150]}"
            report.add(Row(f"canary {arch} ({backend})", 0.0 if ok else math.inf, note=note))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backends", nargs="+", default=["triton", "torch"], help="attention backends of the canary")
    parser.add_argument("--no-canary", action="store_true", help="kernel checks and timings only")
    args = parser.parse_args()
    torch.manual_seed(0)
    print(f"{torch.cuda.get_device_name(DEV)}; torch {torch.__version__}", flush=True)
    report = Report()
    check_variants(report)
    time_attention(report)
    if not args.no_canary:
        canaries(report, args.backends)
    print(report.table())
    return 0 if all(row.ok for row in report.rows) else 1


if __name__ == "__main__":
    sys.exit(main())
