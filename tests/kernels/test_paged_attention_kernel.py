"""The Triton paged-attention kernels against the reference op (interpreter, fp32/fp16)."""

import pytest
import torch

from autodeploy.kernels.attention_config import AttentionLaunch
from autodeploy.kernels.paged_attention import paged_attention_fwd
from paged_batches import random_cache, shuffled_blocks, step_metadata

REFERENCE = torch.ops.autodeploy.paged_attention
# (context_len, query_len): chunked prefill, fresh prefill, decodes, an empty sequence
MIXED = [(5, 3), (0, 7), (12, 1), (0, 1), (3, 0)]


def _compare(seqs, heads, kv_heads, head_dim, dtype, launch, page=4, window=None, softcap=None, sinks=False,
             pad_tokens=0):
    blocks = shuffled_blocks([c + n for c, n in seqs], page, num_blocks=64)
    query_lens, context_lens, cu, table, slots = step_metadata(
        [(c, n, b) for (c, n), b in zip(seqs, blocks)], page, pad_tokens)
    tokens = slots.shape[0]
    q, k, v = (torch.randn(tokens, h, head_dim).to(dtype) for h in (heads, kv_heads, kv_heads))
    sink_logits = torch.randn(heads) if sinks else None
    cache = random_cache(64, page, kv_heads, head_dim, dtype)
    want_cache, got_cache = cache.clone(), cache.clone()
    want = REFERENCE(q, k, v, want_cache, query_lens, context_lens, cu, table, slots, 0.3, window, softcap, sink_logits)
    got = paged_attention_fwd(q, k, v, got_cache, cu, context_lens, table, slots, 0.3, window, softcap, sink_logits,
                              launch=launch)
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(got_cache, want_cache, atol=0, rtol=0)
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)
    return got


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 2), (4, 1), (6, 2)], ids=["mha", "gqa", "mqa", "gqa3"])
@pytest.mark.parametrize("splits", [1, 3])
def test_mixed_batch_matches_reference(dtype, heads, kv_heads, splits):
    _compare(MIXED, heads, kv_heads, 16, dtype, AttentionLaunch(16, 16, splits))


@pytest.mark.parametrize("head_dim", [32, 64, 128, 80])
def test_head_dims(head_dim):
    _compare([(6, 2), (0, 5)], 4, 2, head_dim, torch.float16, AttentionLaunch(16, 16, 2))


@pytest.mark.parametrize("splits", [1, 2])
def test_sliding_window_softcap_and_sinks(splits):
    _compare(MIXED, 4, 2, 16, torch.float32, AttentionLaunch(16, 16, splits), window=3)
    _compare(MIXED, 4, 2, 16, torch.float32, AttentionLaunch(16, 16, splits), softcap=2.5)
    _compare(MIXED, 4, 2, 16, torch.float32, AttentionLaunch(32, 8, splits), window=5, softcap=4.0, sinks=True)


@pytest.mark.parametrize("splits", [1, 3])
def test_long_contexts_mix_unmasked_and_diagonal_blocks(splits):
    _compare([(150, 3), (40, 30), (0, 45)], 4, 2, 16, torch.float16, AttentionLaunch(32, 16, splits), page=8)


def test_padding_rows_are_zero_and_write_nowhere():
    out = _compare([(2, 3), (4, 0), (0, 2)], 4, 2, 16, torch.float32, AttentionLaunch(16, 16, 2), pad_tokens=3)
    assert out[-3:].abs().max() == 0


def test_tiles_larger_than_pages_and_pages_larger_than_tiles():
    _compare(MIXED, 4, 2, 16, torch.float32, AttentionLaunch(64, 32, 1), page=2)
    _compare(MIXED, 4, 2, 16, torch.float32, AttentionLaunch(16, 8, 1), page=16)


def test_default_launch_choice():
    cpu = torch.device("cpu")  # the interpreter pretends to be one SM wanting 12 programs
    decode = AttentionLaunch.choose(64, 64, 32, 8, 128, 4096, cpu)
    prefill = AttentionLaunch.choose(4096, 4, 32, 8, 128, 1024, cpu)
    assert (decode.block_m, decode.block_q(4), decode.num_splits) == (16, 4, 1) and prefill.block_m == 128
    assert AttentionLaunch.choose(1, 1, 32, 8, 128, 4096, cpu).num_splits == 2  # 8 tiles -> 2 splits
    assert AttentionLaunch.choose(1, 1, 4, 1, 128, 4096, cpu).num_splits == 12
    assert AttentionLaunch.choose(1, 1, 4, 1, 128, 256, cpu).num_splits == 2  # >= 128 keys per split
    assert AttentionLaunch.choose(64, 1, 4, 1, 128, 8192, cpu).num_splits == 1  # prefill: 2 programs per SM
