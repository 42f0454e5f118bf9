"""Graceful shutdown: requests in flight finish within the drain timeout; the rest end with an
error event and [DONE] (streams) or a 503; new requests get 503; the process exits 0."""

import json
import os
import signal
import subprocess
import sys
import threading
import time

import httpx

from conftest import serving, wait_for_url


def _stream(url: str, body: dict, events: list, first_token: threading.Event) -> None:
    with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True}, timeout=60) as response:
        for line in response.iter_lines():
            if line:
                events.append(line)
                first_token.set()


def _drain_with_one_stream(compiled, tokenizer, max_tokens: int, drain_timeout: float) -> tuple[list, float]:
    events, first_token = [], threading.Event()
    with serving(compiled, tokenizer, drain_timeout=drain_timeout) as server:
        body = {"prompt": [5, 6, 7], "max_tokens": max_tokens, "ignore_eos": True}
        client = threading.Thread(target=_stream, args=(server.url, body, events, first_token))
        client.start()
        assert first_token.wait(30)
        started = time.monotonic()
        server.server.handle_exit(signal.SIGTERM, None)
        time.sleep(0.05)
        assert server.state.draining
        try:  # no new connections; a request on a connection still open gets 503
            health = httpx.get(server.url + "/health")
            assert health.status_code == 503 and "shutting down" in health.json()["error"]["message"]
        except httpx.ConnectError:
            pass
        client.join(30)
        server.thread.join(30)
        took = time.monotonic() - started
        assert not server.thread.is_alive()
        assert server.state.engine.stats().num_used_blocks == 0
    return events, took


def test_a_stream_that_finishes_within_the_drain_is_not_cut(compiled, tokenizer):
    events, _ = _drain_with_one_stream(compiled, tokenizer, max_tokens=40, drain_timeout=20)
    assert events[-1] == "data: [DONE]"
    assert json.loads(events[-2][6:])["choices"][0]["finish_reason"] == "length"


def test_after_the_drain_timeout_streams_end_with_an_error_event_and_done(compiled, tokenizer):
    events, took = _drain_with_one_stream(compiled, tokenizer, max_tokens=240, drain_timeout=0.2)
    assert events[-1] == "data: [DONE]"
    error = json.loads(events[-2][6:])["error"]
    assert error["code"] == 503 and "drain timeout" in error["message"]
    assert took < 5



def test_sigterm_drains_and_exits_0_without_tracebacks(tiny_dir):
    argv = [sys.executable, "-m", "autodeploy.cli", "serve", str(tiny_dir), "--port", "0", "--device", "cpu",
            "--dtype", "float32", "--max_seq_len", "256", "--num_kv_blocks", "64", "--drain_timeout", "0.3",
            "--log_level", "info", "--engine_process", "on", "--set", "warm_up=true"]  # as on CUDA
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ, OMP_NUM_THREADS="1"))
    events, first_token = [], threading.Event()
    try:
        url = wait_for_url(proc)
        deadline = time.monotonic() + 150
        while httpx.get(url + "/health").status_code != 200 and time.monotonic() < deadline:
            time.sleep(0.2)
        body = {"prompt": [5, 6, 7], "max_tokens": 250, "ignore_eos": True}
        client = threading.Thread(target=_stream, args=(url, body, events, first_token))
        client.start()
        assert first_token.wait(30)
        proc.send_signal(signal.SIGTERM)
        client.join(30)
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err[-3000:]
    assert events[-1] == "data: [DONE]" and '"code":503' in events[-2].replace(" ", "")
    assert "Traceback" not in err and "CancelledError" not in err, err[-3000:]
    assert "engine       in its own process (pid" in out and "warm-up      " in out  # spawned, warmed up
