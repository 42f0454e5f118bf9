"""The start-up warm-up of the Triton attention: every launch config an engine can meet, each once."""

import pytest
import torch

import autodeploy.kernels.attention_config as config
from autodeploy.kernels.attention_config import AttentionLaunch
from autodeploy.kernels.attention_warmup import reachable_launches, warm_up_launches


@pytest.mark.parametrize("heads, kv_heads, page", [(32, 8, 16), (16, 1, 32), (9, 3, 16)])
def test_reachable_launches_are_exactly_those_of_every_step_shape(monkeypatch, heads, kv_heads, page):
    monkeypatch.setattr(config, "_sm_count_of", lambda device: 132)
    max_batch, max_tokens, max_blocks, cuda = 24, 160, 20, torch.device("cuda")
    brute = {
        AttentionLaunch.choose(tokens, seqs, heads, kv_heads, 128, width * page, cuda)
        for seqs in range(1, max_batch + 1)
        for tokens in range(seqs, max_tokens + 1)
        for width in range(1, max_blocks + 1)
    }
    found = reachable_launches(heads, kv_heads, 128, page, max_batch, max_tokens, max_blocks, cuda)
    assert set(found) == brute
    for launch, (tokens, seqs, width) in found.items():  # each representative shape picks its launch
        assert AttentionLaunch.choose(tokens, seqs, heads, kv_heads, 128, width * page, cuda) == launch
        assert seqs <= tokens <= max_tokens and seqs <= max_batch and width <= max_blocks


def test_warm_up_launches_each_config_and_writes_nothing():
    cache = torch.randn(6, 2, 4, 2, 16)
    before = cache.clone()
    count = warm_up_launches(cache, 4, torch.float32, 0.25, None, None, None, max_batch=3, max_tokens=12, max_blocks=4)
    assert count == len(reachable_launches(4, 2, 16, 4, 3, 12, 4, torch.device("cpu"))) >= 2
    assert torch.equal(cache, before)


def _recorded_warm_up(monkeypatch, **layer) -> list[tuple[tuple, dict]]:
    """warm_up_launches of one layer's settings: the (args, kwargs) of each launch; the cache unchanged."""
    import autodeploy.kernels.attention_warmup as warmup

    seen, launch = [], warmup.paged_attention_fwd
    monkeypatch.setattr(warmup, "paged_attention_fwd", lambda *args, **kw: seen.append((args, kw)) or launch(*args, **kw))
    cache = torch.randn(6, 2, 4, 2, 16)
    before = cache.clone()
    count = warm_up_launches(cache, 4, torch.float32, 0.25, None, None, None, max_batch=3, max_tokens=12, max_blocks=4,
                             **layer)
    assert count == len(seen) >= 2 and torch.equal(cache, before)
    return seen


def test_warm_up_of_a_chunked_alibi_layer_launches_that_variant(monkeypatch):
    """Chunks and ALiBi are constexpr switches: such a layer warms up its own kernels (slopes given)."""
    seen = _recorded_warm_up(monkeypatch, chunk_size=8, alibi=True)
    assert all(kw["chunk_size"] == 8 and kw["alibi_slopes"].shape == (4,) for _, kw in seen)


def test_warm_up_of_a_layer_with_fused_rope_launches_the_rope_variant(monkeypatch):
    """The rotary variant is a kernel of its own: a fused layer warms up that one, with cos/sin per token."""
    for args, _ in _recorded_warm_up(monkeypatch, rope=(8, torch.float16, True)):
        q, cos, sin, interleaved = args[0], args[12], args[13], args[14]
        assert cos.shape == sin.shape == (q.shape[0], 8) and cos.dtype == torch.float16 and interleaved is True
