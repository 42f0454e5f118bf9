"""Where the offline run leaves the GPU idle, and which host calls wait for it (needs a GPU).

``autodeploy bench offline`` reports each engine step's wall time and how long the host waited for
the step's tokens. It cannot say whether the device idled in between: an eager prefill step's launch
that blocks (a synchronizing copy, a full launch queue) looks like host work. This probe runs the
same workload through the engine four times: through ``run_offline`` as the bench runs it (right after
the compile, as there, and again at the end, with the allocator's pool grown), and in between

- under ``torch.profiler`` with one range per ``engine.step()`` call: the kernels' union against the
  span, and every idle gap of the device over 20 µs, attributed to the step call it fell in and
  summed per phase (steps with prefill tokens, decode-only steps);
- under ``torch.cuda.set_sync_debug_mode("warn")``: every synchronizing CUDA call the host makes,
  counted by the line of our code that made it (the engine's one wait per step for its tokens is
  expected; anything else inside a launch stalls the device's queue).

    python bench/offline_timeline.py --config /tmp/cfg8b --requests 512 --input-len 128 --output-len 128
"""

from __future__ import annotations

import argparse
import collections
import json
import random
import tempfile
import time
import traceback
import warnings

import torch

GAP_US = 20.0


def build(config_dir: str, max_batch: int, max_num_tokens: int, max_seq_len: int):
    from autodeploy.compiler import compile as compile_model

    return compile_model(config_dir, weights="random", dtype="bfloat16", max_batch_size=max_batch,
                         max_num_tokens=max_num_tokens, max_seq_len=max_seq_len)


def new_engine(model, prompts, output_len: int):
    """An engine with every request queued (as ``run_offline``), after its warm-up request."""
    from autodeploy.serve.bench import warm_up_engine
    from autodeploy.serve.engine import Engine, EngineConfig

    from autodeploy.sampling_params import RequestOutputKind, SamplingParams

    engine = Engine(model, None, EngineConfig(enable_prefix_caching=False))
    warm_up_engine(engine)
    params = SamplingParams(max_tokens=output_len, ignore_eos=True, temperature=0.0, detokenize=False,
                            output_kind=RequestOutputKind.FINAL_ONLY)
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, params)
    return engine


def run_steps(engine) -> list[tuple[int, int]]:
    """Steps until every request finished; (sequences, tokens) of each step launched."""
    shapes = []
    while engine.has_unfinished_requests():
        with torch.profiler.record_function(f"step{len(shapes)}"):
            engine.step()
        schedule = engine.last_schedule
        shapes.append((len(schedule.chunks), schedule.num_tokens))
    torch.cuda.synchronize()
    return shapes


def device_idle(kernels: list[tuple[float, float]], steps: list[tuple[float, float, int]],
                shapes: list[tuple[int, int]], gap_us: float = GAP_US):
    """The device's span and busy time (the union of ``kernels``' [start, end) in µs), and its idle
    gaps over ``gap_us`` by phase and by step: a gap belongs to the ``engine.step()`` call (``steps``:
    start, end, index) that ran on the host when the device ran dry."""
    kernels = sorted(kernels)
    busy, end, gaps = 0.0, kernels[0][0], []
    for start, stop in kernels:
        if start - end > gap_us:
            gaps.append((end, start))
        busy += max(0.0, stop - max(start, end))
        end = max(end, stop)
    per_phase, per_step = collections.Counter(), collections.Counter()
    for a, b in gaps:
        owner = next((i for s, e, i in steps if s <= a <= e), None)
        if owner is None:
            phase = "between step calls"
        else:
            phase = "prefill steps" if shapes[owner][1] != shapes[owner][0] else "decode-only steps"
            per_step[owner] += b - a
        per_phase[phase] += b - a
    return end - kernels[0][0], busy, gaps, per_phase, per_step


def device_gaps(model, prompts, output_len: int) -> None:
    from torch.profiler import ProfilerActivity, profile

    engine = new_engine(model, prompts, output_len)
    torch.cuda.synchronize()
    start = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        shapes = run_steps(engine)
    seconds = time.perf_counter() - start
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        with open(f.name) as trace:
            events = json.load(trace)["traceEvents"]
    kernels = [(e["ts"], e["ts"] + e["dur"]) for e in events
               if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and "dur" in e]
    steps = [(e["ts"], e["ts"] + e["dur"], int(e["name"][4:])) for e in events
             if e.get("cat") == "user_annotation" and e.get("name", "").startswith("step") and "dur" in e]
    span, busy, gaps, per_phase, per_step = device_idle(kernels, steps, shapes)
    print(f"run under the profiler: {seconds:.2f} s, {len(shapes)} steps; device span {span / 1e3:.1f} ms, "
          f"busy {busy / 1e3:.1f} ms, idle gaps over {GAP_US:.0f} us: {sum(b - a for a, b in gaps) / 1e3:.1f} ms "
          f"({len(gaps)})", flush=True)
    for phase, us in per_phase.most_common():
        print(f"  idle in {phase}: {us / 1e3:.1f} ms", flush=True)
    print_slow_runtime_calls(events, steps)
    print_kernel_families(events)
    print("  step (seqs, tokens): idle ms", flush=True)
    for i, us in sorted(per_step.items(), key=lambda kv: -kv[1])[:12]:
        print(f"    {i:4d} {shapes[i]}: {us / 1e3:.2f}", flush=True)


