"""Where a step's time goes: one decode step of the compiled model, its GPU kernels (the slowest, with their
count and time per step), the host's time split (metadata, launch, wait) and the idle gaps of the timeline.

    python bench/profile_step.py --shape llama8b --batches 1,64 --weights fp8 --engine   # + the engine's steps
    python bench/profile_step.py --batches 480 --context 192 --eager      # + a prefill and a mixed step
"""

from __future__ import annotations

import argparse
import time

import torch
from decode_bench import bench_autodeploy, compile_autodeploy, decode_chunks, llama_config, sequence_chunks
from table import WEIGHT_FORMATS


def host_split(model, chunks, steps: int = 50) -> None:
    """Where the host spends a step: metadata + replay launch, then the sync on the sampled ids."""
    from autodeploy.kvcache.metadata import BatchMetadata

    runner = model.cuda_graphs
    torch.cuda.synchronize()
    prep = replay = wait = 0.0
    for _ in range(steps):
        t0 = time.perf_counter()
        size = next(s for s in runner.batch_sizes if s >= len(chunks))
        captured = runner.graphs[size]
        BatchMetadata.refill(chunks, model.block_size, captured.pad, captured.buffers)  # as CudaGraphRunner.run
        t1 = time.perf_counter()
        captured.graph.replay()
        ids = captured.output[: len(chunks)].argmax(-1)
        t2 = time.perf_counter()
        ids.tolist()
        t3 = time.perf_counter()
        prep, replay, wait = prep + t1 - t0, replay + t2 - t1, wait + t3 - t2
    print(f"host per step: metadata {prep / steps * 1e6:.0f} us, launch {replay / steps * 1e6:.0f} us, "
          f"wait for ids {wait / steps * 1e6:.0f} us", flush=True)


def kernel_table(model, chunks, steps: int = 5, top: int = 22, step=None) -> None:
    """Kernels of ``steps`` steps: bare model steps of ``chunks``, or calls of ``step``."""
    from torch.profiler import ProfilerActivity, profile

    step = step or (lambda: model(chunks).argmax(-1).tolist())
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
    total = sum(e.device_time_total for e in events) / steps
    count = sum(e.count for e in events) / steps
    print(f"GPU per step: {total:.0f} us in {count:.0f} kernels", flush=True)
    timeline_gaps(prof, steps)
    for e in sorted(events, key=lambda e: -e.device_time_total)[:top]:
        print(f"  {e.device_time_total / steps:8.1f} us  x{e.count / steps:5.0f}  {e.key[:110]}", flush=True)


def timeline_gaps(prof, steps: int, stall_us: float = 20.0) -> None:
    """Idle time between consecutive kernels: short gaps (inside a graph / stream) vs host stalls."""
    import json
    import tempfile

    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        trace = json.load(open(f.name))
    kernels = sorted((e["ts"], e["dur"]) for e in trace["traceEvents"]
                     if e.get("cat") == "kernel" and "dur" in e)
    gaps = [b[0] - (a[0] + a[1]) for a, b in zip(kernels, kernels[1:])]
    short = [g for g in gaps if g < stall_us]
    stalls = [g for g in gaps if g >= stall_us]
    busy = sum(d for _, d in kernels)
    span = kernels[-1][0] + kernels[-1][1] - kernels[0][0]
    print(f"timeline per step: span {span / steps:.0f} us, kernels busy {busy / steps:.0f} us, "
          f"short gaps {sum(short) / steps:.0f} us ({len(short) / steps:.0f} of them, "
          f"median {sorted(short)[len(short) // 2] if short else 0:.2f} us), "
          f"host stalls {sum(stalls) / steps:.0f} us ({len(stalls) / steps:.1f}/step)", flush=True)


def eager_steps(model, context: int) -> None:
    """The steps CUDA graphs do not cover: a prefill of 64 x 128 tokens and a mixed step
    (248 decodes + 2 prompts of 128), timed on first call (compiles) and warm, with a kernel table."""
    prefill = sequence_chunks(model, [[1] * 128] * 64, 0)
    mixed = sequence_chunks(model, [[1]] * 248 + [[1] * 128] * 2, [context] * 248 + [0, 0])
    for name, chunks in (("prefill 64x128", prefill), ("mixed 248 decodes + 2x128", mixed)):
        times = []
        for _ in range(4):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            model(chunks).argmax(-1).tolist()
            times.append((time.perf_counter() - t0) * 1e3)
        print(f"== {name}: first call {times[0]:.1f} ms, then {min(times[1:]):.1f} ms", flush=True)
        kernel_table(model, chunks, steps=2, top=14)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", default="llama8b")
    parser.add_argument("--batches", default="1,64")
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--weights", default="bf16", choices=WEIGHT_FORMATS)
    parser.add_argument("--eager", action="store_true", help="also profile a prefill and a mixed step")
    parser.add_argument("--engine", action="store_true", help="also profile the engine's decode steps")
    args = parser.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    max_batch = max(batches + ([256] if args.eager else []))
    settings = WEIGHT_FORMATS[args.weights].settings
    model, _ = compile_autodeploy(llama_config(args.shape), max_batch, args.context, settings)
    if args.eager:
        eager_steps(model, args.context)
    for b in batches:
        chunks = decode_chunks(model, b, args.context)
        ms = bench_autodeploy(model, b, args.context, 20)
        print(f"== {args.shape} batch {b}: {ms:.3f} ms/step", flush=True)
        host_split(model, chunks)
        kernel_table(model, chunks)
        if args.engine:
            from autodeploy.serve.bench import decode_tokens_needed, decoding_engine

            # kernel_table runs 3 + 5 steps; all must decode the whole batch
            engine = decoding_engine(model, b, args.context - 4, decode_tokens_needed(model, b, args.context - 4, 8))
            print(f"== {args.shape} batch {b}: engine decode steps", flush=True)
            kernel_table(model, None, step=engine.step)


if __name__ == "__main__":
    main()
