"""The Triton MLA kernel (absorbed up-projections, latent cache write, splits and their merge) against the
expanded torch reference op (interpreter, fp32/fp16)."""

import pytest
import torch

from autodeploy.kernels.mla_attention import MLALaunch
from paged_batches import shuffled_blocks, step_metadata

REFERENCE = torch.ops.autodeploy.paged_mla
TRITON = torch.ops.autodeploy.paged_mla_triton
# (context_len, query_len): chunked prefill, fresh prefill, decodes, an empty sequence
MIXED = [(5, 3), (0, 7), (12, 1), (0, 1), (3, 0)]
RANK, ROPE_DIM, NOPE, V = 32, 8, 16, 12


def mla_step(seqs, heads, dtype, page=4, pad_tokens=0, seed=0, rank=RANK, rope_dim=ROPE_DIM):
    """Random inputs of one paged MLA step over ``seqs`` ((context, new tokens) each) and a cache of
    random entries (stale values must never reach an output)."""
    gen = torch.Generator().manual_seed(seed)
    blocks = shuffled_blocks([c + n for c, n in seqs], page, num_blocks=64)
    meta = step_metadata([(c, n, b) for (c, n), b in zip(seqs, blocks)], page, pad_tokens)
    tokens = meta[-1].shape[0]
    rand = lambda *shape: torch.randn(*shape, generator=gen).to(dtype)  # noqa: E731
    inputs = (rand(tokens, heads, NOPE), rand(tokens, heads, rope_dim), rand(tokens, rank), rand(tokens, rope_dim),
              rand(heads * (NOPE + V), rank) * rank**-0.5)
    return inputs, rand(64, page, rank + rope_dim), meta


def _compare(seqs, heads, dtype, launch=None, pad_tokens=0, scale=0.3):
    inputs, cache, meta = mla_step(seqs, heads, dtype, pad_tokens=pad_tokens)
    want_cache, got_cache = cache.clone(), cache.clone()
    want = REFERENCE(*inputs, want_cache, *meta, scale)
    if launch is None:
        got = TRITON(*inputs, got_cache, *meta, scale)
    else:
        got = _with_launch(inputs, got_cache, meta, scale, launch)
    tol = 1e-5 if dtype == torch.float32 else 3e-3
    torch.testing.assert_close(got_cache, want_cache, atol=0, rtol=0)
    real = meta[2][-1]
    torch.testing.assert_close(got[:real].float(), want[:real].float(), atol=tol, rtol=tol)
    assert not got[real:].any(), "padding rows must be zero"


def _with_launch(inputs, cache, meta, scale, launch):
    from autodeploy.kernels.mla_attention import mla_attention_fwd
    from autodeploy.ops.mla import split_kv_b

    q_nope, q_pe, c_kv, k_pe, w_kv_b = inputs
    _, context_lens, cu, table, slots = meta
    w_uk, w_uv = split_kv_b(w_kv_b, q_nope.shape[1], NOPE)
    q_lat = torch.einsum("thd,hdr->thr", q_nope, w_uk)
    out_lat = mla_attention_fwd(q_lat, q_pe, c_kv, k_pe, cache, cu, context_lens, table, slots, scale, launch)
    return torch.einsum("thr,hvr->thv", out_lat, w_uv)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("splits", [1, 3])
def test_mixed_batch_matches_the_expanded_reference(dtype, splits):
    _compare(MIXED, 4, dtype, MLALaunch(block_h=4, block_q=4, block_n=16, num_splits=splits))


@pytest.mark.parametrize("heads, block_h", [(6, 4), (16, 16)], ids=["heads-over-two-blocks", "one-token-tiles"])
def test_head_blocks_and_one_token_tiles(heads, block_h):
    _compare([(9, 1), (0, 11), (21, 2)], heads, torch.float32, MLALaunch(block_h, max(1, 16 // block_h), 16, 2))


@pytest.mark.parametrize("splits", [1, 2])
def test_padding_tokens_get_zero_rows_and_write_nothing(splits):
    _compare([(6, 1), (2, 1), (0, 1)], 4, torch.float32, MLALaunch(4, 4, 16, splits), pad_tokens=5)


def test_launch_chosen_from_shapes():
    """The op's own choice (decode steps split under the interpreter's program target)."""
    _compare([(40, 1), (33, 1)], 4, torch.float16)
    _compare(MIXED, 4, torch.float16)
    decode = MLALaunch.choose(2, 2, 4, 256, torch.device("cpu"))
    assert decode.num_splits > 1 and decode.block_h * decode.block_q >= 16
    assert MLALaunch.choose(64, 2, 128, 4096, torch.device("cpu")).num_splits == 1
