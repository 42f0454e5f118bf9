"""Can a decode step's attention run beside its GEMMs? A probe of two-micro-batch overlap (needs a GPU).

At ~490 sequences the 8B decode step's GEMMs are compute-bound (the weights stream at ~2 TB/s of
~4.3) and its attention is bandwidth-bound (the tensor cores idle). Run back to back they add up
(offline 128/128: ~16 ms of an 18 ms step). Split the batch in two halves A and B and each layer can
run B's GEMMs while A's attention runs on a second stream, then A's GEMMs beside B's attention
(NanoFlow's nano-batches, SGLang's two-batch overlap): the GEMMs stream the weights twice, which a
compute-bound step can afford, and the step tends to max(GEMMs, attention) instead of their sum.

This probe times the layer stack's kernels only (qkv, attention, o, gate/up, down of the Llama-3.1-8B
shape; no norms or activation), 32 layers over rotating weight and KV sets bigger than the L2, in
one CUDA graph (and eagerly, where stream priorities certainly apply):

- ``serial 1 x N``: today's step, one batch of N sequences;
- ``serial 2 x N/2``: the two halves one after the other (what the split costs before any overlap);
- ``gemms 2 x N/2`` and ``attention 2 x N/2`` alone: the overlap's ideal is the larger of the two;
- ``overlap``: per layer, B's GEMMs beside A's attention, then A's GEMMs beside B's attention,
  joined after each phase (the data dependencies of the real step are a subset of these joins);
  with the GEMM stream or the attention stream at high priority, and with SMs carved out of cuBLAS.

It also checks that the overlapped attention outputs equal the serial ones (deterministic kernels).

    python bench/overlap_probe.py --seqs 490 --context 192
"""

from __future__ import annotations

import argparse
import statistics
import sys
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if "autodeploy" not in sys.modules:  # the kernels without autodeploy/__init__ (transformers)
    _pkg = types.ModuleType("autodeploy")
    _pkg.__path__ = [str(ROOT / "autodeploy")]
    sys.modules["autodeploy"] = _pkg

import torch  # noqa: E402

from autodeploy.kernels.paged_attention import paged_attention_fwd  # noqa: E402

HQ, HKV, D, PAGE, HIDDEN, INTER, LAYERS = 32, 8, 128, 16, 4096, 14336, 32
BF16, DEV = torch.bfloat16, torch.device("cuda")


