"""Which per-step prompt-token budget (``autodeploy serve --max_num_prefill_tokens`` and
``--busy_prefill_tokens``) serves 128/128 at c64 best? (The timeline's mean running and waiting sequences say
how many slots the runs left empty while prompts queued behind the budget: 2026-12-08, the spread between runs.)

For each budget: a fresh server (the serving section's flags, random 8B-shape weights), two closed-loop runs of
``--per-slot`` x c requests, one c1 run; a row each with output tok/s, TTFT and ITL percentiles, and the engine
timeline's steps by kind (count, p50 ms, mean decoding sequences, seconds). Run on a GPU machine after
``bench/run.sh``'s installs: ``PYTHONPATH=bench:/tmp/ad:/tmp/site python3 bench/probes/prefill_budget.py``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

from decode_bench import llama_config
from serving_bench import KV_BLOCKS, Loads, Plan, engine_steps, running_server, save_tokenizer, server_options


def step_summary(timeline: Path) -> str:
    """Engine steps after ready by kind: count, p50 ms, mean decoding sequences, total seconds."""
    events = [json.loads(line) for line in timeline.read_text().splitlines()]
    ready = next((e["t"] for e in events if e.get("event") == "ready"), 0.0)
    steps = [e for e in events if e.get("event") == "step" and e["t"] >= ready]
    parts = []
    for kind in ("decode", "mixed", "prefill"):
        rows = [s for s in steps if s["kind"] == kind and s["tokens"]]
        if rows:
            decoding = statistics.mean(s["tokens"] - s["prefill_tokens"] for s in rows)
            parts.append(f"{kind} {len(rows)} x p50 {statistics.median(s['ms'] for s in rows):.2f} ms "
                         f"({decoding:.1f} decoding, {statistics.mean(s['tokens'] for s in rows):.0f} tokens, "
                         f"{sum(s['ms'] for s in rows) / 1e3:.2f} s)")
    busy = [s for s in steps if s["seqs"] > 8]  # the c64 runs' steps: how full the batch was, how many queued
    if busy:
        parts.append(f"steps of more than 8 sequences: {statistics.mean(s['running'] for s in busy):.1f} running, "
                     f"{statistics.mean(s['waiting'] for s in busy):.2f} waiting on average")
    loops = [e for e in events if e.get("event") == "loop" and e["streams"] >= 32]  # the API process under c64
    if loops:  # what set the spread between runs on 2026-12-08 (docs/perf.md)
        parts.append(f"API process with 32+ streams: event-loop lag {statistics.mean(e['lag_mean_ms'] for e in loops):.2f} "
                     f"ms mean, GC {statistics.mean(e['gc_ms'] for e in loops):.1f} ms/s, SSE send "
                     f"{statistics.mean(e['sse_send_ms'] for e in loops):.0f} ms/s")
    return "; ".join(parts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--shape", default="llama8b")
    parser.add_argument("--budgets", default="512,128,512/128",
                        help="each --max_num_prefill_tokens, or MAX/BUSY for --busy_prefill_tokens too")
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--per-slot", type=int, default=8)
    parser.add_argument("--engine", action="store_true", help="also time the engine's own decode step at batch c")
    parser.add_argument("--out", default=tempfile.mkdtemp(prefix="budget-"))
    args = parser.parse_args()
    cfg, out = llama_config(args.shape), Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    plan = Plan([1, args.concurrency], (128, 128), (1000, 200), args.per_slot, False)
    rows = []
    with tempfile.TemporaryDirectory() as model_dir:
        cfg.save_pretrained(model_dir)
        save_tokenizer(model_dir)
        from autodeploy.serve.tokenizer import load_tokenizer

        load = Loads(plan, cfg.vocab_size, load_tokenizer(model_dir))
        for budget in args.budgets.split(","):
            most, _, busy = budget.partition("/")
            options = server_options(plan.top, 1200, {}) + ["--num_kv_blocks", str(KV_BLOCKS),
                                                           "--max_num_prefill_tokens", most]
            options += ["--busy_prefill_tokens", busy] if busy else []
            timeline = out / f"timeline_{budget.replace('/', '_')}.jsonl"
            with running_server(model_dir, options, timeline) as url:
                runs = [load.run(url, "fresh", f"c{plan.top} #{i}", plan.top) for i in (1, 2)]
                runs.append(load.run(url, "fresh", "c1", 1, num=8))
            for run in runs:
                r = run.result
                rows.append(f"| {budget} | {run.name} | {r.output_throughput:,.0f} | {r.ttft.p50_ms:.0f} / "
                            f"{r.ttft.p90_ms:.0f} / {r.ttft.p99_ms:.0f} | {r.itl.p50_ms:.1f} / {r.itl.p99_ms:.1f} | "
                            f"{r.tpot.p50_ms:.2f} | {r.failed} |")
            rows.append(f"| {budget} | timeline | {step_summary(timeline)} |")
            print("\n".join(rows[-4:]), flush=True)
    if args.engine:
        bare, engine_ms = engine_steps(cfg, plan, 192, {})[plan.top]
        rows.append(f"| engine | batch {plan.top} at context 192 | {plan.top * 1e3 / engine_ms:,.0f} | bare step "
                    f"{bare:.3f} ms, engine step {engine_ms:.3f} ms |")
    print("\n| budget | run | out tok/s | TTFT p50 / p90 / p99 ms | ITL p50 / p99 ms | TPOT p50 | failed |\n"
          "|---|---|---:|---|---|---:|---:|\n" + "\n".join(rows), flush=True)


if __name__ == "__main__":
    main()
