"""A request that breaks its engine step fails alone; the engine serves the others with the same
outputs as without it. Only a device fault stops the engine, and /health then says why."""

import threading

import httpx
import pytest
import torch

from autodeploy.sampling_params import SamplingParams
from autodeploy.serve.detokenizer import IncrementalDetokenizer
from autodeploy.serve.engine import Engine, EngineConfig
from autodeploy.serve.runner import ModelRunner
from autodeploy.serve.sampler import Sampler
from conftest import ENGINE_MODES, serving, settled_stats

POISON_SEED = 13  # the sampler below fails for a request with this seed
POISON_STOP = "zz-poison"  # the detokenizer below fails for a request with this stop string


def _poison_sampler(monkeypatch) -> None:
    """Every sampler (so an engine forked into its own process has it too)."""
    sample = Sampler.sample

    def poisoned(self, logits, seqs, *rest):
        if any(s.params.seed == POISON_SEED for s in seqs):
            raise OverflowError("Overflow when unpacking long long")
        return sample(self, logits, seqs, *rest)

    monkeypatch.setattr(Sampler, "sample", poisoned)


def _poison_detokenizer(monkeypatch) -> None:
    add_token = IncrementalDetokenizer.add_token

    def poisoned(self, token_id, check_stop=True):
        if POISON_STOP in self.stop:
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "invalid start byte")
        return add_token(self, token_id, check_stop)

    monkeypatch.setattr(IncrementalDetokenizer, "add_token", poisoned)


def _run_all(engine: Engine) -> dict:
    finals = {}
    while engine.has_unfinished_requests() or engine.has_step_in_flight:
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
    return finals


GOOD = [([5 + i, 6, 7 + i], SamplingParams(max_tokens=6 + i, temperature=0, ignore_eos=True)) for i in range(6)]


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("poison", ["sampler", "detokenizer"])
def test_a_failing_request_fails_alone_and_the_others_are_unchanged(compiled, tokenizer, monkeypatch, overlap, poison):
    clean = Engine(compiled, tokenizer, EngineConfig(overlap=overlap))
    for i, (prompt, params) in enumerate(GOOD):
        clean.add_request(f"good-{i}", prompt, params)
    expected = {rid: out.outputs[0].token_ids for rid, out in _run_all(clean).items()}

    engine = Engine(compiled, tokenizer, EngineConfig(overlap=overlap))
    if poison == "sampler":
        _poison_sampler(monkeypatch)
        bad = SamplingParams(max_tokens=8, seed=POISON_SEED, n=2)
    else:
        _poison_detokenizer(monkeypatch)
        bad = SamplingParams(max_tokens=8, stop=(POISON_STOP,), n=2)
    engine.add_request("bad", [9, 10, 11], bad)
    for i, (prompt, params) in enumerate(GOOD):
        engine.add_request(f"good-{i}", prompt, params)
    finals = _run_all(engine)
    assert finals.pop("bad").error.startswith(("OverflowError", "UnicodeDecodeError"))
    assert {rid: out.outputs[0].token_ids for rid, out in finals.items()} == expected
    assert all(out.error is None for out in finals.values())
    assert engine.stats().num_used_blocks == 0 and not engine.has_unfinished_requests()


@pytest.mark.parametrize("mode, poison", [("in_process", "sampler"), ("engine_process", "sampler"),
                                         ("engine_process", "detokenizer")])
def test_over_http_the_failing_request_gets_a_500_or_an_error_event_and_the_server_goes_on(compiled, tokenizer,
                                                                                          monkeypatch, mode, poison):
    """In its own process the engine samples (a failure there) and this one detokenizes (one here)."""
    good = {"prompt": [5, 6, 7], "max_tokens": 8, "ignore_eos": True, "temperature": 0}
    bad_fields = {"seed": POISON_SEED} if poison == "sampler" else {"stop": [POISON_STOP]}
    _poison_sampler(monkeypatch) if poison == "sampler" else _poison_detokenizer(monkeypatch)
    with serving(compiled, tokenizer, engine_process=mode == "engine_process") as server:
        expected = httpx.post(server.url + "/v1/completions", json=good, timeout=60).json()["choices"][0]["text"]
        results = []
        threads = [threading.Thread(target=lambda: results.append(
            httpx.post(server.url + "/v1/completions", json=good, timeout=60).json())) for _ in range(4)]
        for t in threads:
            t.start()
        bad = httpx.post(server.url + "/v1/completions", json={**good, **bad_fields}, timeout=60)
        with httpx.stream("POST", server.url + "/v1/completions", json={**good, **bad_fields, "stream": True},
                          timeout=60) as response:
            lines = [line for line in response.iter_lines() if line]
        for t in threads:
            t.join()
        assert bad.status_code == 500 and "failed in the engine" in bad.json()["error"]["message"]
        assert ("OverflowError" if poison == "sampler" else "UnicodeDecodeError") in bad.json()["error"]["message"]
        error_event = httpx.Response(200, content=lines[-2][len("data: "):]).json()
        assert lines[-1] == "data: [DONE]" and error_event["error"]["code"] == 500
        assert [r["choices"][0]["text"] for r in results] == [expected] * 4
        assert httpx.get(server.url + "/health").json() == {"status": "ok"}
        metrics = httpx.get(server.url + "/metrics").text
        assert 'autodeploy_request_failure_total{model_name="tiny",status="500"} 2.0' in metrics
        assert settled_stats(server.state.engine).num_used_blocks == 0


_runner_init = ModelRunner.__init__


def _runner_on_a_faulty_device(self, model, sampler):
    _runner_init(self, _FaultyDevice(model), sampler)


class _FaultyDevice:
    """The compiled model, whose next forward hits a CUDA error."""

    def __init__(self, model):
        self._model = model

    def __getattr__(self, name):
        return getattr(self._model, name)

    def __call__(self, *args, **kwargs):
        raise torch.AcceleratorError("CUDA error: an illegal memory access was encountered")


@pytest.mark.parametrize("mode", ENGINE_MODES)
def test_a_device_fault_stops_the_engine_and_health_says_why(compiled, tokenizer, monkeypatch, mode):
    monkeypatch.setattr(ModelRunner, "__init__", _runner_on_a_faulty_device)
    with serving(compiled, tokenizer, engine_process=mode == "engine_process") as server:
        response = httpx.post(server.url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=60)
        assert response.status_code == 503 and "illegal memory access" in response.json()["error"]["message"]
        health = httpx.get(server.url + "/health")
        assert health.status_code == 503
        assert "the engine has stopped" in health.json()["error"]["message"]
        assert "illegal memory access" in health.json()["error"]["message"]
