"""generation_config.json defaults (``--generation_config auto|vllm|DIR``, ``--override_generation_config``)
with vLLM's semantics: requests that leave a parameter unset get the model's value."""

from __future__ import annotations

import json

import httpx
import pytest
from conftest import serving

from autodeploy.errors import ConfigError
from autodeploy.serve.generation_config import SamplingDefaults, load_sampling_defaults
from autodeploy.serve.protocol import ChatCompletionRequest, CompletionRequest

MESSAGES = [{"role": "user", "content": "hi"}]


def write_generation_config(directory, **values):
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2, **values}))
    return directory


def test_auto_reads_the_models_file_vllm_ignores_it_dir_reads_another(tmp_path):
    model = write_generation_config(tmp_path / "model", temperature=0.6, top_p=0.9, top_k=20, max_new_tokens=64,
                                    repetition_penalty=1.1, do_sample=True)
    other = write_generation_config(tmp_path / "other", temperature=0.2, max_new_tokens=10)
    auto = load_sampling_defaults("auto", model)
    assert dict(auto.values) == {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "repetition_penalty": 1.1}
    assert (auto.max_tokens, auto.max_tokens_cap) == (64, None)
    assert load_sampling_defaults("vllm", model) == SamplingDefaults(source="--generation_config vllm")
    from_dir = load_sampling_defaults(str(other), model)
    assert dict(from_dir.values) == {"temperature": 0.2} and (from_dir.max_tokens, from_dir.max_tokens_cap) == (10, 10)
    overridden = load_sampling_defaults("auto", model, {"temperature": 0.3, "max_new_tokens": 5})
    assert overridden.values["temperature"] == 0.3 and overridden.max_tokens_cap == 5


def test_a_file_without_sampling_parameters_gives_none(tmp_path):
    model = write_generation_config(tmp_path, do_sample=False, pad_token_id=0)  # (what most base models carry)
    assert load_sampling_defaults("auto", model) == SamplingDefaults(source=str(model / "generation_config.json"))
    assert load_sampling_defaults("auto", tmp_path / "nothing-there").values == {}


@pytest.mark.parametrize("mode, overrides, message", [
    ("auto", {"temprature": 0.5}, "unknown keys"),
    ("auto", {"temperature": -1.0}, "temperature"),
    ("{dir}/missing", None, "no generation_config.json"),
])
def test_bad_defaults_are_refused_at_start_up(tmp_path, mode, overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_sampling_defaults(mode.format(dir=tmp_path), tmp_path, overrides)


def test_a_request_overrides_a_default_only_where_it_sets_it():
    defaults = SamplingDefaults({"temperature": 0.6, "top_k": 20, "repetition_penalty": 1.2}, max_tokens=64)
    unset = defaults.fill(ChatCompletionRequest(messages=MESSAGES))
    assert (unset.temperature, unset.top_k, unset.repetition_penalty) == (0.6, 20, 1.2)
    explicit = defaults.fill(ChatCompletionRequest(messages=MESSAGES, temperature=0, top_k=None, repetition_penalty=1))
    assert (explicit.temperature, explicit.top_k, explicit.repetition_penalty) == (0, 20, 1)  # (null is unset)
    params = defaults.fill(CompletionRequest(prompt="x", temperature=0.1)).to_sampling_params(5)
    assert (params.temperature, params.top_k, params.repetition_penalty) == (0.1, 20, 1.2)
    assert defaults.max_tokens_for(None, 1000) == 64 and defaults.max_tokens_for(None, 30) == 30
    assert defaults.max_tokens_for(100, 1000) == 100  # a request's own max_tokens wins (auto)
    assert SamplingDefaults(max_tokens=64, max_tokens_cap=64).max_tokens_for(100, 1000) == 64  # DIR caps it


def test_served_requests_get_the_defaults(compiled, tokenizer):
    """A default max_tokens of 3 shows in a chat answer that asks for none; one that asks for 5 gets 5."""
    defaults = SamplingDefaults({"temperature": 0.0}, max_tokens=3)
    with serving(compiled, tokenizer, sampling_defaults=defaults) as server:
        def chat(**extra):
            body = {"model": "tiny", "messages": MESSAGES, "ignore_eos": True, **extra}
            return httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60).json()

        assert chat()["usage"]["completion_tokens"] == 3
        assert chat(max_tokens=5)["usage"]["completion_tokens"] == 5
        greedy = [chat(max_tokens=6)["choices"][0]["message"]["content"] for _ in range(2)]
        assert greedy[0] == greedy[1]  # temperature 0 from the defaults: greedy, so the same text
