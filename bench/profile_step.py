"""Profile one decode step of the compiled model: GPU kernels (count, total us) and host time split.

    python bench/profile_step.py --shape llama8b --batch 1
"""

from __future__ import annotations

import argparse
import time

import torch

from decode_bench import bench_autodeploy, compile_autodeploy, llama_config


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


def kernel_table(model, chunks, steps: int = 5, top: int = 22) -> None:
    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        model(chunks).argmax(-1).tolist()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            model(chunks).argmax(-1).tolist()
    events = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
    total = sum(e.device_time_total for e in events) / steps
    count = sum(e.count for e in events) / steps
    print(f"GPU per step: {total:.0f} us in {count:.0f} kernels", flush=True)
    for e in sorted(events, key=lambda e: -e.device_time_total)[:top]:
        print(f"  {e.device_time_total / steps:8.1f} us  x{e.count / steps:5.0f}  {e.key[:110]}", flush=True)


def main() -> None:
    from autodeploy.kvcache.metadata import SequenceChunk

    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", default="llama8b")
    parser.add_argument("--batches", default="1,64")
    parser.add_argument("--context", type=int, default=512)
    args = parser.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    model, _ = compile_autodeploy(llama_config(args.shape), max(batches), args.context, "triton")
    per_seq = -(-(args.context + 32) // model.block_size)
    for b in batches:
        chunks = [SequenceChunk((1,), args.context, tuple(range(i * per_seq + 1, (i + 1) * per_seq + 1)))
                  for i in range(b)]
        ms = bench_autodeploy(model, b, args.context, 20)
        print(f"== {args.shape} batch {b}: {ms:.3f} ms/step", flush=True)
        host_split(model, chunks)
        kernel_table(model, chunks)


if __name__ == "__main__":
    main()
