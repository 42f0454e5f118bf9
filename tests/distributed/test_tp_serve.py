"""``autodeploy serve --tp_size 2`` on the CPU: it answers the openai client, reports the plan and
every rank's memory, and when a worker is killed it fails clearly (503s, a log line naming the
rank) within seconds instead of hanging."""

import os
import re
import signal
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest

pytestmark = pytest.mark.slow


class _Server:
    """The server process; its output is collected on threads (read it any time)."""

    def __init__(self, argv):
        env = dict(os.environ, OMP_NUM_THREADS="1")
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        self.out, self.err = [], []
        for stream, lines in ((self.proc.stdout, self.out), (self.proc.stderr, self.err)):
            threading.Thread(target=lambda s=stream, l=lines: l.extend(s), daemon=True).start()

    def wait_for(self, pattern: str, seconds: float) -> re.Match:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            match = re.search(pattern, "".join(self.out + self.err))
            if match:
                return match
            if self.proc.poll() is not None:
                break
            time.sleep(0.1)
        raise AssertionError(f"no '{pattern}' (exit code {self.proc.poll()}):\n{''.join(self.err)[-3000:]}")


@pytest.fixture(scope="module")
def server(tiny_served):
    argv = [sys.executable, "-m", "autodeploy.cli", "serve", str(tiny_served), "--tp_size", "2", "--port", "0",
            "--device", "cpu", "--dtype", "float32", "--max_seq_len", "128", "--num_kv_blocks", "64",
            "--served_model_name", "tiny"]
    server = _Server(argv)
    server.url = server.wait_for(r"listening on (http://\S+)", 60).group(1)
    server.wait_for(r"serving +tiny at", 400)
    yield server
    if server.proc.poll() is None:
        server.proc.send_signal(signal.SIGINT)
        server.proc.wait(timeout=30)


def test_serves_the_openai_client_and_reports_every_rank(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="not-needed", max_retries=0, timeout=60)
    completion = client.completions.create(model="tiny", prompt="Hello world", max_tokens=5, temperature=0,
                                           extra_body={"ignore_eos": True})
    assert completion.usage.completion_tokens == 5
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                          extra_body={"ignore_eos": True})
    assert chat.usage.completion_tokens == 4
    report = "".join(server.out)
    assert "tensor par.  2 ranks: 2 attention, 2 gated_mlp, 1 lm_head (heads 4 -> 2, kv heads 2 -> 1)" in report
    assert re.search(r"rank 1 +pid \d+: weights .* MiB, KV cache .* MiB \(64 blocks\)", report)


def test_a_dead_worker_means_503_and_a_clear_log_line(server):
    pid = int(server.wait_for(r"rank 1 +pid (\d+)", 1).group(1))
    os.kill(pid, signal.SIGKILL)
    killed = time.monotonic()
    while httpx.get(server.url + "/health").status_code != 503:
        assert time.monotonic() - killed < 5, "the server still reports healthy 5 s after its worker died"
        time.sleep(0.05)
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="not-needed", max_retries=0, timeout=10)
    with pytest.raises(openai.APIStatusError) as failed:
        client.completions.create(model="tiny", prompt="Hello", max_tokens=3)
    assert failed.value.status_code == 503 and f"rank 1 (pid {pid}) exited" in failed.value.message
    server.wait_for(rf"ERROR autodeploy.serve.tp: tensor-parallel rank 1 \(pid {pid}\) exited with code -9", 5)
    server.proc.send_signal(signal.SIGINT)
    assert server.proc.wait(timeout=30) == 0
