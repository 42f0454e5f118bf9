"""The suite's serving section: ``autodeploy serve`` under ``autodeploy bench serve``'s client, next to the
engine's own decode step at the same batch, measured in the same run.

The server runs the model shape with random weights (a config-only directory: prompts are token ids, no
tokenizer), ``--max_batch_size`` the largest concurrency. At each concurrency ``c`` the client keeps ``c``
streamed requests of ``--serving-len`` (input/output tokens, ``ignore_eos``) in flight, 4 x ``c`` in all, and
reports output tok/s, TTFT and ITL percentiles. The server is then stopped, and the same model is compiled
here and its engine's decode step timed at batch ``c`` with each sequence at the requests' mean context
(input + output / 2): what the server's inter-token latency would be with no HTTP, tokenization or
prefill in between. Floor: the decode floor at that batch and context (``decode_bench.streamed_bytes``).

    python bench/full_table.py --sections serving --concurrency 1,16,64
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from decode_bench import bench_engine, compile_autodeploy, free_memory, llama_config, streamed_bytes
from table import TableRow


def add_options(group) -> None:
    group.add_argument("--serving-shape", default="llama8b", help="model shape")
    group.add_argument("--concurrency", default="1,16,64", help="requests in flight, one run each")
    group.add_argument("--serving-len", default="128/128", help="input/output tokens per request")
    group.add_argument("--server-timeout", type=float, default=300.0, help="seconds for the server to load")


def table_rows(args, header) -> Iterator[TableRow]:
    cfg = llama_config(args.serving_shape)
    input_len, output_len = (int(n) for n in args.serving_len.split("/"))
    concurrencies = [int(c) for c in args.concurrency.split(",")]
    context = input_len + output_len // 2
    for weights in args.weights:
        with tempfile.TemporaryDirectory() as config_dir:
            cfg.save_pretrained(config_dir)
            options = server_options(max(concurrencies), input_len + output_len, weights.settings)
            with running_server(config_dir, options, args.server_timeout) as url:
                results = {c: client_run(url, c, input_len, output_len, cfg.vocab_size) for c in concurrencies}
        model, _ = compile_autodeploy(cfg, max(concurrencies), context, weights.settings)
        for c in concurrencies:
            workload = f"{args.serving_shape} {args.serving_len} c{c}"
            floor = streamed_bytes(cfg, c, context, weights.bytes_per_weight,
                                   weights.head_bytes_per_weight) / header.bandwidth
            yield serving_row(workload, results[c], floor, weights.name)
            ms, waited = bench_engine(model, c, context, steps=20)
            yield TableRow("serving", workload, "autodeploy engine step", ms / 1e3, c * 1e3 / ms, floor,
                           f"batch {c}, context {context}; host waited {waited:.2f} ms/step", weights.name)
        del model
        free_memory()


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


def client_run(url: str, concurrency: int, input_len: int, output_len: int, vocab_size: int):
    from autodeploy.serve.bench_serving import run_benchmark

    result = asyncio.run(run_benchmark(url, input_len=input_len, output_len=output_len,
                                       num_requests=4 * concurrency, concurrency=concurrency, vocab_size=vocab_size))
    print(f"concurrency {concurrency}:\n{result.summary()}", flush=True)
    return result


def serving_row(workload: str, result, floor: float, weights: str) -> TableRow:
    """ITL p50 as the row's time (the step a client sees), output tok/s, every percentile in ``metrics``."""
    metrics = {d.name: {"mean": d.mean_ms, "p50": d.p50_ms, "p90": d.p90_ms, "p99": d.p99_ms}
               for d in (result.ttft, result.tpot, result.itl, result.e2e)}
    metrics.update(completed=result.completed, failed=result.failed, seconds=result.seconds)
    note = (f"TTFT p50/p99 {result.ttft.p50_ms:.0f}/{result.ttft.p99_ms:.0f} ms, ITL p99 {result.itl.p99_ms:.2f} ms, "
            f"TPOT p50 {result.tpot.p50_ms:.2f} ms; {result.completed} requests")
    if result.failed:
        note += f", {result.failed} failed: {result.first_error}"
    return TableRow("serving", workload, "autodeploy serve (ITL p50)", result.itl.p50_ms / 1e3,
                    result.output_throughput, floor, note, weights, passed=False if result.failed else None,
                    metrics=metrics)
