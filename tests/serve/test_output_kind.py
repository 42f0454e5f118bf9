"""``RequestOutputKind.FINAL_ONLY``: one report per request, when it finishes, with exactly what the
per-step deltas of the same request add up to (tokens, text, stop strings, several choices, aborts)."""

import gc
from dataclasses import replace

import pytest

from autodeploy import RequestOutputKind, SamplingParams
from autodeploy.serve.engine import Engine, EngineConfig
from autodeploy.serve.outputs import OutputAccumulator

FINAL = RequestOutputKind.FINAL_ONLY


def run(engine: Engine, prompts, params) -> tuple[list, dict[str, int]]:
    """Accumulated results in prompt order, and how many reports each request got."""
    results, reports = {}, {}
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, params[i] if isinstance(params, list) else params)
        results[str(i)], reports[str(i)] = OutputAccumulator(str(i)), 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            results[out.request_id].add(out)
            reports[out.request_id] += 1
    return [results[str(i)].result() for i in range(len(prompts))], reports


def choices(results) -> list:
    return [[(c.token_ids, c.text, c.finish_reason, c.stop_reason) for c in r.outputs] for r in results]


@pytest.mark.parametrize("overlap", [False, True])
def test_final_only_is_one_report_equal_to_the_deltas(compiled, tokenizer, overlap):
    prompts = [tokenizer.encode(t) for t in ("Hello world", "The quick brown fox", "Numbers: 1 2", "def add")]
    params = [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
              SamplingParams(temperature=0.9, seed=3, n=3, max_tokens=9 + 2, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, logprobs=2),
              SamplingParams(temperature=0, max_tokens=16, stop_token_ids=(7, 9, 11, 13), min_tokens=2)]
    deltas, delta_reports = run(Engine(compiled, tokenizer, EngineConfig(overlap=overlap)), prompts, params)
    final_params = [replace(p, output_kind=FINAL) for p in params]
    finals, final_reports = run(Engine(compiled, tokenizer, EngineConfig(overlap=overlap)), prompts, final_params)
    assert choices(finals) == choices(deltas)
    assert [r.outputs[0].logprobs for r in finals] == [r.outputs[0].logprobs for r in deltas]
    assert set(final_reports.values()) == {1} and max(delta_reports.values()) > 1
    assert all(r.finished and r.metrics.finished_time is not None for r in finals)


def test_final_only_still_stops_at_stop_strings(compiled, tokenizer):
    prompt = tokenizer.encode("The quick brown fox")
    (full,), _ = run(Engine(compiled, tokenizer), [prompt], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    text = full.outputs[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, stop=(stop,), output_kind="final_only")
    (stopped,), reports = run(Engine(compiled, tokenizer), [prompt], params)
    choice = stopped.outputs[0]
    assert reports == {"0": 1}
    assert choice.finish_reason == "stop" and choice.stop_reason == stop and choice.text == text[: text.index(stop)]
    assert len(choice.token_ids) < 16  # stopped early, not detokenized only at the length limit


def test_abort_of_a_final_only_request_reports_what_it_generated(compiled):
    engine = Engine(compiled, None, EngineConfig())
    engine.add_request("a", list(range(3, 20)), SamplingParams(max_tokens=50, ignore_eos=True, output_kind=FINAL))
    reports = [out for _ in range(4) for out in engine.step()]
    assert reports == []
    final = engine.abort_request("a")
    assert final.finished and final.outputs[0].finish_reason == "abort" and len(final.outputs[0].token_ids) >= 3


def test_output_kind_is_validated():
    assert SamplingParams(output_kind="final_only").output_kind is FINAL
    with pytest.raises(ValueError, match="RequestOutputKind"):
        SamplingParams(output_kind="cumulative")


def test_engine_freezes_long_lived_objects_only_when_asked(compiled):
    gc.unfreeze()
    try:
        Engine(compiled, None, EngineConfig())  # the CPU default: off
        assert gc.get_freeze_count() == 0
        Engine(compiled, None, EngineConfig(freeze_gc=True))
        assert gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()
