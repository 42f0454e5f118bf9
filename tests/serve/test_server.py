"""The HTTP surface against a live server: wire format (vLLM's), streaming, tokenizer routes,
metrics, and every bad-input case with its status code and error body."""

import json

import httpx
import pytest

SENTINEL = "zqxj-sentinel"  # must never come back in an error body


def post(live, path, body, **kwargs):
    return httpx.post(live.url + path, json=body, timeout=60, **kwargs)


def sse_events(live, path, body) -> list:
    events = []
    with httpx.stream("POST", live.url + path, json=body, timeout=60) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in response.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    for line in lines[:-1]:
        assert line.startswith("data: ")
        events.append(json.loads(line[len("data: "):]))
    return events


def test_models_health_version(live):
    models = httpx.get(live.url + "/v1/models").json()
    assert models["object"] == "list" and [m["id"] for m in models["data"]] == ["tiny"]
    assert models["data"][0]["max_model_len"] == 256
    assert httpx.get(live.url + "/health").status_code == 200
    assert "version" in httpx.get(live.url + "/version").json()


def test_completion_defaults_to_16_tokens_and_reports_usage(live):
    body = post(live, "/v1/completions", {"prompt": "Hello world", "ignore_eos": True}).json()
    assert body["object"] == "text_completion" and body["model"] == "tiny"
    (choice,) = body["choices"]
    assert choice["finish_reason"] == "length" and choice["index"] == 0
    assert body["usage"]["completion_tokens"] == 16
    assert body["usage"]["total_tokens"] == body["usage"]["prompt_tokens"] + 16


@pytest.mark.parametrize("prompt, count", [("Hi", 1), (["Hi", "Ho"], 2), ([5, 6, 7], 1), ([[5, 6], [7, 8, 9]], 2)])
def test_completion_prompt_forms_and_choice_indices(live, prompt, count):
    body = post(live, "/v1/completions", {"prompt": prompt, "max_tokens": 2, "n": 2, "ignore_eos": True}).json()
    assert sorted(c["index"] for c in body["choices"]) == list(range(2 * count))
    assert body["usage"]["completion_tokens"] == 4 * count


def test_echo_with_logprobs_on_token_ids_scores_the_prompt(live):
    prompt = [10, 20, 30, 40, 50]
    body = post(live, "/v1/completions", {"prompt": prompt, "echo": True, "logprobs": 1, "max_tokens": 1,
                                          "temperature": 0}).json()
    logprobs = body["choices"][0]["logprobs"]
    assert len(logprobs["token_logprobs"]) == len(prompt) + 1
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    assert all(isinstance(v, float) and v <= 0 for v in logprobs["token_logprobs"][1:])
    assert all(isinstance(t, dict) and 1 <= len(t) <= 2 for t in logprobs["top_logprobs"][1:])
    assert logprobs["text_offset"] == sorted(logprobs["text_offset"])
    detok = post(live, "/detokenize", {"tokens": prompt}).json()["prompt"]
    assert body["choices"][0]["text"].startswith(detok)


def test_chat_max_completion_tokens_wins(live):
    body = post(live, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 9,
                                               "max_completion_tokens": 3, "ignore_eos": True}).json()
    assert body["object"] == "chat.completion" and body["choices"][0]["message"]["role"] == "assistant"
    assert body["usage"]["completion_tokens"] == 3 and body["choices"][0]["finish_reason"] == "length"


