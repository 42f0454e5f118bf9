"""Engine-level golden tests: batching, chunked prefill, prefix reuse and preemption never change
what a request generates."""

import pytest
import torch

from autodeploy import SamplingParams
from autodeploy.serve.engine import Engine, EngineConfig
from autodeploy.serve.outputs import OutputAccumulator

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def _prompts(vocab: int, lengths, shared_prefix: int = 24, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    prefix = torch.randint(3, vocab, (shared_prefix,), generator=gen).tolist()
    prompts = []
    for i, n in enumerate(lengths):
        own = torch.randint(3, vocab, (n,), generator=gen).tolist()
        prompts.append(prefix + own if i % 2 == 0 else own)  # every other prompt shares a prefix
    return prompts


def run_batched(engine: Engine, prompts, params) -> list:
    results = {}
    for i, prompt in enumerate(prompts):
        p = params[i] if isinstance(params, list) else params
        engine.add_request(str(i), prompt, p)
        results[str(i)] = OutputAccumulator(str(i))
    while engine.has_unfinished_requests():
        for out in engine.step():
            results[out.request_id].add(out)
    return [results[str(i)].result() for i in range(len(prompts))]


def run_one_at_a_time(engine: Engine, prompts, params) -> list:
    return [run_batched(engine, [p], params)[0] for p in prompts]


def tokens(outputs) -> list:
    return [tuple(c.token_ids for c in o.outputs) for o in outputs]


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_batched_equals_one_at_a_time(compiled, prefix_caching):
    prompts = _prompts(compiled.vocab_size, [3, 40, 7, 1, 30, 12, 5, 45, 9, 2])
    config = EngineConfig(max_batch_size=6, max_num_tokens=32, enable_prefix_caching=prefix_caching)
    batched_engine = Engine(compiled, None, config)
    batched = run_batched(batched_engine, prompts, GREEDY)
    single_engine = Engine(compiled, None, config)
    single = run_one_at_a_time(single_engine, prompts, GREEDY)
    assert tokens(batched) == tokens(single)
    assert all(len(o.outputs[0].token_ids) == 8 and o.outputs[0].finish_reason == "length" for o in batched)
    hits = single_engine.stats().prefix_cache_hits
    assert (hits > 0) == prefix_caching  # later prompts found the shared prefix
    assert batched_engine.blocks.num_used == 0 and single_engine.blocks.num_used == 0


@pytest.mark.parametrize("prefix_caching, overlap", [(True, False), (False, False), (True, True)])
def test_kv_exhaustion_preempts_and_still_matches_uncontended(compiled, prefix_caching, overlap):
    """Also with async scheduling (overlap): a preempted sequence may have a token still in flight."""
    prompts = _prompts(compiled.vocab_size, [20, 12, 25, 17, 9, 22], shared_prefix=8, seed=1)
    params = [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
              SamplingParams(temperature=0.8, top_k=50, seed=7, max_tokens=24, ignore_eos=True)] * 3
    uncontended = run_batched(Engine(compiled, None, EngineConfig(enable_prefix_caching=prefix_caching)), prompts, params)
    tight = Engine(compiled, None, EngineConfig(num_blocks=12, enable_prefix_caching=prefix_caching, overlap=overlap))
    contended = run_batched(tight, prompts, params)
    assert tight.stats().num_preemptions > 0
    assert tokens(contended) == tokens(uncontended)
    assert tight.blocks.num_used == 0


def test_abort_frees_blocks_at_once(compiled):
    engine = Engine(compiled, None, EngineConfig())
    for i in range(5):
        engine.add_request(str(i), list(range(3, 40)), SamplingParams(max_tokens=50, ignore_eos=True))
    engine.step()
    engine.step()
    assert engine.blocks.num_used > 0
    finals = [engine.abort_request(str(i)) for i in range(5)]
    assert engine.blocks.num_used == 0 and not engine.has_unfinished_requests()
    assert all(f.finished and f.outputs[0].finish_reason == "abort" for f in finals)
    assert engine.abort_request("0") is None


def test_overlap_gives_the_same_outputs_and_stop_strings(compiled, tokenizer):
    prompts = [tokenizer.encode(t) for t in ("Hello world", "The quick brown fox", "Numbers: 1 2")]
    plain = run_batched(Engine(compiled, tokenizer, EngineConfig(overlap=False)), prompts,
                        SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    texts = [o.outputs[0].text for o in plain]
    stops = [t[len(t) // 2: len(t) // 2 + 2] for t in texts]
    params = [SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, stop=(s,)) for s in stops]
    for overlap in (False, True):
        engine = Engine(compiled, tokenizer, EngineConfig(overlap=overlap))
        stopped = run_batched(engine, prompts, params)
        for out, full, stop in zip(stopped, texts, stops):
            choice = out.outputs[0]
            assert choice.finish_reason == "stop" and choice.stop_reason == stop
            assert choice.text == full[: full.index(stop)]
            assert tokenizer.decode(list(choice.token_ids)).startswith(choice.text)
        assert engine.blocks.num_used == 0


def test_seeds_are_reproducible_and_choices_differ(compiled):
    engine = Engine(compiled, None, EngineConfig())
    params = SamplingParams(n=3, temperature=1.0, seed=123, max_tokens=10, ignore_eos=True)
    first = run_batched(engine, [[5, 6, 7, 8]], params)[0]
    other_load = run_batched(engine, [[9, 9, 9], [5, 6, 7, 8], [4]], [SamplingParams(max_tokens=3), params,
                                                                        SamplingParams(seed=1)])[1]
    assert tokens([first]) == tokens([other_load])
    assert len({c.token_ids for c in first.outputs}) > 1
    assert [c.index for c in first.outputs] == [0, 1, 2]


def test_prompt_and_sampled_logprobs_match_hf_eager(compiled, tiny_dir):
    from transformers import AutoModelForCausalLM

    prompt = list(range(3, 43))  # 40 tokens, prefilled in 3 chunks of at most 16
    engine = Engine(compiled, None, EngineConfig(max_num_tokens=16))
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, logprobs=2, prompt_logprobs=1)
    out = run_batched(engine, [prompt], params)[0]
    generated = list(out.outputs[0].token_ids)
    hf = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32, attn_implementation="eager").eval()
    with torch.inference_mode():
        ref = torch.log_softmax(hf(torch.tensor([prompt + generated])).logits[0].float(), -1)
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
    for pos in range(1, len(prompt)):
        entry = out.prompt_logprobs[pos]
        assert entry.token_id == prompt[pos]
        assert entry.logprob == pytest.approx(ref[pos - 1, prompt[pos]].item(), abs=1e-4)
        assert entry.top[0][0] == ref[pos - 1].argmax().item()
    for i, entry in enumerate(out.outputs[0].logprobs):
        row = ref[len(prompt) - 1 + i]
        assert entry.token_id == generated[i] == row.argmax().item()
        assert entry.logprob == pytest.approx(row.max().item(), abs=1e-4)
        assert [t for t, _ in entry.top] == row.topk(2).indices.tolist()


def test_stop_token_ids_and_min_tokens(compiled):
    engine = Engine(compiled, None, EngineConfig())
    free = run_batched(engine, [[5, 6, 7]], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0]
    ids = list(free.outputs[0].token_ids)
    stop_id = ids[3]
    first_at = ids.index(stop_id)
    out = run_batched(engine, [[5, 6, 7]], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True,
                                                          stop_token_ids=(stop_id,)))[0].outputs[0]
    assert out.token_ids == tuple(ids[: first_at + 1]) and out.stop_reason == stop_id and out.finish_reason == "stop"
    late = run_batched(engine, [[5, 6, 7]], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, min_tokens=first_at + 2,
                                                           stop_token_ids=(stop_id,)))[0].outputs[0]
    assert len(late.token_ids) >= first_at + 2


