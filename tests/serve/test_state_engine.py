"""The engine on models with recurrent state (tiny hybrids: nemotron_h's Mamba-2 layer, qwen3_next's Gated
DeltaNet layer): state slots are handed out with the KV blocks and come back on finish, abort and
preemption; batching, chunked prefill, waiting for a slot, preemption and async scheduling never change
what a request generates; prefix caching is off for such a model whatever the engine asks."""

import pytest
import torch
from test_engine import run_batched, run_one_at_a_time, tokens

from autodeploy import SamplingParams
from autodeploy.serve.engine import Engine, EngineConfig
from autodeploy.serve.outputs import OutputAccumulator

SLOTS = 3  # the compiled model's max_batch_size: one state slot per sequence it can run


@pytest.fixture(scope="module", params=["nemotron_h", "qwen3_next"])
def hybrid(request, tmp_path_factory):
    import autodeploy
    from autodeploy.tiny import make_tiny_checkpoint

    path = make_tiny_checkpoint(request.param, tmp_path_factory.mktemp(request.param))
    return autodeploy.compile(path, device="cpu", dtype="float32", max_batch_size=SLOTS, max_num_tokens=32,
                              max_seq_len=96, num_kv_blocks=64, tokens_per_block=8)


def _prompts(vocab: int, lengths, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in lengths]


def _all_returned(engine: Engine) -> bool:
    return engine.blocks.num_used == 0 and engine.blocks.num_free_state_slots == SLOTS


def test_more_requests_than_slots_wait_and_match_one_at_a_time(hybrid):
    prompts = _prompts(hybrid.vocab_size, [3, 40, 7, 1, 30, 12])
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    engine = Engine(hybrid, None, EngineConfig(max_batch_size=6, max_num_tokens=16))
    assert hybrid.num_state_slots == SLOTS and not engine.blocks.enable_prefix_caching
    batched = run_batched(engine, prompts, params)
    single = run_one_at_a_time(Engine(hybrid, None, EngineConfig()), prompts, params)
    assert tokens(batched) == tokens(single)
    assert _all_returned(engine)


@pytest.mark.parametrize("overlap", [False, True])
def test_preemption_rebuilds_state_and_matches_uncontended(hybrid, overlap):
    prompts = _prompts(hybrid.vocab_size, [20, 12, 25], seed=1)
    params = [SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),
              SamplingParams(temperature=0.8, top_k=50, seed=7, max_tokens=20, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)]
    uncontended = run_batched(Engine(hybrid, None, EngineConfig()), prompts, params)
    tight = Engine(hybrid, None, EngineConfig(num_blocks=8, overlap=overlap))
    contended = run_batched(tight, prompts, params)
    assert tight.stats().num_preemptions > 0
    assert tokens(contended) == tokens(uncontended)
    assert _all_returned(tight)


def test_abort_returns_blocks_and_state_slots(hybrid):
    engine = Engine(hybrid, None, EngineConfig())
    for i in range(4):
        engine.add_request(str(i), list(range(3, 30)), SamplingParams(max_tokens=40, ignore_eos=True))
    engine.step()
    engine.step()
    assert engine.blocks.num_free_state_slots == 0  # three running, the fourth waits for a slot
    for i in range(4):
        engine.abort_request(str(i))
    assert _all_returned(engine) and not engine.has_unfinished_requests()


def test_start_up_report_gives_kv_and_state_capacity_apart(hybrid):
    from autodeploy.serve.startup import ServeSettings, startup_report

    engine = Engine(hybrid, None, EngineConfig(enable_prefix_caching=True))
    lines = startup_report(hybrid, engine, ServeSettings(served_model_name="tiny"), "http://x", 1.0, None).splitlines()
    assert any(line.startswith("KV cache     64 blocks x 8 tokens") for line in lines)
    (state,) = [line for line in lines if line.startswith("state cache")]
    assert state.startswith(f"state cache  {SLOTS} sequences x ") and "prefix caching off" in state
    assert any("prefix caching off (the model has recurrent state)" in line for line in lines)


def test_a_step_that_fails_after_the_forward_reruns_the_others_from_their_first_token(hybrid, monkeypatch):
    """The sampler fails for one request after the forward advanced every sequence's state: the
    others are run again from their first token (from zero state), not advanced twice."""
    prompts = _prompts(hybrid.vocab_size, [9, 14, 5], seed=2)
    params = [SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, seed=seed) for seed in (1, 13, 2)]
    clean = run_batched(Engine(hybrid, None, EngineConfig()), prompts, params)
    engine = Engine(hybrid, None, EngineConfig(overlap=False))
    sample = engine.runner.sampler.sample

    def poisoned(logits, seqs, *rest):
        if any(s.params.seed == 13 and s.num_output_tokens >= 2 for s in seqs):
            raise OverflowError("poisoned")
        return sample(logits, seqs, *rest)

    monkeypatch.setattr(engine.runner.sampler, "sample", poisoned)
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, params[i])
    results, errors = {str(i): OutputAccumulator(str(i)) for i in range(3)}, {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            results[out.request_id].add(out)
            errors[out.request_id] = out.error
    assert errors["1"].startswith("OverflowError") and errors["0"] is None and errors["2"] is None
    assert [results[i].result().outputs[0].token_ids for i in "02"] == [clean[i].outputs[0].token_ids for i in (0, 2)]
    assert _all_returned(engine)


def test_an_fp8_kv_cache_leaves_the_state_pool_in_the_states_own_dtypes(hybrid):
    """``kv_cache_dtype=fp8`` quantizes the attention layers' KV pool only: the convolution window keeps
    the model's dtype and the SSM state fp32, and the engine runs the model as with the bf16/fp32 pool."""
    import autodeploy

    if hybrid.hf_config.model_type != "nemotron_h":
        pytest.skip("the state pool's dtypes do not depend on the layer kind: one hybrid compiled twice is enough")

    fp8 = autodeploy.compile(hybrid.model_dir, device="cpu", dtype="float32", max_batch_size=SLOTS, max_num_tokens=32,
                             max_seq_len=96, num_kv_blocks=64, tokens_per_block=8, kv_cache_dtype="fp8")
    assert {c.dtype for c in fp8.pool.caches} == {torch.float8_e4m3fn}
    assert [s.dtype for s in fp8.pool.state.states] == [s.dtype for s in hybrid.pool.state.states]
    assert {s.dtype for s in fp8.pool.state.states} == {torch.float32}
    prompts = _prompts(fp8.vocab_size, [9, 20], seed=3)
    engine = Engine(fp8, None, EngineConfig())
    outputs = run_batched(engine, prompts, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    assert [len(c) for (c,) in tokens(outputs)] == [6, 6] and _all_returned(engine)
