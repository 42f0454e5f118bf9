"""RoPE fused into the Triton paged-attention kernel (interpreter, fp32/fp16): q and the new keys rotated
in the kernel equal attention over q/k rotated first, and the cache holds the rotated keys bit for bit."""

import pytest
import torch

from autodeploy.kernels.attention_config import AttentionLaunch
from autodeploy.kernels.paged_attention import paged_attention_fwd
from autodeploy.ops.rope import rope_reference
from paged_batches import cache_bits, random_cache, shuffled_blocks, step_metadata

REFERENCE = torch.ops.autodeploy.paged_attention
MIXED = [(5, 3), (0, 7), (12, 1), (0, 1), (3, 0)]  # chunked prefill, prefill, decodes, an empty sequence
# name -> (interleaved, rotary dim) with head dim 16
ROTATIONS = {"half": (False, 16), "half-partial": (False, 8), "interleaved": (True, 16),
             "interleaved-partial": (True, 4)}


def rotated(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """x [T, H, D] rotated in fp32 and rounded once to its dtype, as the kernels round it."""
    return rope_reference(x.float(), cos.float()[:, None], sin.float()[:, None], interleaved).to(x.dtype)


def _compare(seqs, heads, kv_heads, dtype, launch, rotation, head_dim=16, page=4, pad_tokens=0, seed=0,
             cache_dtype=None, kv_scales=None, **features):
    torch.manual_seed(seed)
    interleaved, rot_dim = ROTATIONS[rotation]
    blocks = shuffled_blocks([c + n for c, n in seqs], page, num_blocks=64)
    query_lens, context_lens, cu, table, slots = step_metadata(
        [(c, n, b) for (c, n), b in zip(seqs, blocks)], page, pad_tokens)
    tokens = slots.shape[0]
    q, k, v = (torch.randn(tokens, h, head_dim).to(dtype) for h in (heads, kv_heads, kv_heads))
    cos, sin = (torch.randn(tokens, rot_dim).to(dtype) for _ in range(2))
    cache = random_cache(64, page, kv_heads, head_dim, cache_dtype or dtype)
    want_cache, got_cache, op_cache = cache.clone(), cache.clone(), cache.clone()
    metadata = (query_lens, context_lens, cu, table, slots, 0.3)
    scales = dict(zip(("k_scale", "v_scale"), kv_scales)) if kv_scales else {}
    want = REFERENCE(rotated(q, cos, sin, interleaved), rotated(k, cos, sin, interleaved), v, want_cache, *metadata,
                     features.get("window"), features.get("softcap"), **scales)
    got = paged_attention_fwd(q, k, v, got_cache, cu, context_lens, table, slots, 0.3, features.get("window"),
                              features.get("softcap"), None, cos, sin, interleaved, launch=launch, **scales)
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(cache_bits(got_cache), cache_bits(want_cache), atol=0, rtol=0)
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)
    # the reference backend's own rotation (rope_qk in the inputs' dtype) agrees within rounding
    by_op = REFERENCE(q, k, v, op_cache, *metadata, features.get("window"), features.get("softcap"), None,
                      cos, sin, interleaved, **scales)
    torch.testing.assert_close(by_op.float(), want.float(), atol=5 * tol, rtol=5 * tol)
    return got


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 2), (4, 1)], ids=["mha", "gqa", "mqa"])
@pytest.mark.parametrize("launch", [AttentionLaunch(16, 16, 1), AttentionLaunch(16, 16, 3, decode=True),
                                    AttentionLaunch(32, 8, 2)], ids=["prefill", "decode-split3", "prefill-split2"])
def test_half_rotate_on_every_path(dtype, heads, kv_heads, launch):
    _compare(MIXED, heads, kv_heads, dtype, launch, "half")


@pytest.mark.parametrize("rotation", ["half-partial", "interleaved", "interleaved-partial"])
@pytest.mark.parametrize("decode", [False, True], ids=["prefill", "decode"])
def test_partial_and_interleaved_rotations(rotation, decode):
    _compare(MIXED, 6, 2, torch.float32, AttentionLaunch(16, 16, 2, decode=decode), rotation)


def test_decode_launch_walks_many_new_keys_in_small_blocks():
    """A decode launch rotates new keys in blocks of 16 (``decode_tuning``): a prompt chunk of 40
    tokens in a decode-shaped step takes several such blocks, next to decodes with long contexts."""
    seqs = [(37, 1), (0, 40), (70, 1), (16, 1)] + [(3, 1)] * 8
    _compare(seqs, 8, 2, torch.float32, AttentionLaunch(16, 64, 2, decode=True), "half", head_dim=32, page=8)


def test_head_dim_padding_window_softcap_and_cuda_graph_padding():
    out = _compare([(9, 2), (0, 5), (0, 0)], 4, 2, torch.float16, AttentionLaunch(16, 16, 2), "half-partial",
                   head_dim=80, pad_tokens=3, window=4, softcap=2.5)
    assert out[-3:].abs().max() == 0


def test_strided_cos_and_sin_views():
    """cos/sin as the graph hands them may be views with their own strides (one copy then, not wrong)."""
    torch.manual_seed(0)
    blocks = shuffled_blocks([4, 3], 4, num_blocks=8)
    query_lens, context_lens, cu, table, slots = step_metadata([(2, 2, blocks[0]), (0, 3, blocks[1])], 4)
    q, k, v = torch.randn(5, 2, 16), torch.randn(5, 1, 16), torch.randn(5, 1, 16)
    trig = torch.randn(5, 40)
    cos, sin = trig[:, :16], trig[:, 20:36].t().contiguous().t()  # row stride 40, and column-major
    caches = [random_cache(8, 4, 1, 16, torch.float32) for _ in range(2)]
    caches[1].copy_(caches[0])
    got = paged_attention_fwd(q, k, v, caches[0], cu, context_lens, table, slots, 0.3, None, None, None, cos, sin)
    want = REFERENCE(q, k, v, caches[1], query_lens, context_lens, cu, table, slots, 0.3, None, None, None,
                     cos.contiguous(), sin.contiguous())
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_malformed_rotary_inputs_are_refused():
    q, k = torch.randn(3, 2, 16), torch.randn(3, 1, 16)
    meta = (torch.tensor([0, 3]), torch.tensor([0]), torch.zeros(1, 1, dtype=torch.int64), torch.arange(3))
    cache = torch.zeros(1, 2, 4, 1, 16)
    for cos in (torch.randn(3, 18), torch.randn(3, 7), torch.randn(2, 16)):
        with pytest.raises(ValueError, match="rope cos/sin"):
            paged_attention_fwd(q, k, k, cache, *meta, 0.3, None, None, None, cos, cos)


@pytest.mark.parametrize("launch", [AttentionLaunch(16, 16, 1), AttentionLaunch(16, 16, 3, decode=True)],
                         ids=["prefill", "decode-split3"])
def test_fp8_cache_holds_the_rotated_keys_quantized(launch):
    _compare(MIXED, 4, 2, torch.float16, launch, "half", cache_dtype=torch.float8_e4m3fn, kv_scales=(0.01, 0.02),
             window=4, softcap=3.0)