@pytest.mark.parametrize(
    "prompt, params, message",
    [
        ([], SamplingParams(), "empty"),
        ([1] * 250, SamplingParams(max_tokens=10), "maximum context length"),
        ([10_000], SamplingParams(), "out of vocabulary"),
        ([1, 2], SamplingParams(stop=("x",)), "stop strings need"),
    ],
)
def test_requests_that_cannot_be_served_are_rejected(compiled, prompt, params, message):
    engine = Engine(compiled, None, EngineConfig())
    with pytest.raises(ValueError, match=message):
        engine.add_request("r", prompt, params)
    assert not engine.has_unfinished_requests()


def test_prompt_logprobs_of_a_one_token_prompt(compiled):
    engine = Engine(compiled, None, EngineConfig())
    out = run_batched(engine, [[5]], SamplingParams(max_tokens=1, prompt_logprobs=0))[0]
    assert out.prompt_logprobs == (None,)


@pytest.fixture(scope="module")
def fp8_kv_compiled(tiny_dir):
    import autodeploy
    from conftest import COMPILE_OPTIONS

    return autodeploy.compile(tiny_dir, **COMPILE_OPTIONS, kv_cache_dtype="fp8")


def test_fp8_kv_cache_keeps_prefix_reuse_batching_and_preemption_exact(fp8_kv_compiled):
    """An FP8 cache stores what it stores whoever wrote it: reused prefixes, batching and recomputation
    after preemption give the same tokens as without them."""
    assert fp8_kv_compiled.pool.caches[0].dtype == torch.float8_e4m3fn
    test_batched_equals_one_at_a_time(fp8_kv_compiled, prefix_caching=True)
    test_kv_exhaustion_preempts_and_still_matches_uncontended(fp8_kv_compiled, prefix_caching=True, overlap=False)
