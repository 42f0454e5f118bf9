"""Soak: 1,000 requests against a real ``autodeploy serve`` process (tiny model, CPU), mixing valid
ones with invalid ones, aborts and hostile ones (huge stop lists, slow client templates, 10 MB
bodies, values that used to kill the engine). Every valid request must complete
with the output it has in a clean run of the valid requests alone (measured in the same test,
before and after), the valid requests' p99 latency must stay within 2x of the clean runs', and no
KV block may be left behind.

The valid requests come from a fixed number of clients that each wait for their answer; the others
arrive at a steady rate spread over the clean run's duration (a flood of cheap requests as fast as
the client can send them is a rate-limiting question, not the one asked here: whether a request can
hurt the ones beside it)."""

import asyncio
import json
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

from conftest import wait_for_url

# (each of the 11 kinds of others still comes ~55 times in a run of ~15 s, and the p99 is the 5th-slowest
# of 400 valid requests; twice as many made no other point and cost CI 45 s)
NUM_VALID = 400
NUM_OTHER = 600  # invalid, aborted and hostile: 1,000 requests in the mixed run
VALID_CONCURRENCY = 8
OTHER_CONCURRENCY = 16  # at most this many of the others in flight
NESTED_LOOPS = "{% for a in range(100000) %}{% for b in range(100000) %}{{ a }}{% endfor %}{% endfor %}"
TEN_MB_BODY = json.dumps({"prompt": "x" * 10_000_000, "max_tokens": 1}).encode()


def _valid_requests() -> list[tuple[str, dict]]:
    rng = random.Random(0)
    requests = []
    for i in range(NUM_VALID):
        tokens = rng.randint(24, 40)  # (so that the engine's work, not HTTP's, sets a valid request's latency)
        if i % 3 == 2:
            body = {"messages": [{"role": "user", "content": f"question {i % 37}"}], "max_tokens": tokens,
                    "temperature": 0, "ignore_eos": True, "stream": i % 2 == 0}
            requests.append(("/v1/chat/completions", body))
        else:
            prompt = [rng.randrange(5, 380) for _ in range(rng.randint(1, 12))]
            body = {"prompt": prompt, "max_tokens": tokens, "temperature": 0, "ignore_eos": True, "stream": i % 2 == 1}
            requests.append(("/v1/completions", body))
    return requests


def _other_request(i: int) -> tuple[str, str, dict | bytes | None]:
    """(kind, path, body) of the i-th non-valid request."""
    kinds = [
        ("invalid", "/v1/completions", {"prompt": "hi", "top_k": 2**63}),
        ("invalid", "/v1/completions", {"prompt": [[False]], "max_tokens": 1}),
        ("invalid", "/v1/completions", {"prompt": [5, 100_000]}),
        ("invalid", "/detokenize", {"tokens": [-1]}),
        ("invalid", "/v1/chat/completions", {"messages": [], "max_tokens": 1}),
        ("invalid", "/v1/completions", b'{"prompt": "x", "temperature": NaN}'),
        ("invalid", "/v1/completions", b'{"prompt": "x",'),
        ("hostile", "/v1/completions", {"prompt": "hi", "stop": ["zz"] * 50_000}),
        ("hostile", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                             "chat_template": NESTED_LOOPS}),
        ("hostile", "/v1/completions", TEN_MB_BODY),
        ("abort", "/v1/completions", {"prompt": [7, 8, 9], "max_tokens": 200, "ignore_eos": True, "stream": True}),
    ]
    return kinds[i % len(kinds)]


async def _send_valid(client: httpx.AsyncClient, path: str, body: dict) -> tuple[float, str]:
    started = time.monotonic()
    if not body["stream"]:
        response = await client.post(path, json=body)
        assert response.status_code == 200, response.text
        choice = response.json()["choices"][0]
        return time.monotonic() - started, choice.get("text", choice.get("message", {}).get("content"))
    text, last = [], None
    async with client.stream("POST", path, json=body) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            last = line or last
            if line.startswith("data: {"):
                event = json.loads(line[6:])
                assert "error" not in event, event
                choice = event["choices"][0] if event["choices"] else {}
                text.append(choice.get("text") or choice.get("delta", {}).get("content") or "")
        assert last == "data: [DONE]"
    return time.monotonic() - started, "".join(text)


async def _send_other(url: str, i: int) -> None:
    """One of the others, over a bare connection: the test's own client must not be what slows the
    valid requests down (httpx costs more CPU per request than the server's answer to most of these)."""
    kind, path, body = _other_request(i)
    payload = body if isinstance(body, bytes) else json.dumps(body).encode()
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    head = (f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(payload)}\r\n\r\n")
    try:
        writer.write(head.encode() + payload)
        await writer.drain()
        headers = await reader.readuntil(b"\r\n\r\n")
        if kind == "abort":  # leave after the first token
            await reader.readuntil(b"data: {")
            return
        answer = await reader.readexactly(int(re.search(rb"content-length: (\d+)", headers, re.I).group(1)))
    finally:
        writer.close()
    status = int(headers[9:12])
    assert status < 500, (kind, path, answer[:300])
    assert status in (400, 413), (kind, path, answer[:300])


