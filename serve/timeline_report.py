"""``autodeploy bench timeline FILE``: what a server timeline (``timeline``) says, run by run.

The engine's steps are cut into runs wherever the engine idled for ``--gap`` seconds or more (a
benchmark's loads, one after another). For each run: output tokens per second; the steps of each
kind (decode-only, mixed, prefill-only) with their wall-time percentiles, batch and token counts,
and the share of step time the host waited for the device (near 100%: the device sets the pace;
near 0: the host does); GC pauses and the CUDA allocator's cudaMalloc calls and retries in the engine;
compiles after ready; in the API process the event loop's lag, the time spent writing SSE events,
GC, and the requests' time to first byte; and the slowest steps with what happened during them.
Those answer: why is a run slower than another one (steps slower, or smaller, or more of them mixed;
GC; the allocator), where the tail of the inter-token latency comes from (the step kinds' tails), and
what the first requests waited for (compiles, the first steps).
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass, field
from typing import Any

from .bench_stats import percentile

KINDS = ("decode", "mixed", "prefill")


@dataclass
class KindStats:
    steps: int
    ms_p50: float
    ms_p90: float
    ms_p99: float
    ms_max: float
    mean_seqs: float
    mean_tokens: float


@dataclass
class RunStats:
    start_s: float  # after the first line of the file
    seconds: float
    output_tokens: int
    output_tok_s: float
    kinds: dict[str, KindStats]
    device_waited_share: float  # of the steps' wall time, the host waited for the device
    engine_gc_ms: float
    engine_gc_max_ms: float
    cuda_mallocs: int
    alloc_retries: int
    compiles: list[dict]
    loop_lag_max_ms: float
    sse_writes: int
    sse_send_ms: float
    api_gc_ms: float
    requests: int
    ttfb_ms: dict[str, float]  # p50, p90, p99, first
    slowest: list[dict] = field(default_factory=list)


def load(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def runs(events: list[dict], gap: float = 1.0, slowest: int = 5) -> list[RunStats]:
    """The file's engine steps cut into runs at idle gaps of ``gap`` seconds, each summarized."""
    origin = min((e["t"] for e in events), default=0.0)
    steps = sorted((e for e in events if e["event"] == "step" and e["kind"] != "idle"), key=lambda e: e["t"])
    groups: list[list[dict]] = []
    for step in steps:
        if groups and step["t"] - _end(groups[-1][-1]) < gap:
            groups[-1].append(step)
        else:
            groups.append([step])
    return [_run(group, events, origin, slowest) for group in groups]


def _end(step: dict) -> float:
    return step["t"] + step["ms"] / 1e3


def _run(steps: list[dict], events: list[dict], origin: float, slowest: int) -> RunStats:
    begin, end = steps[0]["t"], _end(steps[-1])
    during = [e for e in events if begin <= e["t"] <= end + 0.5 and e["event"] != "step"]
    tokens = sum(s.get("out_tokens", 0) for s in steps)
    wall = sum(s["ms"] for s in steps)
    engine_gc = [e["ms"] for e in during if e["event"] == "gc" and e["proc"] in ("engine", "server")]
    loops = [e for e in during if e["event"] == "loop"]
    requests = [e for e in events if e["event"] == "request" and begin - 0.5 <= e["t"] <= end]
    ttfbs = [r["ttfb_ms"] for r in requests if r.get("ttfb_ms") is not None]
    return RunStats(
        start_s=round(begin - origin, 3), seconds=round(end - begin, 3), output_tokens=tokens,
        output_tok_s=round(tokens / max(end - begin, 1e-9), 1),
        kinds={kind: _kind(steps, kind) for kind in KINDS if any(s["kind"] == kind for s in steps)},
        device_waited_share=round(sum(s.get("waited_ms", 0.0) for s in steps) / max(wall, 1e-9), 3),
        engine_gc_ms=round(sum(s.get("gc_ms", 0.0) for s in steps), 1), engine_gc_max_ms=max(engine_gc, default=0.0),
        cuda_mallocs=sum(s.get("cuda_mallocs", 0) for s in steps), alloc_retries=sum(s.get("alloc_retries", 0)
                                                                                     for s in steps),
        compiles=[{"t": round(e["t"] - origin, 3), "kind": e["kind"], "detail": e["detail"]}
                  for e in during if e["event"] == "compile"],
        loop_lag_max_ms=max((e["lag_max_ms"] for e in loops), default=0.0),
        sse_writes=sum(e["sse_writes"] for e in loops), sse_send_ms=round(sum(e["sse_send_ms"] for e in loops), 1),
        api_gc_ms=round(sum(e["gc_ms"] for e in loops if e["proc"] == "api"), 1),
        requests=len(requests),
        ttfb_ms={"p50": percentile(ttfbs, 50), "p90": percentile(ttfbs, 90), "p99": percentile(ttfbs, 99),
                 "first": ttfbs[0] if ttfbs else float("nan")},
        slowest=[_step_line(s, origin) for s in sorted(steps, key=lambda s: -s["ms"])[:slowest]],
    )