KERNEL_FAMILIES = (("GEMM", ("nvjet", "gemm", "cutlass", "splitkreduce")), ("attention", ("paged_attention",)),
                   ("SiLU·mul", ("act_mul",)), ("RMSNorm", ("rms_norm",)), ("argmax", ("argmax",)))


def kernel_family(name: str) -> str:
    lowered = name.lower()
    return next((family for family, keys in KERNEL_FAMILIES if any(k in lowered for k in keys)), "other")


def print_kernel_families(events: list[dict]) -> None:
    """The run's device time by kernel family (the GEMMs' share is what a faster GEMM could take)."""
    total = collections.Counter()
    for e in events:
        if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and "dur" in e:
            total[kernel_family(e["name"])] += e["dur"]
    print("  device time by kernel family: " + ", ".join(f"{family} {us / 1e3:.0f} ms"
                                                        for family, us in total.most_common()), flush=True)


def print_slow_runtime_calls(events: list[dict], steps: list[tuple[float, float, int]], min_us: float = 1000.0) -> None:
    """CUDA runtime calls that held the host over ``min_us`` (a launch into a full queue, an
    allocation, a synchronization), by name, with the step calls they fell in."""
    slow = collections.defaultdict(list)
    for e in events:
        if e.get("cat") == "cuda_runtime" and e.get("dur", 0) > min_us:
            owner = next((i for s, t, i in steps if s <= e["ts"] <= t), None)
            slow[e["name"]].append((e["dur"], owner))
    print(f"  CUDA runtime calls over {min_us / 1e3:.0f} ms on the host:", flush=True)
    for name, calls in sorted(slow.items(), key=lambda kv: -sum(d for d, _ in kv[1])):
        owners = sorted({o for _, o in calls if o is not None})
        print(f"    {name}: {len(calls)} calls, {sum(d for d, _ in calls) / 1e3:.1f} ms, in step calls {owners[:20]}",
              flush=True)


def sync_calls(model, prompts, output_len: int) -> None:
    """Synchronizing CUDA calls by the innermost frame of ours (autodeploy or its serve package)."""
    engine = new_engine(model, prompts, output_len)
    sites = collections.Counter()

    def record(message, category, filename, lineno, file=None, line=None):
        if "synchronizing" not in str(message):
            return
        ours = [f for f in traceback.extract_stack()[:-1] if "autodeploy" in f.filename and "bench" not in f.filename]
        site = ours[-1] if ours else traceback.extract_stack()[-2]
        sites[f"{site.filename.split('autodeploy/')[-1]}:{site.lineno} {site.name}: {site.line}"] += 1

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            shapes = run_steps(engine)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    print(f"synchronizing calls over {len(shapes)} steps: {sum(sites.values()) or 'none'}", flush=True)
    for site, count in sites.most_common(15):
        print(f"  {count:6d}  {site}", flush=True)


def bench_run(model, prompts, output_len: int, label: str) -> None:
    """The workload as ``bench offline`` runs it (``run_offline``), with the CUDA allocator's cudaMalloc
    count: the first run after the compile against a later one tells what growing the allocator's pool costs."""
    from autodeploy.serve.bench import run_offline

    result = run_offline(model, len(prompts[0]), output_len, len(prompts))
    print(f"{label}: {result.seconds:.3f} s, {result.output_throughput:,.0f} output tok/s; {result.steps.summary()}; "
          f"{result.allocator['device_mallocs']} cudaMalloc", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True, help="HF config directory (random weights)")
    parser.add_argument("--requests", type=int, default=512)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--max-batch", type=int, default=512)
    parser.add_argument("--max-num-tokens", type=int, default=8192)
    parser.add_argument("--max-seq-len", type=int, default=1024)
    args = parser.parse_args()
    model = build(args.config, args.max_batch, args.max_num_tokens, args.max_seq_len)
    rng = random.Random(0)
    prompts = [[rng.randrange(model.vocab_size) for _ in range(args.input_len)] for _ in range(args.requests)]
    with torch.inference_mode():
        bench_run(model, prompts, args.output_len, "first run")
        device_gaps(model, prompts, args.output_len)
        sync_calls(model, prompts, args.output_len)
        bench_run(model, prompts, args.output_len, "fourth run")


if __name__ == "__main__":
    main()