def test_completion_stream_with_usage(live):
    events = sse_events(live, "/v1/completions", {"prompt": "Hello", "max_tokens": 4, "ignore_eos": True,
                                                  "stream": True, "stream_options": {"include_usage": True}})
    *chunks, usage = events
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 4
    assert all(c["object"] == "text_completion" and len(c["choices"]) == 1 for c in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    full = post(live, "/v1/completions", {"prompt": "Hello", "max_tokens": 4, "ignore_eos": True, "temperature": 0})
    streamed = sse_events(live, "/v1/completions", {"prompt": "Hello", "max_tokens": 4, "ignore_eos": True,
                                                    "temperature": 0, "stream": True})
    assert "".join(c["choices"][0]["text"] for c in streamed) == full.json()["choices"][0]["text"]


def test_chat_stream_starts_with_the_role(live):
    events = sse_events(live, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                                       "max_tokens": 3, "stream": True, "ignore_eos": True})
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all(e["object"] == "chat.completion.chunk" for e in events)
    assert events[-1]["choices"][0]["finish_reason"] == "length"
    assert "usage" not in events[-1] or events[-1]["usage"] is None


def test_tokenize_detokenize_and_tokenizer_info(live, tokenizer):
    tokens = post(live, "/tokenize", {"prompt": "Hello world"}).json()
    assert tokens == {"count": len(tokenizer.encode("Hello world")), "max_model_len": 256,
                      "tokens": tokenizer.encode("Hello world")}
    chat = post(live, "/tokenize", {"messages": [{"role": "user", "content": "hi"}]}).json()
    assert chat["count"] > tokens["count"] - 3
    assert post(live, "/detokenize", {"tokens": tokens["tokens"]}).json() == {"prompt": "Hello world"}
    info = httpx.get(live.url + "/tokenizer_info").json()
    assert info["eos_token"] == "</s>" and info["eos_token_id"] == 2 and "im_start" in info["chat_template"]


def test_metrics_are_prometheus_text_with_the_model_label(live):
    post(live, "/v1/completions", {"prompt": "Hi", "max_tokens": 2})
    text = httpx.get(live.url + "/metrics").text
    for name in ("autodeploy_num_requests_running", "autodeploy_num_requests_waiting", "autodeploy_kv_cache_usage_perc",
                 "autodeploy_prefix_cache_hit_rate", "autodeploy_prompt_tokens_total",
                 "autodeploy_generation_tokens_total", "autodeploy_request_success_total",
                 "autodeploy_time_to_first_token_seconds_bucket", "autodeploy_inter_token_latency_seconds_bucket",
                 "autodeploy_e2e_request_latency_seconds_bucket", "autodeploy_request_queue_time_seconds_bucket"):
        assert f'{name}{{' in text, name
    assert 'model_name="tiny"' in text


CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
BAD_INPUTS = [
    (COMPLETIONS, {"prompt": SENTINEL, "max_tokens": "many"}, 400, "max_tokens"),
    (COMPLETIONS, {"prompt": SENTINEL, "max_tokens": 0}, 400, "max_tokens"),
    (COMPLETIONS, {"prompt": SENTINEL, "temperature": -1}, 400, "temperature"),
    (COMPLETIONS, {"prompt": SENTINEL, "n": 0}, 400, "n"),
    (COMPLETIONS, {"prompt": SENTINEL, "logprobs": 21}, 400, "logprobs"),
    (COMPLETIONS, {"prompt": SENTINEL, "top_p": 0}, 400, "top_p"),
    (COMPLETIONS, {"max_tokens": 3}, 400, "prompt"),
    (COMPLETIONS, {"prompt": []}, 400, "prompt"),
    (COMPLETIONS, {"prompt": SENTINEL, "model": "no-such-model"}, 404, "does not exist"),
    (COMPLETIONS, {"prompt": [5] * 300}, 400, "maximum context length"),
    (COMPLETIONS, {"prompt": [5] * 200, "max_tokens": 100}, 400, "maximum context length"),
    (COMPLETIONS, {"prompt": [5, 100_000]}, 400, "vocabulary"),
    (COMPLETIONS, {"prompt": SENTINEL, "stream_options": {"include_usage": True}}, 400, "stream_options"),
    (COMPLETIONS, {"prompt": SENTINEL, "logit_bias": {"5": 1.0}}, 400, "logit_bias"),
    (COMPLETIONS, {"prompt": SENTINEL, "best_of": 3}, 400, "best_of"),
    (COMPLETIONS, {"prompt": SENTINEL, "suffix": "x"}, 400, "suffix"),
    (CHAT, {"messages": []}, 400, "messages"),
    (CHAT, {"messages": [{"role": "user", "content": SENTINEL}], "top_logprobs": 2}, 400, "top_logprobs"),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": SENTINEL}}]}]},
     400, "not supported"),
    (CHAT, {"messages": [{"role": "user", "content": SENTINEL}], "model": "gpt-4"}, 404, "does not exist"),
    (CHAT, {"messages": [{"role": "user", "content": SENTINEL * 60}]}, 400, "maximum context length"),
    ("/tokenize", {"model": "tiny"}, 400, "either prompt or messages"),
    ("/detokenize", {"tokens": SENTINEL}, 400, "tokens"),
]