class Half:
    """One micro-batch: activations of ``seqs`` decode tokens and, per weight set, its KV pages."""

    def __init__(self, seqs: int, context: int, sets: int):
        rand = lambda *s: torch.randn(*s, device=DEV, dtype=BF16)  # noqa: E731
        self.x, self.h = rand(seqs, HIDDEN), rand(seqs, INTER)
        self.qkv = torch.empty(seqs, (HQ + 2 * HKV) * D, device=DEV, dtype=BF16)
        self.o = torch.empty(seqs, HIDDEN, device=DEV, dtype=BF16)
        self.gu = torch.empty(seqs, 2 * INTER, device=DEV, dtype=BF16)
        self.down = torch.empty(seqs, HIDDEN, device=DEV, dtype=BF16)
        pages = -(-(context + 1) // PAGE)
        self.caches = [torch.randn(seqs * pages + 1, 2, PAGE, HKV, D, device=DEV, dtype=BF16) for _ in range(sets)]
        self.table = torch.randperm(seqs * pages, device=DEV).view(seqs, pages)
        self.context = torch.full((seqs,), context, device=DEV, dtype=torch.int64)
        self.cu = torch.arange(seqs + 1, device=DEV, dtype=torch.int64)
        # new keys go to slot -1 (not written): replays then read the same cache every time
        self.slots = torch.full((seqs,), -1, device=DEV, dtype=torch.int64)
        self.attn_out: list[torch.Tensor] = []

    def gemms(self, w: dict) -> None:
        torch.mm(self.x, w["qkv"].t(), out=self.qkv)
        torch.mm(self.x, w["o"].t(), out=self.o)
        torch.mm(self.x, w["gu"].t(), out=self.gu)
        torch.mm(self.h, w["down"].t(), out=self.down)

    def attention(self, layer: int, record: bool = False) -> None:
        q = self.qkv[:, : HQ * D].view(-1, HQ, D)
        k = self.qkv[:, HQ * D: (HQ + HKV) * D].view(-1, HKV, D)
        v = self.qkv[:, (HQ + HKV) * D:].view(-1, HKV, D)
        out = paged_attention_fwd(q, k, v, self.caches[layer % len(self.caches)], self.cu, self.context,
                                  self.table, self.slots, D ** -0.5)
        if record:
            self.attn_out.append(out)


def weight_sets(sets: int) -> list[dict]:
    rand = lambda *s: torch.randn(*s, device=DEV, dtype=BF16) * 0.02  # noqa: E731
    return [{"qkv": rand((HQ + 2 * HKV) * D, HIDDEN), "o": rand(HIDDEN, HIDDEN), "gu": rand(2 * INTER, HIDDEN),
             "down": rand(HIDDEN, INTER)} for _ in range(sets)]


def serial(halves: list[Half], weights: list[dict], gemms=True, attention=True) -> None:
    for layer in range(LAYERS):
        for half in halves:
            if gemms:
                half.gemms(weights[layer % len(weights)])
            if attention:
                half.attention(layer)


def overlapped(a: Half, b: Half, weights: list[dict], s_gemm, s_attn, record=False) -> None:
    main = torch.cuda.current_stream()
    s_gemm.wait_stream(main)
    s_attn.wait_stream(main)
    for layer in range(LAYERS):
        w = weights[layer % len(weights)]
        for gemm_half, attn_half in ((b, a), (a, b)):
            with torch.cuda.stream(s_gemm):
                gemm_half.gemms(w)
            with torch.cuda.stream(s_attn):
                attn_half.attention(layer, record)
            s_gemm.wait_stream(s_attn)
            s_attn.wait_stream(s_gemm)
    main.wait_stream(s_gemm)
    main.wait_stream(s_attn)


def time_ms(run, graph: bool, reps: int = 10) -> float:
    """Median ms of one call of ``run`` (captured in a CUDA graph, or eager)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        run()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    if graph:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            run()
        run = g.replay
        run()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(2_000_000)  # the host's launches stay ahead of the GPU
        start.record()
        run()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def check_outputs(a: Half, b: Half, weights: list[dict], s_gemm, s_attn) -> float:
    """Max |difference| of every attention output, overlapped vs serial (0 expected). One weight set, so
    every layer's qkv is the same and only a race between the streams could change an output."""
    for half in (a, b):
        half.attn_out.clear()
    for layer in range(LAYERS):
        for half in (a, b):
            half.gemms(weights[0])
            half.attention(layer, record=True)
    torch.cuda.synchronize()
    want = [t.clone() for t in a.attn_out + b.attn_out]
    for half in (a, b):
        half.attn_out.clear()
    overlapped(a, b, weights[:1], s_gemm, s_attn, record=True)
    torch.cuda.synchronize()
    got = a.attn_out + b.attn_out
    return max(float((g - w).abs().max()) for g, w in zip(got, want))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seqs", type=int, default=490)
    parser.add_argument("--context", type=int, default=192)
    parser.add_argument("--sets", type=int, default=4, help="weight and KV sets rotated over the layers")
    args = parser.parse_args()
    torch.manual_seed(0)
    weights = weight_sets(args.sets)
    whole = Half(args.seqs, args.context, args.sets)
    a, b = Half(args.seqs // 2, args.context, args.sets), Half(args.seqs - args.seqs // 2, args.context, args.sets)
    low, high = torch.cuda.Stream.priority_range() if hasattr(torch.cuda.Stream, "priority_range") else (0, -1)
    plain = (torch.cuda.Stream(), torch.cuda.Stream())
    gemm_high = (torch.cuda.Stream(priority=high), torch.cuda.Stream(priority=low))
    attn_high = (torch.cuda.Stream(priority=low), torch.cuda.Stream(priority=high))
    print(f"device {torch.cuda.get_device_name()}, torch {torch.__version__}, {args.seqs} seqs x context "
          f"{args.context}, {LAYERS} layers, priorities low {low} high {high}", flush=True)
    print(f"overlapped vs serial attention outputs, max |diff|: "
          f"{check_outputs(a, b, weights, *plain):.3g}", flush=True)

    cases = [
        ("serial 1 x N", lambda: serial([whole], weights)),
        ("serial 2 x N/2", lambda: serial([a, b], weights)),
        ("gemms 1 x N", lambda: serial([whole], weights, attention=False)),
        ("attention 1 x N", lambda: serial([whole], weights, gemms=False)),
        ("gemms 2 x N/2", lambda: serial([a, b], weights, attention=False)),
        ("attention 2 x N/2", lambda: serial([a, b], weights, gemms=False)),
        ("overlap", lambda: overlapped(a, b, weights, *plain)),
        ("overlap, GEMM stream high", lambda: overlapped(a, b, weights, *gemm_high)),
        ("overlap, attention stream high", lambda: overlapped(a, b, weights, *attn_high)),
    ]
    print(f"{'case':<40}{'graph ms':>10}{'eager ms':>10}", flush=True)
    for name, run in cases:
        print(f"{name:<40}{time_ms(run, True):>10.3f}{time_ms(run, False):>10.3f}", flush=True)
    for carve in (8, 16, 32):
        for lib in ("cublas", "cublaslt"):
            torch.backends.cuda.preferred_blas_library(lib)
            torch._C._set_sm_carveout_experimental(carve)
            try:
                g = [time_ms(lambda: overlapped(a, b, weights, *s), mode) for s in (plain, attn_high)
                     for mode in (True, False)]
                gem = time_ms(lambda: serial([a, b], weights, attention=False), True)
                print(f"carveout {carve:>2} {lib:<9} overlap {g[0]:.3f}/{g[1]:.3f}  attn-high {g[2]:.3f}/{g[3]:.3f}  "
                      f"gemms alone {gem:.3f} (graph/eager ms)", flush=True)
            finally:
                torch._C._set_sm_carveout_experimental(None)
                torch.backends.cuda.preferred_blas_library("cublas")
    return 0


if __name__ == "__main__":
    sys.exit(main())
