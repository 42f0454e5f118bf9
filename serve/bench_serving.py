"""``autodeploy bench serve``: a serving benchmark client (asyncio + httpx, streaming).

Sends ``--num_requests`` synthetic requests to a running OpenAI-compatible server, either keeping
``--concurrency`` in flight or arriving as a Poisson process at ``--request_rate`` per second.
Completions prompts are random token ids of exactly ``--input_len`` (no tokenizer needed on either
side), or with ``--tokenizer`` text of about that many tokens (random ids decoded, then encoded and
cut back: the server tokenizes and detokenizes, as it does for real clients; the mean prompt length
the server counted is reported). Every request asks for exactly ``--output_len`` tokens
(``ignore_eos``), streamed. Reports TTFT, TPOT, ITL and end-to-end latency (mean, p50, p90, p99) and
throughput. ``--processes N`` spreads the client over N processes (``bench_clients``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from .bench_stats import Distribution, latency_table


@dataclass
class RequestRecord:
    start: float
    chunk_times: list[float] = field(default_factory=list)
    completion_tokens: int = 0
    prompt_tokens: int = 0
    end: float = 0.0
    error: str | None = None


@dataclass(frozen=True)
class ServingResult:
    completed: int
    failed: int
    seconds: float
    request_throughput: float
    output_throughput: float
    ttft: Distribution
    tpot: Distribution
    itl: Distribution
    e2e: Distribution
    first_error: str | None
    mean_prompt_tokens: float = 0.0  # as the server counted them (its usage reports)

    def summary(self) -> str:
        lines = [
            f"completed {self.completed}, failed {self.failed}, {self.seconds:.2f} s, "
            f"{self.mean_prompt_tokens:.0f} prompt tokens per request",
            f"throughput {self.request_throughput:.2f} req/s, {self.output_throughput:.1f} output tok/s",
            latency_table([self.ttft, self.tpot, self.itl, self.e2e]),
        ]
        if self.first_error:
            lines.append(f"first error: {self.first_error}")
        return "\n".join(lines)


def make_payload(endpoint: str, model: str | None, prompt: list[int] | str, output_len: int) -> dict[str, Any]:
    payload: dict[str, Any] = {
        "max_tokens": output_len, "ignore_eos": True, "temperature": 0.0, "stream": True,
        "stream_options": {"include_usage": True},
    }
    if model:
        payload["model"] = model
    if endpoint == "chat":
        content = prompt if isinstance(prompt, str) else " ".join(f"w{t}" for t in prompt)
        payload["messages"] = [{"role": "user", "content": content}]
    else:
        payload["prompt"] = prompt
    return payload


def text_prompt(tokenizer: Any, rng: random.Random, length: int) -> str:
    """About ``length`` tokens of text: random ids (no special ones) decoded, encoded again and cut to
    ``length`` (decoding and encoding merge or split a few tokens), then decoded."""
    special = set(tokenizer.all_special_ids)
    ids = [i for i in (rng.randrange(len(tokenizer)) for _ in range(2 * length)) if i not in special][:length]
    ids = tokenizer.encode(tokenizer.decode(ids), add_special_tokens=False)[:length]
    return tokenizer.decode(ids)


STREAMS_PER_PROCESS = 16  # requests in flight one client process keeps without delaying its own reads (H100 8B: 64
# streams in one process doubled the TTFT p99 the server saw; 16 in each of four matched it: docs/perf.md)


def default_processes(concurrency: int | None) -> int:
    """Client processes for ``concurrency`` requests in flight (a Poisson run: one)."""
    return -(-concurrency // STREAMS_PER_PROCESS) if concurrency else 1


def _share(total: int | None, count: int, index: int) -> int | None:
    """Shard ``index``'s part of ``total`` requests in flight split ``count`` ways (None: unbounded)."""
    return None if total is None else total // count + (index < total % count)


