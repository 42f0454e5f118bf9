"""Async scheduling (``EngineConfig(overlap=True)``): step n + 1 is launched before step n's tokens
reach the host, and nothing a request sees may change because of it (preemption with overlap:
``test_engine.py``)."""

import pytest
import torch

from autodeploy import SamplingParams
from autodeploy.kvcache.metadata import PLACEHOLDER_TOKEN, DeferredTokens, SequenceChunk
from autodeploy.serve import runner as runner_module
from autodeploy.serve.engine import Engine, EngineConfig

from test_engine import _prompts, run_batched


def _mixed_params(vocab: int) -> list[SamplingParams]:
    many_stops = tuple(range(3, vocab, 3))  # a third of the vocabulary stops: sequences end early
    return [
        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
        SamplingParams(temperature=0.9, top_p=0.9, seed=11, max_tokens=10, ignore_eos=True),
        SamplingParams(n=2, temperature=1.0, seed=5, max_tokens=7, ignore_eos=True, logprobs=2),
        SamplingParams(temperature=0, max_tokens=9, stop_token_ids=many_stops, min_tokens=2),
        SamplingParams(temperature=0, max_tokens=6, prompt_logprobs=1, logprobs=0),
        SamplingParams(temperature=0.7, seed=3, max_tokens=8, presence_penalty=0.5, repetition_penalty=1.3),
        SamplingParams(temperature=0, max_tokens=1),
        SamplingParams(temperature=0, max_tokens=11, stop_token_ids=many_stops),
    ]


def _everything(outputs) -> list:
    """What a client sees; log-probabilities to 5 decimals (other batch shapes round differently)."""
    return [(_rounded(o.prompt_logprobs),
             [(c.token_ids, c.text, c.finish_reason, c.stop_reason, _rounded(c.logprobs)) for c in o.outputs])
            for o in outputs]


def _rounded(logprobs):
    if logprobs is None:
        return None
    return [None if e is None else (e.token_id, round(e.logprob, 5), tuple(t for t, _ in e.top)) for e in logprobs]


@pytest.mark.parametrize("max_batch_size, max_num_tokens", [(4, 32), (64, 256)])
def test_overlap_gives_identical_outputs(compiled, tokenizer, max_batch_size, max_num_tokens):
    prompts = _prompts(compiled.vocab_size, [3, 40, 7, 1, 30, 12, 5, 45], shared_prefix=16, seed=2)
    params = _mixed_params(compiled.vocab_size)
    results = {}
    for overlap in (False, True):
        config = EngineConfig(max_batch_size=max_batch_size, max_num_tokens=max_num_tokens, overlap=overlap)
        engine = Engine(compiled, tokenizer, config)
        results[overlap] = run_batched(engine, prompts, params)
        assert engine.blocks.num_used == 0 and not engine.has_unfinished_requests()
    assert _everything(results[True]) == _everything(results[False])
    reasons = {c.finish_reason for o in results[True] for c in o.outputs}
    assert reasons == {"stop", "length"}  # both ways of ending were exercised


def test_each_step_is_launched_before_the_previous_one_is_waited_for(compiled, monkeypatch):
    events = []
    launch, wait = runner_module.ModelRunner.launch, runner_module.PendingStep.wait

    def logged_launch(self, schedule, previous=None):
        events.append(("launch", previous is not None))
        return launch(self, schedule, previous)

    def logged_wait(self):
        events.append(("wait", None))
        return wait(self)

    monkeypatch.setattr(runner_module.ModelRunner, "launch", logged_launch)
    monkeypatch.setattr(runner_module.PendingStep, "wait", logged_wait)
    engine = Engine(compiled, None, EngineConfig(overlap=True))
    run_batched(engine, [[5, 6, 7], [8, 9]], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    # the first launch has nothing in flight; every later one is queued behind the step in flight
    assert events[0] == ("launch", False)
    assert events[1:7] == [("launch", True), ("wait", None)] * 3
    assert sum(1 for e in events if e[0] == "launch") == 6  # one prefill + five decodes: no extra step


def test_abort_with_a_step_in_flight(compiled):
    engine = Engine(compiled, None, EngineConfig(overlap=True))
    for i in range(4):
        engine.add_request(str(i), list(range(3, 30 + i)), SamplingParams(max_tokens=40, ignore_eos=True))
    for _ in range(3):
        engine.step()
    in_flight = [s for seqs in engine._requests.values() for s in seqs if s.num_pending_tokens]
    assert in_flight  # the tokens of the last launched step are still placeholders
    finals = [engine.abort_request(str(i)) for i in range(4)]
    assert engine.blocks.num_used == 0 and not engine.has_unfinished_requests()
    assert all(f.finished and f.outputs[0].finish_reason == "abort" for f in finals)
    assert all(PLACEHOLDER_TOKEN not in s.token_ids for s in in_flight)
    after = run_batched(engine, [[5, 6, 7]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))[0]
    fresh = run_batched(Engine(compiled, None, EngineConfig(overlap=False)), [[5, 6, 7]],
                        SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))[0]
    assert after.outputs[0].token_ids == fresh.outputs[0].token_ids


@pytest.mark.parametrize("order", ["same", "shuffled"])
def test_deferred_tokens_fill_placeholders_on_the_device(compiled, order):
    """A step whose inputs are placeholders + DeferredTokens equals the step with the real ids."""
    real = [17, 42, 99, 5]
    blocks = [(10 + i,) for i in range(4)]
    ctx = [3, 0, 5, 2]
    base = [SequenceChunk(tuple(range(20, 20 + c)), 0, b) for c, b in zip(ctx, blocks) if c]
    compiled([c for c in base])  # fill each sequence's cache with its context
    chunks = [SequenceChunk((t,), c, b) for t, c, b in zip(real, ctx, blocks)]
    rows = [0, 1, 2, 3] if order == "same" else [2, 0, 3, 1]
    values = torch.zeros(4, dtype=torch.int64)
    values[torch.tensor(rows)] = torch.tensor(real)
    held = [SequenceChunk((PLACEHOLDER_TOKEN,), c, b) for c, b in zip(ctx, blocks)]
    deferred = DeferredTokens(values, (0, 1, 2, 3), tuple(rows))
    got = compiled(held, deferred).clone()
    want = compiled(chunks)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
