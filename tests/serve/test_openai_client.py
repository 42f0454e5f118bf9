"""The real ``openai`` client, unchanged, against a live server on loopback."""

import openai
import pytest

from conftest import ENGINE_MODES

LIVE_MODES = ENGINE_MODES  # the representative subset that runs against both engines


@pytest.fixture(scope="module")
def client(live):
    return openai.OpenAI(base_url=live.url + "/v1", api_key="not-needed", max_retries=0, timeout=60)


def test_completions_and_chat(client):
    completion = client.completions.create(model="tiny", prompt="Hello world", max_tokens=5, temperature=0,
                                           extra_body={"ignore_eos": True})
    assert completion.choices[0].finish_reason == "length" and completion.usage.completion_tokens == 5
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                          extra_body={"ignore_eos": True, "top_k": 20, "min_p": 0.01})
    assert chat.choices[0].message.role == "assistant" and chat.usage.completion_tokens == 4
    assert [m.id for m in client.models.list().data] == ["tiny"]


def test_streaming_equals_not_streaming(client):
    args = dict(model="tiny", max_tokens=6, temperature=0, extra_body={"ignore_eos": True})
    whole = client.completions.create(prompt="The quick", **args).choices[0].text
    streamed = "".join(c.choices[0].text for c in client.completions.create(prompt="The quick", stream=True, **args))
    assert streamed == whole
    messages = [{"role": "user", "content": "hello"}]
    whole = client.chat.completions.create(messages=messages, **args).choices[0].message.content
    chunks = list(client.chat.completions.create(messages=messages, stream=True,
                                                 stream_options={"include_usage": True}, **args))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 6


def test_logprobs(client):
    completion = client.completions.create(model="tiny", prompt="Hi", max_tokens=3, logprobs=2, temperature=0)
    logprobs = completion.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(logprobs.top_logprobs) == 3
    assert all(lp == max(top.values()) for lp, top in zip(logprobs.token_logprobs, logprobs.top_logprobs))
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=3,
                                          logprobs=True, top_logprobs=2, temperature=0)
    content = chat.choices[0].logprobs.content
    assert len(content) == 3 and all(len(t.top_logprobs) == 2 for t in content)
    assert content[0].logprob == content[0].top_logprobs[0].logprob


def test_n_choices(client):
    completion = client.completions.create(model="tiny", prompt="Hi", max_tokens=3, n=3, seed=1,
                                           extra_body={"ignore_eos": True})
    assert sorted(c.index for c in completion.choices) == [0, 1, 2]
    assert completion.usage.completion_tokens == 9


def test_stop_strings(client):
    args = dict(model="tiny", prompt="Hello world", max_tokens=16, temperature=0, extra_body={"ignore_eos": True})
    full = client.completions.create(**args).choices[0].text
    stop = full[len(full) // 2: len(full) // 2 + 2]
    choice = client.completions.create(stop=[stop], **args).choices[0]
    assert choice.text == full[: full.index(stop)] and choice.finish_reason == "stop"
    streamed = "".join(c.choices[0].text for c in client.completions.create(stop=[stop], stream=True, **args))
    assert streamed == choice.text


def test_seeds_are_reproducible(client):
    def sample(seed):
        return client.completions.create(model="tiny", prompt="Hello", max_tokens=8, temperature=1.0, seed=seed,
                                         extra_body={"ignore_eos": True}).choices[0].text

    assert sample(7) == sample(7)
    assert len({sample(7), sample(8), sample(9)}) > 1


def test_errors_raise_the_matching_client_exceptions(client):
    with pytest.raises(openai.BadRequestError, match="maximum context length"):
        client.completions.create(model="tiny", prompt=[5] * 300, max_tokens=1)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-4", prompt="x", max_tokens=1)
