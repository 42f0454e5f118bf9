"""The boundary between the API process and the engine in its own process: a dead engine turns into
503s and one clear log line, and under many streams with random aborts no request is lost or reported
twice."""

import asyncio
import json
import logging
import os
import random
import re
import signal
import time

import httpx

from conftest import serving, settled_stats

from autodeploy.serve import async_engine

NUM_STREAMS = 256
MAX_TOKENS = 6
PROMPTS = [[3, 4, 5], [7, 8, 9, 10], [11, 12], [13, 14, 15, 16, 17]]


def _body(i: int, stream: bool) -> dict:
    body = {"prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": MAX_TOKENS, "ignore_eos": True, "temperature": 0}
    return {**body, "stream": True, "stream_options": {"include_usage": True}} if stream else body


def test_killing_the_engine_process_gives_503s_within_seconds_and_a_log_line(compiled, tokenizer, caplog):
    with serving(compiled, tokenizer, engine_process=True) as server:
        client = server.state.engine
        body = {"prompt": [5, 6, 7], "max_tokens": 200, "ignore_eos": True}
        assert httpx.post(server.url + "/v1/completions", json={**body, "max_tokens": 2}, timeout=30).status_code == 200
        with caplog.at_level(logging.ERROR, logger="autodeploy.serve.engine_client"):
            with httpx.stream("POST", server.url + "/v1/completions", json={**body, "stream": True},
                              timeout=30) as in_flight:
                lines = in_flight.iter_lines()
                assert next(line for line in lines if line.startswith("data: {"))  # generating
                killed = time.monotonic()
                os.kill(client.process.pid, signal.SIGKILL)
                rest = [line for line in lines if line]
            deadline = killed + 5
            while httpx.get(server.url + "/health").status_code != 503:
                assert time.monotonic() < deadline, "/health still 200 five seconds after the engine died"
                time.sleep(0.05)
            response = httpx.post(server.url + "/v1/completions", json=body, timeout=30)
            seconds = time.monotonic() - killed
        assert seconds < 5
        assert rest[-1] == "data: [DONE]" and '"error"' in rest[-2]  # the stream in flight ended with an error
        assert response.status_code == 503
        message = response.json()["error"]["message"]
        assert f"the engine process (pid {client.process.pid}) exited with code -9" in message
        logged = [r.getMessage() for r in caplog.records if "exited with code -9" in r.getMessage()]
        assert len(logged) == 1 and "restart it" in logged[0]


async def _stream(client: httpx.AsyncClient, url: str, i: int, leave_after: int | None) -> tuple[str, str | None]:
    """Read request ``i``'s stream; leave after ``leave_after`` events (0: right after the headers).
    Returns ("left", None) for a client that left, else ("done", text) with the usage checked."""
    text, events, usage = "", 0, None
    async with client.stream("POST", url + "/v1/completions", json=_body(i, stream=True)) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if leave_after is not None and events >= leave_after:
                return "left", None
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[6:])
            events += 1
            if event["choices"]:
                text += event["choices"][0]["text"]
            else:
                usage = event["usage"]
    assert usage is not None and usage["completion_tokens"] == MAX_TOKENS, (i, usage)
    return "done", text


def _counter(metrics: str, reason: str) -> float:
    match = re.search(rf'^autodeploy_request_success_total{{finished_reason="{reason}",model_name="tiny"}} (\S+)$',
                      metrics, re.M)
    return float(match.group(1)) if match else 0.0


def test_256_streams_with_random_aborts_lose_and_duplicate_nothing(compiled, tokenizer):
    rng = random.Random(36)
    plan = [rng.choice([None, None, 0, 1, 2, 4]) for _ in range(NUM_STREAMS)]  # a third leave early
    with serving(compiled, tokenizer, engine_process=True) as server:
        expected = [httpx.post(server.url + "/v1/completions", json=_body(i, stream=False), timeout=60)
                    .json()["choices"][0]["text"] for i in range(len(PROMPTS))]
        metrics = httpx.get(server.url + "/metrics").text
        before = _counter(metrics, "length") + _counter(metrics, "abort")

        async def main():
            limits = httpx.Limits(max_connections=NUM_STREAMS)
            async with httpx.AsyncClient(timeout=120, limits=limits) as client:
                return await asyncio.gather(*(_stream(client, server.url, i, leave) for i, leave in enumerate(plan)))

        results = asyncio.run(main())
        for i, (outcome, text) in enumerate(results):
            # a leaver gets the whole stream in fewer events only where queued deltas join (AUTODEPLOY_COALESCE_STREAMS)
            assert outcome == ("left" if plan[i] is not None else "done") or (async_engine.COALESCE_STREAMS and plan[i])
            if outcome == "done":
                assert text == expected[i % len(PROMPTS)], i  # every token once, in order
        stats = settled_stats(server.state.engine)
        deadline = time.monotonic() + 10
        while True:  # each request is reported once: finished (length) or aborted, never both, never neither
            metrics = httpx.get(server.url + "/metrics").text
            reported = _counter(metrics, "length") + _counter(metrics, "abort") - before
            if reported >= NUM_STREAMS or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        assert reported == NUM_STREAMS
        assert (stats.num_used_blocks, stats.num_running, stats.num_waiting) == (0, 0, 0)
        assert server.state.engine.num_streams == 0 and server.state.engine.processor.num_requests == 0


def test_a_model_with_recurrent_state_serves_the_same_tokens_across_the_process_boundary(tokenizer, tmp_path):
    """nemotron_h (Mamba-2 state slots beside the KV blocks): a greedy completion, whole and streamed, from the
    engine in its own process equals the engine on a thread, a second time too (the slot starts clean), and
    every block comes back."""
    import autodeploy
    from autodeploy.tiny import make_tiny_checkpoint
    from conftest import VOCAB_SIZE

    path = make_tiny_checkpoint("nemotron_h", tmp_path / "nemotron_h", vocab_size=VOCAB_SIZE)
    model = autodeploy.compile(path, device="cpu", dtype="float32", max_batch_size=4, max_num_tokens=64,
                               max_seq_len=96, num_kv_blocks=64, tokens_per_block=8)
    body = {"prompt": "the capital of France is", "max_tokens": 8, "ignore_eos": True, "temperature": 0}
    texts = {}
    for mode in (False, True):
        with serving(model, tokenizer, engine_process=mode) as server:
            whole = [httpx.post(server.url + "/v1/completions", json=body, timeout=60).json()["choices"][0]["text"]
                     for _ in range(2)]
            with httpx.stream("POST", server.url + "/v1/completions", json={**body, "stream": True}, timeout=60) as r:
                chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
            streamed = "".join(c["choices"][0]["text"] for c in chunks)
            assert whole[0] == whole[1] == streamed
            texts[mode] = streamed
            assert settled_stats(server.state.engine).num_used_blocks == 0
    assert texts[True] == texts[False]
