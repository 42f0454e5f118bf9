"""The serving section: ``autodeploy serve`` (the model shape with random weights, a BPE tokenizer trained here so
that text prompts work, ``--max_batch_size`` the largest concurrency, a timeline of both processes in ``$OUT``)
under ``autodeploy bench serve``'s client (a process per 16 requests in flight: ``serve/bench_clients.py``), issue
36's measurement and its done-when checks:

- a fresh server: two runs at the largest concurrency (the first after start-up against the second); left out
  with ``--serving-quick``;
- a second fresh server's history: every ``--concurrency`` from the first request on (128/128 token-id prompts,
  4 x c requests each; 2 x c quick), the largest once more, Poisson arrivals at 80% of the request rate that run
  measured and the ``--long-len`` mix at the largest concurrency (both with text prompts), then the
  ``--guidellm`` hook (a command against the same server), if given;
- the same model compiled here: the bare and the engine's decode step at each concurrency as batch.

Each run's row keeps its percentiles and the compiles the server counted after ready (``/metrics``); the check
rows are the issue's done-when.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from decode_bench import bench_autodeploy, bench_engine, compile_autodeploy, free_memory, llama_config, streamed_bytes
from table import TableRow

POISSON_SHARE = 0.8  # of the measured capacity (request rate at the largest concurrency)
KV_BLOCKS = 8192  # the server's --num_kv_blocks
# issue 36's done-when
THROUGHPUT_SHARE = 0.85  # of the engine's own decode at the largest batch
TTFT_P99_MS = 500.0  # at the largest concurrency
ITL_P99_STEPS = 3.0  # ITL p99 in bare decode steps at the largest batch
RUN_TO_RUN = 0.10  # first run vs second, and after history vs fresh
TTFT_P99_C1_MS = 100.0
TPOT_C1_SHARE = 0.05  # concurrency 1: TPOT within this of the bare batch-1 step


@dataclass(frozen=True)
class Plan:
    concurrencies: list[int]
    lens: tuple[int, int]  # input/output tokens per request
    long_lens: tuple[int, int]
    per_slot: int  # requests per unit of concurrency: per_slot x top Poisson requests, half that of the long mix
    fresh_server: bool

    @property
    def top(self) -> int:
        return max(self.concurrencies)

    @classmethod
    def from_args(cls, args) -> Plan:
        lens = [tuple(int(n) for n in option.split("/")) for option in (args.serving_len, args.long_len)]
        per_slot = args.per_slot or (2 if args.serving_quick else 4)
        return cls([int(c) for c in args.concurrency.split(",")], *lens, per_slot, not args.serving_quick)


@dataclass
class Run:
    server: str  # "fresh" or "history"
    name: str  # e.g. "c64 #1", "poisson 80%", "1000/200 c64"
    concurrency: int | None
    result: object  # bench_serving.ServingResult
    compiles_after_ready: int = 0
    text_prompts: bool = False
    context: int = 0  # the requests' mean context (input + output / 2): the decode floor's


def add_options(group) -> None:
    group.add_argument("--serving-shape", default="llama8b", help="model shape")
    group.add_argument("--concurrency", default="1,16,64", help="requests in flight, one run each (history)")
    group.add_argument("--serving-len", default="128/128", help="input/output tokens per request")
    group.add_argument("--long-len", default="1000/200", help="input/output tokens of the long-prompt mix")
    group.add_argument("--serving-quick", action="store_true", help="no fresh-server pair, half the requests")
    group.add_argument("--per-slot", type=int, default=0,
                       help="requests per unit of concurrency (default 4, 2 with --serving-quick): e.g. 8 for 512 "
                            "requests at c64, where the prompts' share of the work nears its steady state")
    group.add_argument("--guidellm", default=None, metavar="COMMAND",
                       help="a shell command run against the history server after its runs ({url}, {model_dir}, "
                            "{out} filled in); its last output line, if JSON with output_tok_s, ttft_p99_ms, "
                            "itl_p99_ms, becomes a row (bench/guidellm_load.sh)")


def table_rows(args, header) -> Iterator[TableRow]:
    cfg, plan, shape = llama_config(args.serving_shape), Plan.from_args(args), args.serving_shape
    context = plan.lens[0] + plan.lens[1] // 2
    out_dir = Path(os.environ.get("OUT") or tempfile.mkdtemp(prefix="serving-"))
    for weights in args.weights:
        with tempfile.TemporaryDirectory() as model_dir:
            cfg.save_pretrained(model_dir)
            save_tokenizer(model_dir)
            max_seq_len = max(sum(plan.lens), sum(plan.long_lens))
            options = server_options(plan.top, max_seq_len, weights.settings, args.set) + ["--num_kv_blocks",
                                                                                           str(KV_BLOCKS)]
            runs, hook_rows = serve_all(args.guidellm, plan, model_dir, options, out_dir / weights.name, cfg.vocab_size)
        steps = engine_steps(cfg, plan, context, weights.settings, args.set)
        engine_tok_s = plan.top * 1e3 / steps[plan.top][1]
        for run in runs:
            floor = streamed_bytes(cfg, run.concurrency or plan.top, run.context, weights.bytes_per_weight,
                                   weights.head_bytes_per_weight) / header.bandwidth
            yield serving_row(f"{shape} {run.server} {run.name}", run, floor, weights.name, (plan.top, engine_tok_s))
        for batch, (bare, engine_ms) in sorted(steps.items()):
            yield TableRow("serving", f"{shape} batch {batch}", "autodeploy engine step", engine_ms / 1e3,
                           batch * 1e3 / engine_ms, note=f"bare step {bare:.2f} ms, context {context}",
                           weights=weights.name)
        yield from hook_rows
        yield from check_rows(runs, steps, plan.concurrencies, shape)


def serve_all(guidellm: str | None, plan: Plan, model_dir: str, options: list[str], out_dir: Path, vocab: int):
    """Every run of ``plan`` on its servers; (runs, the hook's rows)."""
    from autodeploy.serve.tokenizer import load_tokenizer

    out_dir.mkdir(parents=True, exist_ok=True)
    load = Loads(plan, vocab, load_tokenizer(model_dir))
    runs, hook_rows, top = [], [], plan.top
    if plan.fresh_server:
        with running_server(model_dir, options, out_dir / "timeline_fresh.jsonl") as url:
            runs += [load.run(url, "fresh", f"c{top} #{i}", top) for i in (1, 2)]
    with running_server(model_dir, options, out_dir / "timeline_history.jsonl") as url:
        runs += [load.run(url, "history", f"c{c} #1", c) for c in plan.concurrencies]
        runs.append(load.run(url, "history", f"c{top} #2", top))
        rate = POISSON_SHARE * find(runs, "history", f"c{top} #2").result.request_throughput
        runs.append(load.run(url, "history", f"poisson {POISSON_SHARE:.0%} ({rate:.1f} req/s)", None, rate=rate,
                             text=True, num=plan.per_slot * top))
        runs.append(load.run(url, "history", f"{plan.long_lens[0]}/{plan.long_lens[1]} c{top}", top, text=True,
                             num=plan.per_slot // 2 * top, lens=plan.long_lens))
        if guidellm:
            hook_rows.append(guidellm_row(guidellm, url, model_dir, out_dir))
    return runs, hook_rows


class Loads:
    """``autodeploy bench serve``'s client, one run at a time; every run's prompts are new (no prefix hits)."""

    def __init__(self, plan: Plan, vocab: int, tokenizer):
        self.plan, self.vocab, self.tokenizer, self.seed = plan, vocab, tokenizer, 0

    def run(self, url: str, server: str, name: str, concurrency: int | None, rate: float | None = None,
            text: bool = False, num: int | None = None, lens: tuple[int, int] | None = None) -> Run:
        from autodeploy.serve.bench_serving import default_processes, run_benchmark

        input_len, output_len = lens or self.plan.lens
        self.seed += 1
        before = compiles_after_ready(url)
        in_flight = concurrency or self.plan.top  # (Poisson: up to the largest concurrency's)
        result = asyncio.run(run_benchmark(url, input_len=input_len, output_len=output_len,
                                           num_requests=num or self.plan.per_slot * concurrency,
                                           concurrency=concurrency, request_rate=rate, vocab_size=self.vocab,
                                           seed=self.seed, tokenizer=self.tokenizer if text else None,
                                           processes=default_processes(in_flight)))
        print(f"{server} server, {name}:\n{result.summary()}", flush=True)
        return Run(server, name, concurrency, result, compiles_after_ready(url) - before, text,
                   input_len + output_len // 2)


def compiles_after_ready(url: str) -> int:
    """The server's ``autodeploy_compiles_after_ready_total``, every kind summed."""
    import httpx

    text = httpx.get(f"{url}/metrics", timeout=30).text
    return int(sum(float(v) for v in re.findall(r"^autodeploy_compiles_after_ready_total\{[^}]*\} (\S+)$", text, re.M)))


def save_tokenizer(model_dir: str, vocab_size: int = 2048) -> None:
    """A byte-level BPE of at most ``vocab_size`` ids trained on the held-out text, saved in ``model_dir`` (text
    prompts need a tokenizer; its ids are a small part of the model's vocabulary)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<s>", "</s>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([(Path(__file__).parent / "data" / "quant_heldout.txt").read_text()], trainer)
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>").save_pretrained(model_dir)


def engine_steps(cfg, plan: Plan, context: int, settings: dict, overrides=()) -> dict[int, tuple[float, float]]:
    """batch -> (bare step ms, engine step ms) at each concurrency as batch, on the model compiled here."""
    model, _ = compile_autodeploy(cfg, plan.top, context, settings, tuple(overrides))
    steps = {b: (bench_autodeploy(model, b, context, 20), bench_engine(model, b, context, 20)[0])
             for b in plan.concurrencies}
    del model
    free_memory()
    return steps


def guidellm_row(command: str, url: str, model_dir: str, out_dir: Path) -> TableRow:
    """The independent client's hook: run ``command`` against the server; a JSON last line becomes the row."""
    filled = command.replace("{url}", url).replace("{model_dir}", model_dir).replace("{out}", str(out_dir))
    print(f"guidellm hook: {filled}", flush=True)
    done = subprocess.run(filled, shell=True, capture_output=True, text=True, timeout=600)
    print(done.stdout[-3000:] + done.stderr[-2000:], flush=True)
    try:
        figures = json.loads((done.stdout.strip().splitlines() or [""])[-1])
    except ValueError:
        figures = None
    figures = figures if isinstance(figures, dict) else {}
    summary = ", ".join(f"{k} {v}" for k, v in figures.items()) if figures else "no JSON summary line"
    return TableRow("serving", "guidellm against the history server", "guidellm", None, figures.get("output_tok_s"),
                    note=f"guidellm: exit {done.returncode}; {summary}", passed=done.returncode == 0, metrics=figures)


def server_options(max_batch: int, max_seq_len: int, settings: dict, overrides=()) -> list[str]:
    """``autodeploy serve`` flags: random weights, a batch of ``max_batch`` requests of ``max_seq_len`` tokens;
    ``overrides`` are the decode section's ``--set`` strings, passed on."""
    flags = ["--weights", "random", "--max_batch_size", str(max_batch), "--max_seq_len", str(max_seq_len + 64)]
    items = [f"{key}={value}" for key, value in settings.items()] + list(overrides)
    return flags + [flag for item in items for flag in ("--set", item)]


@contextmanager
def running_server(model_dir: str, options: list[str], timeline: Path, timeout: float = 300.0):
    """``autodeploy serve`` on a free port writing ``timeline``, its output in the log beside it; yields its URL
    once ``/health`` answers 200. Once it stopped, the log's last lines and the timeline's summary are printed."""
    timeline.unlink(missing_ok=True)
    log = timeline.with_suffix(".log")
    command = [sys.executable, "-m", "autodeploy.cli", "serve", model_dir, "--port", "0", *options,
               "--timeline", str(timeline)]
    with open(log, "w") as out:  # cwd outside the repository: its source tree must not shadow the installed package
        server = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, cwd=tempfile.gettempdir(),
                                  env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        yield _wait_until_healthy(server, log, timeout)
    finally:
        server.terminate()
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
        print("server log (last lines):\n" + "".join(log.read_text().splitlines(True)[-15:]), flush=True)
        if timeline.exists():
            from autodeploy.serve.timeline_report import load, render, runs

            events = load(str(timeline))
            print(render(str(timeline), runs(events), events), flush=True)


def _wait_until_healthy(server: subprocess.Popen, log: Path, timeout: float) -> str:
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"the server exited ({server.returncode}):\n{log.read_text()[-3000:]}")
        listening = re.search(r"listening on (http://\S+)", log.read_text())
        try:
            if listening and httpx.get(f"{listening[1]}/health", timeout=5).status_code == 200:
                print(f"server ready at {listening[1]}", flush=True)
                return listening[1]
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"the server did not load within {timeout:.0f} s:\n{log.read_text()[-3000:]}")


def serving_row(workload: str, run: Run, floor: float, weights: str, engine: tuple[int, float]) -> TableRow:
    """ITL p50 as the row's time (the step a client sees), output tok/s, every percentile in ``metrics``; the note
    has the issue's table: output against the engine's own decode (``engine``: batch, tok/s), TTFT, ITL, TPOT."""
    result, (batch, engine_tok_s) = run.result, engine
    metrics = {d.name: {"mean": d.mean_ms, "p50": d.p50_ms, "p90": d.p90_ms, "p99": d.p99_ms}
               for d in (result.ttft, result.tpot, result.itl, result.e2e)}
    metrics.update(completed=result.completed, failed=result.failed, seconds=result.seconds,
                   prompt_tokens=result.mean_prompt_tokens, compiles_after_ready=run.compiles_after_ready)
    ttft, itl = result.ttft, result.itl
    note = (f"{result.output_throughput / engine_tok_s:.0%} of engine b{batch}; TTFT p50/p90/p99 {ttft.p50_ms:.0f}/"
            f"{ttft.p90_ms:.0f}/{ttft.p99_ms:.0f} ms, ITL p50/p99 {itl.p50_ms:.1f}/{itl.p99_ms:.1f} ms, TPOT p50 "
            f"{result.tpot.p50_ms:.2f} ms; {result.completed} requests, {'text' if run.text_prompts else 'token-id'} "
            f"prompts of {result.mean_prompt_tokens:.0f}; {run.compiles_after_ready} compiles after ready")
    if result.failed:
        note += f", {result.failed} failed: {result.first_error}"
    return TableRow("serving", workload, "autodeploy serve (ITL p50)", result.itl.p50_ms / 1e3,
                    result.output_throughput, floor, note, weights, passed=False if result.failed else None,
                    metrics=metrics)


def find(runs: list[Run], server: str, name: str) -> Run | None:
    return next((r for r in runs if r.server == server and r.name == name), None)


def _check(workload: str, what: str, value: float, bound: float, at_most: bool = True) -> TableRow:
    return TableRow("serving", workload, "check: " + what, None, note=f"{value:,.1f} against {bound:,.1f}",
                    passed=value <= bound if at_most else value >= bound, metrics={"value": value, "bound": bound})


def check_rows(runs: list[Run], steps: dict, concurrencies: list[int], shape: str) -> list[TableRow]:
    """The done-when criteria that these runs measured (a run left out of a reduced plan: its check too);
    ``steps``: batch -> (bare step ms, engine step ms)."""
    top = max(concurrencies)
    after = f"after {', '.join(f'c{c}' for c in concurrencies if c != top)}"
    rows = []
    history, c1 = find(runs, "history", f"c{top} #1"), find(runs, "history", "c1 #1")
    if history is not None and top in steps:
        r, workload = history.result, f"{shape} c{top} {after}"
        rows += [_check(workload, f">= {THROUGHPUT_SHARE:.0%} of engine b{top} tok/s", r.output_throughput,
                        THROUGHPUT_SHARE * top * 1e3 / steps[top][1], at_most=False),
                 _check(workload, "TTFT p99 ms", r.ttft.p99_ms, TTFT_P99_MS),
                 _check(workload, f"ITL p99 ms <= {ITL_P99_STEPS:.0f} bare steps", r.itl.p99_ms,
                        ITL_P99_STEPS * steps[top][0])]
    pairs = [(f"{shape} c{top} {server} server", "run 1 within 10% of run 2", find(runs, server, f"c{top} #1"),
              find(runs, server, f"c{top} #2")) for server in ("fresh", "history")]
    pairs.append((f"{shape} c{top}", f"{after} within 10% of fresh", history, find(runs, "fresh", f"c{top} #2")))
    for workload, what, run, reference in pairs:
        if run is not None and reference is not None:
            rows.append(_check(workload, f"{what} (tok/s)", run.result.output_throughput,
                               (1 - RUN_TO_RUN) * reference.result.output_throughput, at_most=False))
    if c1 is not None:
        rows.append(_check(f"{shape} c1 from the first request", "TTFT p99 ms", c1.result.ttft.p99_ms, TTFT_P99_C1_MS))
        if 1 in steps:
            rows.append(_check(f"{shape} c1", "TPOT p50 ms within 5% of the bare step", c1.result.tpot.p50_ms,
                               (1 + TPOT_C1_SHARE) * steps[1][0]))
    rows.append(_check(f"{shape} every run", "compiles after ready", sum(r.compiles_after_ready for r in runs), 0))
    return rows