async def _run(url: str, valid: list, others_over: float | None = None) -> tuple[list[tuple[float, str]], float]:
    """Latency and text of each valid request, and the run's duration; with ``others_over``, the
    other requests are sent too, at a steady rate over that many seconds."""
    results: list = [None] * len(valid)
    valid_queue = list(enumerate(valid))
    # (idle connections are dropped before the server's keep-alive timeout, 5 s, can close them under a request)
    limits = httpx.Limits(max_connections=VALID_CONCURRENCY, keepalive_expiry=2)
    started = time.monotonic()
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as client:
        async def valid_worker():
            while valid_queue:
                index, (path, body) = valid_queue.pop(0)
                results[index] = await _send_valid(client, path, body)

        async def send_others():
            in_flight, tasks = asyncio.Semaphore(OTHER_CONCURRENCY), []

            async def send(i):
                try:
                    await _send_other(url, i)
                finally:
                    in_flight.release()

            for i in range(NUM_OTHER):
                await asyncio.sleep(max(0.0, started + i * others_over / NUM_OTHER - time.monotonic()))
                await in_flight.acquire()
                tasks.append(asyncio.create_task(send(i)))
            await asyncio.gather(*tasks)

        await asyncio.gather(*[valid_worker() for _ in range(VALID_CONCURRENCY)],
                             *([send_others()] if others_over is not None else []))
    return results, time.monotonic() - started


def _p99(latencies: list[float]) -> float:
    return sorted(latencies)[int(0.99 * (len(latencies) - 1))]


def _gauge(text: str, name: str) -> float:
    return float(re.search(rf"^autodeploy_{name}{{[^}}]*}} (\S+)$", text, re.M).group(1))


def _start_server(tiny_dir) -> tuple[subprocess.Popen, str]:
    argv = [sys.executable, "-m", "autodeploy.cli", "serve", str(tiny_dir), "--port", "0", "--device", "cpu",
            "--dtype", "float32", "--max_seq_len", "256", "--max_batch_size", "64", "--num_kv_blocks", "512",
            "--tokens_per_block", "8", "--served_model_name", "tiny"]
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ, OMP_NUM_THREADS="1"))
    url = wait_for_url(proc)
    proc.log = []  # read on, so the server never blocks on a full pipe
    threading.Thread(target=lambda: proc.log.extend(proc.stderr), daemon=True).start()
    deadline = time.monotonic() + 180
    while httpx.get(url + "/health").status_code != 200:
        assert time.monotonic() < deadline and proc.poll() is None, "the server did not become ready"
        time.sleep(0.2)
    return proc, url


@pytest.mark.slow
def test_soak_valid_requests_unharmed_by_invalid_aborted_and_hostile_ones(tiny_dir):
    proc, url = _start_server(tiny_dir)
    try:
        valid = _valid_requests()
        asyncio.run(_run(url, valid[:64]))  # warm up
        clean, clean_seconds = asyncio.run(_run(url, valid))
        mixed, mixed_seconds = asyncio.run(_run(url, valid, others_over=clean_seconds))
        clean_after, _ = asyncio.run(_run(url, valid))  # the machine may have changed meanwhile
        assert [text for _, text in mixed] == [text for _, text in clean] == [text for _, text in clean_after]
        clean_p99 = max(_p99([t for t, _ in clean]), _p99([t for t, _ in clean_after]))
        mixed_p99 = _p99([t for t, _ in mixed])
        print(f"valid requests' p99: clean {clean_p99 * 1e3:.0f} ms, mixed {mixed_p99 * 1e3:.0f} ms "
              f"({clean_seconds:.1f} s clean, {mixed_seconds:.1f} s mixed)")
        assert mixed_p99 <= 2 * clean_p99, (clean_p99, mixed_p99)
        deadline = time.monotonic() + 30
        while True:  # aborted streams are freed before the engine's next step
            metrics = httpx.get(url + "/metrics").text
            settled = [_gauge(metrics, n) for n in ("kv_cache_used_blocks", "num_requests_running",
                                                    "num_requests_waiting")]
            if settled == [0, 0, 0] or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert settled == [0, 0, 0]
        assert httpx.get(url + "/health").json() == {"status": "ok"}
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        finally:
            if proc.poll() is None:
                proc.kill()
    assert proc.returncode == 0