async def send_one(client, url: str, payload: dict[str, Any], headers: dict[str, str]) -> RequestRecord:
    record = RequestRecord(start=time.perf_counter())
    try:
        async with client.stream("POST", url, json=payload, headers=headers) as response:
            if response.status_code != 200:
                record.error = f"HTTP {response.status_code}: {(await response.aread()).decode()[:200]}"
                return record
            async for line in response.aiter_lines():
                _read_event(line, record)
    except Exception as exc:  # noqa: BLE001 (a failed request is counted, not fatal)
        record.error = f"{type(exc).__name__}: {exc}"
    record.end = time.perf_counter()
    return record


def _read_event(line: str, record: RequestRecord) -> None:
    if not line.startswith("data: ") or line == "data: [DONE]":
        return
    event = json.loads(line[len("data: "):])
    if "error" in event:
        record.error = str(event["error"].get("message"))
    elif event.get("choices"):
        record.chunk_times.append(time.perf_counter())
    elif event.get("usage"):
        record.completion_tokens = event["usage"]["completion_tokens"]
        record.prompt_tokens = event["usage"]["prompt_tokens"]


async def run_benchmark(base_url: str, *, model: str | None = None, endpoint: str = "completions",
                        input_len: int = 128, output_len: int = 128, num_requests: int = 64,
                        concurrency: int | None = None, request_rate: float | None = None,
                        api_key: str | None = None, vocab_size: int = 32000, seed: int = 0,
                        timeout: float = 600.0, tokenizer: Any = None, processes: int = 1) -> ServingResult:
    """Run the benchmark against ``base_url`` (e.g. ``http://127.0.0.1:8000``); with ``tokenizer``, text
    prompts (:func:`text_prompt`). ``processes`` > 1 splits the requests, the concurrency and the arrival
    rate among that many client processes (``bench_clients.run_shards``)."""
    rng = random.Random(seed)
    url = f"{base_url.rstrip('/')}/v1/{'chat/completions' if endpoint == 'chat' else 'completions'}"
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    prompts = [text_prompt(tokenizer, rng, input_len) if tokenizer is not None
               else [rng.randrange(3, vocab_size) for _ in range(input_len)] for _ in range(num_requests)]
    shard = Shard(url, headers, [make_payload(endpoint, model, prompt, output_len) for prompt in prompts],
                  concurrency, request_rate, seed, timeout)
    if processes > 1:
        from .bench_clients import run_shards

        parts = await asyncio.get_running_loop().run_in_executor(None, run_shards, shard.split(processes))
    else:
        parts = [await shard.send_all()]
    records = [record for part in parts for record in part.records]
    return summarize(records, max(p.end for p in parts) - min(p.begin for p in parts))


@dataclass(frozen=True)
class ShardResult:
    records: list[RequestRecord]
    begin: float  # time.perf_counter() (CLOCK_MONOTONIC: comparable across processes on one host)
    end: float


@dataclass(frozen=True)
class Shard:
    """The requests one client process sends: ``payloads`` with ``concurrency`` in flight, or arriving as a
    Poisson process at ``request_rate`` per second."""

    url: str
    headers: dict[str, str]
    payloads: list[dict[str, Any]]
    concurrency: int | None
    request_rate: float | None
    seed: int
    timeout: float

    def split(self, count: int) -> list[Shard]:
        """``count`` shards (at most one per request in flight): every count-th payload each, the concurrency
        and the rate divided (independent Poisson processes at rate / count add up to one at the rate)."""
        count = max(1, min(count, len(self.payloads), self.concurrency or count))
        return [Shard(self.url, self.headers, self.payloads[i::count], _share(self.concurrency, count, i),
                      self.request_rate and self.request_rate / count, self.seed + i, self.timeout)
                for i in range(count)]

    async def send_all(self) -> ShardResult:
        import httpx

        in_flight = self.concurrency or len(self.payloads)
        limit = asyncio.Semaphore(in_flight)
        limits = httpx.Limits(max_connections=in_flight, max_keepalive_connections=in_flight)
        rng = random.Random(self.seed)
        async with httpx.AsyncClient(timeout=self.timeout, limits=limits) as client:
            async def bounded(payload: dict[str, Any]) -> RequestRecord:
                async with limit:
                    return await send_one(client, self.url, payload, self.headers)

            begin, tasks = time.perf_counter(), []
            for payload in self.payloads:
                tasks.append(asyncio.create_task(bounded(payload)))
                if self.request_rate:
                    await asyncio.sleep(rng.expovariate(self.request_rate))
            records = await asyncio.gather(*tasks)
        return ShardResult(list(records), begin, time.perf_counter())


