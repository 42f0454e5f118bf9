"""The suite's serving section: issue 36's measurement in one command, one table.

    bash bench/run.sh serving                  # on the GPU machine (~8 min); --serving-quick: ~5 min
    python bench/full_table.py --sections serving --serving-quick

``autodeploy serve`` runs the model shape with random weights (a config directory plus a small BPE tokenizer
trained here, so text prompts are tokenized and detokenized by the server), ``--max_batch_size`` the largest
concurrency, a timeline of both processes written to ``$OUT`` (``autodeploy bench timeline`` summarizes it
after each server). Against it, ``autodeploy bench serve``'s client:

- a fresh server: two runs at the largest concurrency (the first after start-up against the second);
  left out with ``--serving-quick``;
- a second fresh server, its history: every ``--concurrency`` from the first request on (128/128, token-id
  prompts, 4 x c requests each; 2 x c quick), the largest once more, then Poisson arrivals at 80% of the
  request rate that run measured and the ``--long-len`` mix (1000/200) at the largest concurrency, both
  with text prompts; then the ``--guidellm`` hook (a command against the same server), if given;
- then the same model compiled here: the bare decode step and the engine's own decode step at each
  concurrency as batch (each sequence at the requests' mean context).

Every run's row keeps its percentiles; the compiles the server counted after ready during each run are read
from ``/metrics``. The check rows are the issue's done-when (``serving_checks``), and the section prints the
issue's table at the end.
"""

from __future__ import annotations

import asyncio
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
from serving_checks import EngineSteps, Run, check_rows, done_when_table, find
from table import TableRow

POISSON_SHARE = 0.8  # of the measured capacity (request rate at the largest concurrency)


@dataclass(frozen=True)
class Plan:
    concurrencies: list[int]
    input_len: int
    output_len: int
    long_input: int
    long_output: int
    per_slot: int  # requests per unit of concurrency
    fresh_server: bool
    poisson_requests: int
    long_requests: int

    @property
    def top(self) -> int:
        return max(self.concurrencies)


def add_options(group) -> None:
    group.add_argument("--serving-shape", default="llama8b", help="model shape")
    group.add_argument("--concurrency", default="1,16,64", help="requests in flight, one run each (history)")
    group.add_argument("--serving-len", default="128/128", help="input/output tokens per request")
    group.add_argument("--long-len", default="1000/200", help="input/output tokens of the long-prompt mix")
    group.add_argument("--serving-quick", action="store_true", help="no fresh-server pair, half the requests")
    group.add_argument("--serving-kv-blocks", type=int, default=8192, help="the server's --num_kv_blocks")
    group.add_argument("--server-timeout", type=float, default=300.0, help="seconds for the server to load")
    group.add_argument("--guidellm", default=None, metavar="COMMAND",
                       help="a shell command run against the history server after its runs ({url}, {model_dir}, "
                            "{out} filled in); its last output line, if JSON with output_tok_s, ttft_p99_ms, "
                            "itl_p99_ms, becomes a row")


def make_plan(args) -> Plan:
    input_len, output_len = (int(n) for n in args.serving_len.split("/"))
    long_input, long_output = (int(n) for n in args.long_len.split("/"))
    concurrencies = [int(c) for c in args.concurrency.split(",")]
    quick = args.serving_quick
    top = max(concurrencies)
    return Plan(concurrencies, input_len, output_len, long_input, long_output, 2 if quick else 4, not quick,
                (2 if quick else 4) * top, (1 if quick else 2) * top)


def table_rows(args, header) -> Iterator[TableRow]:
    cfg = llama_config(args.serving_shape)
    plan = make_plan(args)
    context = plan.input_len + plan.output_len // 2
    out_dir = Path(os.environ.get("OUT") or tempfile.mkdtemp(prefix="serving-"))
    for weights in args.weights:
        with tempfile.TemporaryDirectory() as model_dir:
            prepare_model_dir(cfg, model_dir)
            options = server_options(plan.top, max(plan.input_len + plan.output_len,
                                                   plan.long_input + plan.long_output), weights.settings)
            options += ["--num_kv_blocks", str(args.serving_kv_blocks)]
            runs, hook_rows = serve_all(args, plan, model_dir, options, out_dir / weights.name, cfg.vocab_size)
        steps = engine_steps(cfg, plan, context, weights.settings)
        for run in runs:
            floor = streamed_bytes(cfg, run.concurrency or plan.top, run.context, weights.bytes_per_weight,
                                   weights.head_bytes_per_weight) / header.bandwidth
            yield serving_row(f"{args.serving_shape} {run.server} {run.name}", run.result, floor, weights.name,
                              run.compiles_after_ready)
        for batch, (bare, engine_ms) in sorted(steps.ms.items()):
            yield TableRow("serving", f"{args.serving_shape} batch {batch}", "autodeploy engine step", engine_ms / 1e3,
                           steps.engine_tok_s(batch), note=f"bare step {bare:.2f} ms, context {context}",
                           weights=weights.name)
        yield from hook_rows
        yield from check_rows(runs, steps, plan.concurrencies, args.serving_shape)
        print("\n" + done_when_table(runs, steps, plan.top, [r.note for r in hook_rows]), flush=True)