@pytest.mark.parametrize("path, body, status, message", BAD_INPUTS)
def test_bad_inputs_get_openai_errors(live, path, body, status, message):
    response = post(live, path, body)
    assert response.status_code == status
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == status
    assert error["type"] == {400: "BadRequestError", 404: "NotFoundError"}[status]
    assert message in error["message"] or message == error["param"]
    assert SENTINEL not in response.text


def test_malformed_json_is_a_400_not_a_422(live):
    response = httpx.post(live.url + COMPLETIONS, content=b'{"prompt": "x",', headers={"content-type": "application/json"})
    assert response.status_code == 400
    assert response.json()["error"]["type"] == "BadRequestError" and "JSON" in response.json()["error"]["message"]
    assert live.state.engine.stats().num_used_blocks == 0


def test_api_key_guards_every_v1_route(compiled, tokenizer, live):
    from fastapi.testclient import TestClient

    from autodeploy.serve.server import build_app
    from autodeploy.serve.serving_common import ServerState

    state = ServerState("tiny", api_key="s3cret")
    state.attach(live.state.engine, tokenizer, compiled.max_seq_len)  # same engine, second front door
    client = TestClient(build_app(state))
    routes = [("get", "/v1/models", None), ("post", COMPLETIONS, {"prompt": "x", "max_tokens": 1}),
              ("post", CHAT, {"messages": [{"role": "user", "content": "x"}], "max_tokens": 1})]
    for method, path, body in routes:
        for headers in ({}, {"Authorization": "Bearer wrong"}):
            response = client.request(method, path, json=body, headers=headers)
            assert response.status_code == 401
            assert response.json()["error"]["type"] == "AuthenticationError"
        assert client.request(method, path, json=body, headers={"Authorization": "Bearer s3cret"}).status_code == 200
    assert client.get("/health").status_code == 200
    live.state.engine.on_outputs = live.state.metrics.observe  # hand the engine's metrics back


def test_503_while_loading():
    from fastapi.testclient import TestClient

    from autodeploy.serve.server import build_app
    from autodeploy.serve.serving_common import ServerState

    client = TestClient(build_app(ServerState("tiny")))
    assert client.get("/health").status_code == 503
    response = client.post(COMPLETIONS, json={"prompt": "x"})
    assert response.status_code == 503 and response.json()["error"]["type"] == "ServiceUnavailableError"
    assert client.get("/metrics").status_code == 200


def test_the_app_never_exports_telemetry(monkeypatch):
    """Even with FastAPI's OpenTelemetry auto-configuration requested by the environment."""
    import inspect

    from fastapi import FastAPI

    from autodeploy.serve.server import _no_telemetry

    monkeypatch.setenv("FASTAPI_OTEL_AUTO_CONFIGURE", "true")
    options = _no_telemetry()
    if "telemetry" in inspect.signature(FastAPI.__init__).parameters:
        app = FastAPI(**options)
        config = app._telemetry
        assert not any(config[k] for k in ("tracing", "metrics", "logs", "auto_configure"))
    else:
        assert options == {}