def _kind(steps: list[dict], kind: str) -> KindStats:
    chosen = [s for s in steps if s["kind"] == kind]
    ms = [s["ms"] for s in chosen]
    return KindStats(len(chosen), *(round(percentile(ms, q), 3) for q in (50, 90, 99)), max(ms),
                     round(sum(s["seqs"] for s in chosen) / len(chosen), 1),
                     round(sum(s["tokens"] for s in chosen) / len(chosen), 1))


def _step_line(step: dict, origin: float) -> dict:
    keys = ("kind", "ms", "waited_ms", "seqs", "tokens", "prefill_tokens", "gc_ms", "cuda_mallocs", "alloc_retries")
    return {"t": round(step["t"] - origin, 3), **{k: step[k] for k in keys if k in step}}


def compiles_after_ready(events: list[dict]) -> list[dict]:
    return [e for e in events if e["event"] == "compile"]


def render(path: str, stats: list[RunStats], events: list[dict]) -> str:
    ready = [e for e in events if e["event"] == "ready"]
    compiles = compiles_after_ready(events)
    lines = [f"timeline {path}: {len(stats)} run(s); {len(ready)} ready mark(s); "
             f"{len(compiles)} compile(s) after ready"]
    for i, run in enumerate(stats, 1):
        lines += _render_run(i, run)
    return "\n".join(lines)


def _render_run(i: int, run: RunStats) -> list[str]:
    lines = [f"\nrun {i}: from +{run.start_s:.1f} s, {run.seconds:.2f} s, {run.output_tokens} tokens out = "
             f"{run.output_tok_s:,.0f} tok/s; {run.requests} requests, TTFB p50/p90/p99 "
             f"{run.ttfb_ms['p50']:.0f}/{run.ttfb_ms['p90']:.0f}/{run.ttfb_ms['p99']:.0f} ms (first "
             f"{run.ttfb_ms['first']:.0f} ms)",
             f"  {'steps':<8}{'count':>7}{'p50 ms':>9}{'p90 ms':>9}{'p99 ms':>9}{'max ms':>9}{'seqs':>7}{'tokens':>8}"]
    for kind, k in run.kinds.items():
        lines.append(f"  {kind:<8}{k.steps:>7}{k.ms_p50:>9.2f}{k.ms_p90:>9.2f}{k.ms_p99:>9.2f}{k.ms_max:>9.2f}"
                     f"{k.mean_seqs:>7.1f}{k.mean_tokens:>8.1f}")
    lines += [
        f"  engine: waited for the device {run.device_waited_share:.0%} of step time; GC {run.engine_gc_ms:.0f} ms "
        f"(longest pause {run.engine_gc_max_ms:.0f} ms); {run.cuda_mallocs} cudaMalloc, {run.alloc_retries} "
        "allocator retries",
        f"  api: event-loop lag max {run.loop_lag_max_ms:.1f} ms; {run.sse_writes} SSE writes, {run.sse_send_ms:.0f} ms "
        f"in send; GC {run.api_gc_ms:.0f} ms",
        f"  compiles after ready: {len(run.compiles)}" + "".join(
            f"\n    +{c['t']:.2f} s {c['kind']}: {c['detail'][:120]}" for c in run.compiles[:10]),
        "  slowest steps: " + "; ".join(
            f"+{s['t']:.2f} s {s['kind']} {s['ms']:.1f} ms ({s.get('seqs', 0)} seqs, {s.get('tokens', 0)} tokens"
            + (f", GC {s['gc_ms']:.0f} ms" if s.get("gc_ms", 0) >= 1 else "")
            + (f", {s['cuda_mallocs']} cudaMalloc" if s.get("cuda_mallocs") else "") + ")" for s in run.slowest),
    ]
    return lines


def add_timeline_parser(subparsers: Any) -> None:
    p = subparsers.add_parser("timeline", help="summarize a server timeline (autodeploy serve --timeline FILE)")
    p.add_argument("file", help="the JSON-lines timeline")
    p.add_argument("--gap", type=float, default=1.0, help="idle seconds between two runs (default 1)")
    p.add_argument("--slowest", type=int, default=5, help="slowest steps listed per run (default 5)")
    p.add_argument("--json", default=None, metavar="FILE", help="also write the runs as JSON")
    p.add_argument("--log_level", default="warning", help=argparse.SUPPRESS)
    p.set_defaults(func=cmd_timeline)


def cmd_timeline(args: argparse.Namespace) -> int:
    events = load(args.file)
    stats = runs(events, args.gap, args.slowest)
    print(render(args.file, stats, events))
    if args.json:
        with open(args.json, "w") as f:
            json.dump([asdict(run) for run in stats], f, indent=2)
    return 0