def serve_all(args, plan: Plan, model_dir: str, options: list[str], out_dir: Path, vocab: int):
    """Every run of ``plan`` on its servers; (runs, the hook's rows)."""
    from autodeploy.serve.tokenizer import load_tokenizer

    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = load_tokenizer(model_dir)
    load = Loads(plan, vocab, tokenizer)
    runs, hook_rows = [], []
    if plan.fresh_server:
        with traced_server(model_dir, options, args.server_timeout, out_dir / "timeline_fresh.jsonl") as url:
            runs += [load.run(url, "fresh", f"c{plan.top} #{i}", plan.top) for i in (1, 2)]
    with traced_server(model_dir, options, args.server_timeout, out_dir / "timeline_history.jsonl") as url:
        runs += [load.run(url, "history", f"c{c} #1", c) for c in plan.concurrencies]
        runs.append(load.run(url, "history", f"c{plan.top} #2", plan.top))
        capacity = find(runs, "history", f"c{plan.top} #2").result.request_throughput
        runs.append(load.run(url, "history", f"poisson {POISSON_SHARE:.0%} ({POISSON_SHARE * capacity:.1f} req/s)",
                             None, rate=POISSON_SHARE * capacity, text=True, num=plan.poisson_requests))
        runs.append(load.run(url, "history", f"{plan.long_input}/{plan.long_output} c{plan.top}", plan.top,
                             text=True, num=plan.long_requests, lens=(plan.long_input, plan.long_output)))
        if args.guidellm:
            hook_rows.append(guidellm_row(args.guidellm, url, model_dir, out_dir))
    return runs, hook_rows


