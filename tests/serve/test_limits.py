"""The operator's request limits, and chat templates sent by clients: refused by default, rendered
in a sandboxed worker process off the event loop when allowed (finding 3 of issue 33)."""

import threading
import time

import httpx
import pytest

from autodeploy.serve.limits import RequestLimits
from conftest import serving

CHAT = "/v1/chat/completions"
MESSAGES = [{"role": "user", "content": "hi"}]
CLIENT_TEMPLATE = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}{{ bos_token }}"
NESTED_LOOPS = "{% for a in range(100000) %}{% for b in range(100000) %}{{ '' }}{% endfor %}{% endfor %}"


def post(url, path, body):
    return httpx.post(url + path, json=body, timeout=60)


@pytest.mark.parametrize("path, body", [
    (CHAT, {"messages": MESSAGES, "chat_template": CLIENT_TEMPLATE}),
    (CHAT, {"messages": MESSAGES, "chat_template_kwargs": {"chat_template": NESTED_LOOPS}}),
    ("/tokenize", {"messages": MESSAGES, "chat_template_kwargs": {"chat_template": NESTED_LOOPS}}),
])
def test_client_templates_are_refused_by_default(live, path, body):
    started = time.monotonic()
    response = post(live.url, path, body)
    assert response.status_code == 400 and "--trust_request_chat_template" in response.json()["error"]["message"]
    assert time.monotonic() - started < 2


@pytest.mark.parametrize("name", ["tokenize", "return_dict", "tools", "continue_final_message"])
def test_template_kwargs_cannot_set_apply_chat_template_parameters(live, name):
    response = post(live.url, CHAT, {"messages": MESSAGES, "chat_template_kwargs": {name: True}})
    assert response.status_code == 400 and name in response.json()["error"]["message"]


def test_template_variables_still_reach_the_template(live):
    response = post(live.url, "/tokenize", {"messages": MESSAGES, "chat_template_kwargs": {"enable_thinking": False}})
    assert response.status_code == 200


def test_trusted_client_templates_render_in_the_sandbox_off_the_event_loop(compiled, tokenizer):
    limits = RequestLimits(trust_request_chat_template=True, chat_template_timeout=1.5)
    with serving(compiled, tokenizer, limits=limits) as server:
        tokens = post(server.url, "/tokenize", {"messages": MESSAGES, "chat_template": CLIENT_TEMPLATE}).json()
        assert tokens["tokens"] == tokenizer.encode("[user] hi\n<s>", add_special_tokens=False)
        assert post(server.url, CHAT, {"messages": MESSAGES, "chat_template": CLIENT_TEMPLATE,
                                       "max_tokens": 2}).status_code == 200
        results = []
        slow = threading.Thread(target=lambda: results.append(post(server.url, CHAT, {
            "messages": MESSAGES, "chat_template_kwargs": {"chat_template": NESTED_LOOPS}})))
        latencies = []
        slow.start()
        time.sleep(0.1)
        while slow.is_alive():
            started = time.monotonic()
            assert httpx.get(server.url + "/health", timeout=30).status_code == 200
            latencies.append(time.monotonic() - started)
            time.sleep(0.05)
        assert results[0].status_code == 400 and "longer than 1.5 s" in results[0].json()["error"]["message"]
        assert len(latencies) >= 5 and max(latencies) < 0.5, latencies
        for bomb in ("{{ 'x' * 10**9 }}", "{{ 'x' | center(10**9) }}", "{{ messages.__class__.__mro__ }}",
                     "{% set ns = namespace(x='ab') %}{% for i in range(60) %}{% set ns.x = ns.x ~ ns.x %}"
                     "{% endfor %}{{ ns.x }}"):
            response = post(server.url, CHAT, {"messages": MESSAGES, "chat_template": bomb})
            assert response.status_code == 400, bomb
        assert post(server.url, CHAT, {"messages": MESSAGES, "chat_template": CLIENT_TEMPLATE,
                                       "max_tokens": 2}).status_code == 200  # the worker came back


def test_prompt_token_and_sequence_limits(compiled, tokenizer):
    limits = RequestLimits(max_prompt_tokens=8, max_sequences_per_request=4, max_stop_strings=1)
    with serving(compiled, tokenizer, limits=limits) as server:
        response = post(server.url, "/v1/completions", {"prompt": list(range(5, 15)), "max_tokens": 1})
        assert response.status_code == 400 and "--max_prompt_tokens" in response.json()["error"]["message"]
        assert post(server.url, "/v1/completions", {"prompt": list(range(5, 13)), "max_tokens": 1}).status_code == 200
        response = post(server.url, "/v1/completions", {"prompt": [[5], [6], [7]], "n": 2, "max_tokens": 1})
        assert response.status_code == 400 and "--max_sequences_per_request" in response.json()["error"]["message"]
        response = post(server.url, CHAT, {"messages": MESSAGES, "stop": ["a", "b"]})
        assert response.status_code == 400 and "--max_stop_strings" in response.json()["error"]["message"]
