"""Many clients at once: streaming to completion, and walking away mid-stream."""

import asyncio
import json
import re
import time

import httpx

from autodeploy.serve import serving_common


async def _stream_to_end(client: httpx.AsyncClient, url: str, i: int) -> tuple[int, str | None]:
    body = {"prompt": [3 + i % 50, 4, 5 + i % 7], "max_tokens": 6, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    tokens, finish = 0, None
    async with client.stream("POST", url + "/v1/completions", json=body) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[6:])
            if event["choices"]:
                finish = event["choices"][0]["finish_reason"] or finish
            else:
                tokens = event["usage"]["completion_tokens"]
    return tokens, finish


def test_64_concurrent_streaming_clients_all_finish(live):
    async def main():
        async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=64)) as client:
            return await asyncio.gather(*(_stream_to_end(client, live.url, i) for i in range(64)))

    results = asyncio.run(main())
    assert results == [(6, "length")] * 64


async def _abort_after_first_token(client: httpx.AsyncClient, url: str, i: int) -> bool:
    body = {"messages": [{"role": "user", "content": f"request {i}"}], "max_tokens": 200, "ignore_eos": True,
            "stream": True}
    async with client.stream("POST", url + "/v1/chat/completions", json=body) as response:
        async for line in response.aiter_lines():
            if line.startswith("data: {") and json.loads(line[6:])["choices"][0]["delta"].get("content"):
                return True  # leaving the block closes the connection mid-stream
    return False


def _gauge(text: str, name: str) -> float:
    return float(re.search(rf'^{name}{{model_name="tiny"}} (\S+)$', text, re.M).group(1))


def test_200_requests_aborted_mid_stream_leave_zero_blocks(live):
    async def main():
        async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=200)) as client:
            return await asyncio.gather(*(_abort_after_first_token(client, live.url, i) for i in range(200)))

    assert all(asyncio.run(main()))
    deadline = time.monotonic() + 30
    while True:
        metrics = httpx.get(live.url + "/metrics").text
        used, running = _gauge(metrics, "autodeploy_kv_cache_used_blocks"), _gauge(metrics, "autodeploy_num_requests_running")
        if (used, running) == (0, 0) or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert (used, running, _gauge(metrics, "autodeploy_num_requests_waiting")) == (0, 0, 0)
    aborted = re.search(r'^autodeploy_request_success_total{finished_reason="abort",model_name="tiny"} (\S+)$', metrics, re.M)
    assert float(aborted.group(1)) == 200
    assert live.state.engine.stats().num_used_blocks == 0


def _aborted(live) -> float:
    text = httpx.get(live.url + "/metrics").text
    match = re.search(r'^autodeploy_request_success_total{finished_reason="abort",model_name="tiny"} (\S+)$', text, re.M)
    return float(match.group(1)) if match else 0.0


def test_a_non_streaming_client_that_leaves_frees_its_blocks(live, monkeypatch):
    # the server looks for the disconnect every DISCONNECT_POLL_SECONDS (0.5 s); 220 tokens can take
    # less than that on the CPU, and a request that finishes first is no abort: poll often here
    monkeypatch.setattr(serving_common, "DISCONNECT_POLL_SECONDS", 0.02)
    body = {"prompt": [5, 6, 7], "max_tokens": 220, "ignore_eos": True}
    aborted_before = _aborted(live)
    try:
        # the client leaves well before the 220 tokens are done (a few ms each here), so the abort wins
        httpx.post(live.url + "/v1/completions", json=body, timeout=0.2)
    except httpx.TimeoutException:
        pass
    else:
        raise AssertionError("the request should have outlived the client's timeout")
    deadline = time.monotonic() + 10
    # the engine frees the blocks, then reports the abort (metrics): wait for both
    while (live.state.engine.stats().num_used_blocks or _aborted(live) == aborted_before) \
            and time.monotonic() < deadline:
        time.sleep(0.05)
    stats = live.state.engine.stats()
    assert (stats.num_used_blocks, stats.num_running, stats.num_waiting) == (0, 0, 0)
    assert _aborted(live) == aborted_before + 1