def summarize(records: list[RequestRecord], seconds: float) -> ServingResult:
    ok = [r for r in records if r.error is None and r.chunk_times]
    failed = [r for r in records if r not in ok]
    ttft = [r.chunk_times[0] - r.start for r in ok]
    tpot = [(r.end - r.chunk_times[0]) / (r.completion_tokens - 1) for r in ok if r.completion_tokens > 1]
    itl = [b - a for r in ok for a, b in zip(r.chunk_times, r.chunk_times[1:])]
    e2e = [r.end - r.start for r in ok]
    tokens = sum(r.completion_tokens for r in ok)
    return ServingResult(
        completed=len(ok), failed=len(failed), seconds=seconds, request_throughput=len(ok) / seconds,
        output_throughput=tokens / seconds, ttft=Distribution.of("TTFT", ttft), tpot=Distribution.of("TPOT", tpot),
        itl=Distribution.of("ITL", itl), e2e=Distribution.of("E2E", e2e),
        first_error=next((r.error for r in failed if r.error), None),
        mean_prompt_tokens=sum(r.prompt_tokens for r in ok) / max(1, len(ok)),
    )


def add_serving_parser(subparsers: Any) -> None:
    from autodeploy.cli import flag

    p = subparsers.add_parser("serve", help="benchmark a running OpenAI-compatible server (streaming client)")
    flag(p, "base_url", default="http://127.0.0.1:8000", help="server address (default http://127.0.0.1:8000)")
    p.add_argument("--model", default=None, help="model name to send (default: none, the server's)")
    p.add_argument("--endpoint", choices=["completions", "chat"], default="completions")
    flag(p, "input_len", type=int, default=128, help="prompt tokens per request (default 128)")
    flag(p, "output_len", type=int, default=128, help="generated tokens per request (default 128)")
    flag(p, "num_requests", type=int, default=64, help="requests (default 64)")
    group = p.add_mutually_exclusive_group()
    group.add_argument("--concurrency", "--max-concurrency", dest="concurrency", type=int, default=None,
                       help="requests in flight at once (--max-concurrency: vLLM's benchmark's name)")
    flag(group, "request_rate", type=float, default=None, help="Poisson arrivals per second")
    flag(p, "vocab_size", type=int, default=32000, help="random prompt ids are drawn below this (default 32000)")
    flag(p, "tokenizer", default=None, help="send text prompts of about --input_len tokens of this tokenizer (a "
         "directory); default: token-id prompts")
    flag(p, "api_key", default=None, help="API key of the server")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--processes", type=int, default=None,
                   help="client processes sharing the requests, the concurrency and the rate (default: one per "
                        f"{STREAMS_PER_PROCESS} requests in flight with --concurrency, else 1; one process streaming "
                        "thousands of chunks a second delays its own reads and reports a TTFT tail of its own)")
    flag(p, "output_json", default=None, metavar="FILE", help="also write the results as JSON")
    p.add_argument("--log_level", default="warning", help=argparse.SUPPRESS)
    p.set_defaults(func=cmd_serving)


def cmd_serving(args: argparse.Namespace) -> int:
    from .tokenizer import load_tokenizer

    result = asyncio.run(run_benchmark(
        args.base_url, model=args.model, endpoint=args.endpoint, input_len=args.input_len,
        output_len=args.output_len, num_requests=args.num_requests, concurrency=args.concurrency,
        request_rate=args.request_rate, api_key=args.api_key, vocab_size=args.vocab_size, seed=args.seed,
        tokenizer=load_tokenizer(args.tokenizer) if args.tokenizer else None,
        processes=args.processes or default_processes(args.concurrency),
    ))
    print(result.summary())
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(asdict(result), f, indent=2)
    return 0 if result.failed == 0 else 1
