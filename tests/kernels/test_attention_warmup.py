"""The start-up warm-up of the Triton attention: every launch config an engine can meet, each once."""

import pytest
import torch

import autodeploy.kernels.attention_config as config
from autodeploy.kernels import paged_attention
from autodeploy.kernels.attention_config import AttentionLaunch
from autodeploy.kernels.attention_warmup import reachable_launches, warm_up_launches
from autodeploy.kernels.launch_keys import as_jit_function, recording_keys
from autodeploy.kvcache.metadata import BatchMetadata, SequenceChunk


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


PAGE = 16


def _chunk(tokens: int, context: int) -> SequenceChunk:
    """``tokens`` new tokens of a sequence with ``context`` tokens cached, its blocks allocated."""
    return SequenceChunk((1,) * tokens, context, tuple(range(-(-(context + tokens) // PAGE))))


def _step_mixes():
    """Steps a scheduler builds at 64 sequences under a 512-token prefill budget: decodes of 128-token
    prompts (positions 128-255) or of 1000-token ones (1000-1199), next to new 128-token prompts or the
    512-token chunks of a 1000-token prompt; decode contexts spread so block-table widths vary."""
    prefills = [[], [(128, 0)], [(128, 0)] * 3, [(128, 0)] * 4, [(128, 0)] * 2 + [(256, 0)], [(512, 0)], [(488, 512)]]
    for chunks in prefills:
        for decodes in (0, 1, 2, 3, 5, 16, 17, 44, 45, 60):
            for first_context in (130, 255 - decodes, 1000 + 3 * decodes):
                step = [_chunk(n, c) for n, c in chunks] + [_chunk(1, first_context + i) for i in range(decodes)]
                if step:
                    yield step


def test_every_launch_of_a_served_step_has_the_specialization_key_of_a_warm_up_launch(monkeypatch):
    """Triton compiles a kernel per specialization key: constexprs, options, and ints /16 or =1 and
    16-byte aligned pointers. A step's metadata are views of one int64 buffer at offsets that follow
    its token and sequence counts, so a key that depends on their alignment compiles while serving
    (Llama-3.1-8B shape on an H100 at 64 x 1264 tokens: four compiles after ready, 1-4.5 s each)."""
    monkeypatch.setattr(config, "_target_programs", lambda decode, device: int((1.5 if decode else 2) * 132))
    heads, kv_heads, head_dim, dtype = 32, 8, 128, torch.bfloat16
    cache = torch.zeros(2, 2, PAGE, kv_heads, head_dim, dtype=dtype)
    with recording_keys(paged_attention, "_paged_attention_kernel") as warmed:
        warm_up_launches(cache, heads, dtype, 0.1, None, None, None, max_batch=64, max_tokens=512 + 64,
                         max_blocks=1264 // PAGE)
    missed = set()
    with recording_keys(paged_attention, "_paged_attention_kernel") as served:
        for chunks in _step_mixes():
            meta = BatchMetadata.build(chunks, PAGE, "cpu")
            qkv = torch.zeros(meta.num_tokens, (heads + 2 * kv_heads) * head_dim, dtype=dtype)  # as the graph's
            q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=1)
            paged_attention.paged_attention_fwd(
                q.view(-1, heads, head_dim), k.view(-1, kv_heads, head_dim), v.view(-1, kv_heads, head_dim), cache,
                meta.cu_seqlens, meta.context_lens, meta.block_table, meta.slot_mapping, 0.1)
            missed |= set(served) - set(warmed)
    assert not missed, "\n".join(_closest_difference(key, set(warmed)) for key in missed)


def _closest_difference(key, warmed) -> str:
    """The arguments by which ``key`` differs from the warmed key closest to it."""
    names = as_jit_function(paged_attention._paged_attention_kernel).arg_names
    closest = min(warmed, key=lambda other: sum(a != b for a, b in zip(key[0], other[0])) + (key[1] != other[1]))
    differ = [f"{name}: {mine} (warmed {theirs})" for name, mine, theirs in zip(names, key[0], closest[0])
              if mine != theirs]
    return ", ".join(differ + ([f"options {key[1]} (warmed {closest[1]})"] if key[1] != closest[1] else []))