class Loads:
    """``autodeploy bench serve``'s client, one run at a time; every run's prompts are new (no prefix hits)."""

    def __init__(self, plan: Plan, vocab: int, tokenizer):
        self.plan, self.vocab, self.tokenizer, self.seed = plan, vocab, tokenizer, 0

    def run(self, url: str, server: str, name: str, concurrency: int | None, rate: float | None = None,
            text: bool = False, num: int | None = None, lens: tuple[int, int] | None = None) -> Run:
        from autodeploy.serve.bench_serving import run_benchmark

        input_len, output_len = lens or (self.plan.input_len, self.plan.output_len)
        self.seed += 1
        before = compiles_after_ready(url)
        result = asyncio.run(run_benchmark(url, input_len=input_len, output_len=output_len,
                                           num_requests=num or self.plan.per_slot * concurrency,
                                           concurrency=concurrency, request_rate=rate, vocab_size=self.vocab,
                                           seed=self.seed, tokenizer=self.tokenizer if text else None))
        run = Run(server, name, concurrency, result, compiles_after_ready(url) - before, text,
                  input_len + output_len // 2)
        print(f"{server} server, {name}:\n{result.summary()}", flush=True)
        return run


def compiles_after_ready(url: str) -> int:
    """The server's ``autodeploy_compiles_after_ready_total``, every kind summed."""
    import httpx

    text = httpx.get(f"{url}/metrics", timeout=30).text
    return int(sum(float(v) for v in re.findall(r"^autodeploy_compiles_after_ready_total\{[^}]*\} (\S+)$", text,
                                                  re.M)))


def prepare_model_dir(cfg, model_dir: str) -> None:
    """The shape's config and a tokenizer (text prompts need one; its ids are a small part of the vocabulary)."""
    cfg.save_pretrained(model_dir)
    save_tokenizer(model_dir)


def save_tokenizer(model_dir: str, vocab_size: int = 2048) -> None:
    """A byte-level BPE of at most ``vocab_size`` ids trained on the held-out text, saved in ``model_dir``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<s>", "</s>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([(Path(__file__).parent / "data" / "quant_heldout.txt").read_text()], trainer)
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>").save_pretrained(model_dir)


def engine_steps(cfg, plan: Plan, context: int, settings: dict) -> EngineSteps:
    """The bare and the engine's decode step at each concurrency as batch, on the model compiled here."""
    model, _ = compile_autodeploy(cfg, plan.top, context, settings)
    steps = EngineSteps()
    for batch in plan.concurrencies:
        steps.ms[batch] = (bench_autodeploy(model, batch, context, steps=20), bench_engine(model, batch, context, 20)[0])
    del model
    free_memory()
    return steps


def guidellm_row(command: str, url: str, model_dir: str, out_dir: Path) -> TableRow:
    """The independent client's hook: run ``command`` against the server; a JSON last line becomes the row."""
    import json

    filled = command.replace("{url}", url).replace("{model_dir}", model_dir).replace("{out}", str(out_dir))
    print(f"guidellm hook: {filled}", flush=True)
    done = subprocess.run(filled, shell=True, capture_output=True, text=True, timeout=600)
    print(done.stdout[-3000:] + done.stderr[-2000:], flush=True)
    last = (done.stdout.strip().splitlines() or [""])[-1]
    try:
        figures = json.loads(last)
    except ValueError:
        figures = None
    figures = figures if isinstance(figures, dict) else {}
    note = (f"guidellm: exit {done.returncode}; " + ", ".join(f"{k} {v}" for k, v in figures.items())
            if figures else f"guidellm: exit {done.returncode}, no JSON summary line")
    return TableRow("serving", "guidellm against the history server", "guidellm", None,
                    figures.get("output_tok_s"), note=note, passed=done.returncode == 0, metrics=figures)


@contextmanager
def traced_server(model_dir: str, options: list[str], timeout: float, timeline: Path):
    """:func:`running_server` writing ``timeline``; its summary printed once the server stopped."""
    timeline.unlink(missing_ok=True)
    try:
        with running_server(model_dir, [*options, "--timeline", str(timeline)], timeout) as url:
            yield url
    finally:
        if timeline.exists():
            from autodeploy.serve.timeline_report import load, render, runs

            events = load(str(timeline))
            print(render(str(timeline), runs(events), events), flush=True)


def server_options(max_batch: int, max_seq_len: int, settings: dict) -> list[str]:
    """``autodeploy serve`` flags: random weights, a batch of ``max_batch`` requests of ``max_seq_len`` tokens."""
    flags = ["--weights", "random", "--max_batch_size", str(max_batch), "--max_seq_len", str(max_seq_len + 64)]
    for key, value in settings.items():
        flags += ["--set", f"{key}={value}"]
    return flags


@contextmanager
def running_server(model_dir: str, options: list[str], timeout: float):
    """A server on a free port, its output in a log file; yields its URL once ``/health`` answers 200."""
    import httpx

    log = tempfile.NamedTemporaryFile("w+", suffix=".log", delete=False)
    command = [sys.executable, "-m", "autodeploy.cli", "serve", model_dir, "--port", "0", *options]
    # cwd outside the repository: its source tree must not shadow the installed package
    server = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, cwd=tempfile.gettempdir(),
                              env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        url = _wait_until_healthy(server, Path(log.name), timeout, httpx)
        print(f"server ready at {url}", flush=True)
        yield url
    finally:
        server.terminate()
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
        log.close()
        print("server log (last lines):\n" + "".join(Path(log.name).read_text().splitlines(True)[-15:]), flush=True)
        os.unlink(log.name)


def _wait_until_healthy(server: subprocess.Popen, log: Path, timeout: float, httpx) -> str:
    deadline = time.monotonic() + timeout
    url = None
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"the server exited ({server.returncode}):\n{log.read_text()[-3000:]}")
        listening = [line for line in log.read_text().splitlines() if "listening on http" in line]
        url = url or (listening[0].split("listening on ")[1].split()[0] if listening else None)
        if url and _healthy(httpx, url):
            return url
        time.sleep(0.5)
    raise RuntimeError(f"the server did not load within {timeout:.0f} s:\n{log.read_text()[-3000:]}")


def _healthy(httpx, url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


def serving_row(workload: str, result, floor: float, weights: str, compiles_after_ready: int = 0) -> TableRow:
    """ITL p50 as the row's time (the step a client sees), output tok/s, every percentile in ``metrics``."""
    metrics = {d.name: {"mean": d.mean_ms, "p50": d.p50_ms, "p90": d.p90_ms, "p99": d.p99_ms}
               for d in (result.ttft, result.tpot, result.itl, result.e2e)}
    metrics.update(completed=result.completed, failed=result.failed, seconds=result.seconds,
                   prompt_tokens=result.mean_prompt_tokens, compiles_after_ready=compiles_after_ready)
    note = (f"TTFT p50/p99 {result.ttft.p50_ms:.0f}/{result.ttft.p99_ms:.0f} ms, ITL p99 {result.itl.p99_ms:.2f} ms, "
            f"TPOT p50 {result.tpot.p50_ms:.2f} ms; {result.completed} requests; {compiles_after_ready} compiles")
    if result.failed:
        note += f", {result.failed} failed: {result.first_error}"
    return TableRow("serving", workload, "autodeploy serve (ITL p50)", result.itl.p50_ms / 1e3,
                    result.output_throughput, floor, note, weights, passed=False if result.failed else None,
                    metrics=metrics)
