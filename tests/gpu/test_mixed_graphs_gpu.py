"""Whole-step CUDA graphs of prefill and mixed steps (``autodeploy.mixed_graphs``) on CUDA: each step
mix replayed from its captured graph gives the logits and KV pool of the eager graph on the same padded
step, and the logits of the eager unpadded step (graphs off); the canary passes through them; every
capture happens at compile time. A tiny Llama in fp32 (seconds)."""

import random

import pytest
import torch
from cuda_only import ON_CUDA

from autodeploy.kvcache.metadata import BatchMetadata, SequenceChunk

pytestmark = ON_CUDA
SIZES = [16, 64, 128]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    import autodeploy
    from autodeploy.cudagraph import counting_captures
    from autodeploy.tiny import make_tiny_checkpoint

    path = make_tiny_checkpoint("llama", tmp_path_factory.mktemp("mixed_graphs"))
    with counting_captures() as captures:
        compiled = autodeploy.compile(path, device="cuda", dtype="float32", attention_backend="triton",
                                      max_batch_size=8, max_seq_len=128, max_num_tokens=128, tokens_per_block=16,
                                      num_kv_blocks=64, passes={"compile_cuda_graphs": {"piecewise_sizes": SIZES, "mixed_graphs": True}})
    compiled.captures_at_compile, compiled.path = list(captures), path
    return compiled


def _mixes(vocab: int) -> dict[str, list[SequenceChunk]]:
    rng = random.Random(0)
    ids = lambda n: tuple(rng.randrange(3, vocab) for _ in range(n))  # noqa: E731
    return {
        "decodes + a prompt": [SequenceChunk(ids(1), 30, (1 + 2 * i, 2 + 2 * i)) for i in range(4)]
        + [SequenceChunk(ids(9), 8, (20, 21))],
        "prefill": [SequenceChunk(ids(40), 0, (30, 31, 32))],
        "two prompts and a decode, padded tokens and sequences": [SequenceChunk(ids(20), 0, (33, 34)),
                                                                  SequenceChunk(ids(33), 0, (35, 36, 37)),
                                                                  SequenceChunk(ids(1), 60, (38, 39, 40, 41))],
        "a chunk continuing a cached prefix, 128 tokens": [SequenceChunk(ids(100), 20, tuple(range(42, 50)))],
    }


def test_whole_step_graphs_give_the_eager_steps_logits(model):
    from autodeploy.cudagraph import counting_captures

    runner = model.mixed_graphs
    assert runner is not None and len(runner.graphs) == runner.num_captures
    assert sum(c.startswith("the whole step") for c in model.captures_at_compile) == runner.num_captures
    generator = torch.Generator(device="cuda").manual_seed(0)
    for cache in model.pool.caches:
        cache.normal_(generator=generator)
    with counting_captures() as captures:
        for name, chunks in _mixes(model.vocab_size).items():
            pad = runner.padding(chunks)
            assert pad is not None, name
            before = [c.clone() for c in model.pool.caches]
            got = model(chunks).clone()
            after = [c.clone() for c in model.pool.caches]
            for batch, exact in ((BatchMetadata.build(chunks, model.block_size, "cuda", pad=pad), True),
                                 (BatchMetadata.build(chunks, model.block_size, "cuda"), False)):
                for cache, saved in zip(model.pool.caches, before):
                    cache.copy_(saved)
                with torch.inference_mode():
                    want = model.gm(**batch.as_kwargs(), **model.pool.as_kwargs())[: len(chunks)]
                tol = 1e-5 if exact else 1e-4  # padded: the same kernels on the same shapes
                torch.testing.assert_close(got, want, atol=tol, rtol=tol, msg=f"{name} (padded: {exact})")
                assert torch.equal(got.argmax(-1), want.argmax(-1)), name
                if exact:
                    for cache, wanted in zip(model.pool.caches, after):
                        torch.testing.assert_close(cache, wanted, atol=1e-6, rtol=1e-6, msg=name)
    assert captures == []


def test_canary_through_whole_step_graphs(model):
    from autodeploy.check import run_check

    result = run_check(model.path, steps=8, prompt_lens=(3, 9, 21, 40), chunk_size=16, compiled=model)
    assert result.passed, result.summary()
