"""Multi-head latent attention on CUDA at DeepSeek-V3's attention shape (128 heads, latent 512, rotary 64,
nope 128, value 128), bf16: the Triton op (``paged_mla_triton``: absorbed up-projections, latent cache write,
flash-decoding) against the expanded reference (``paged_mla``, HF's math); the written cache must equal the
reference's bit for bit and padding rows must be zero."""

import pytest
import torch
from cuda_only import BF16_TOL, ON_CUDA
from gpu_harness import rel_err
from kernel_bench import PAGE, paged_metadata

pytestmark = ON_CUDA
HEADS, RANK, ROPE, NOPE, V = 128, 512, 64, 128, 128


def mla_inputs(seqs, pad_tokens=0):
    """(q_nope, q_pe, c_kv, k_pe, w_kv_b), the latent cache and the metadata of sequences of (context, new)."""
    meta, pages = paged_metadata(seqs, pad_tokens, torch.device("cuda"))
    tokens = meta[-1].shape[0]
    rand = lambda *shape: torch.randn(*shape, device="cuda", dtype=torch.bfloat16)  # noqa: E731
    inputs = (rand(tokens, HEADS, NOPE), rand(tokens, HEADS, ROPE), rand(tokens, RANK), rand(tokens, ROPE),
              rand(HEADS * (NOPE + V), RANK) * RANK**-0.5)
    return inputs, rand(pages, PAGE, RANK + ROPE), meta


@pytest.mark.parametrize("seqs,pad", [([(37, 5), (0, 70), (300, 1), (0, 0), (129, 1), (16, 33), (1000, 1)], 5),
                                      ([(4095, 1)], 0), ([(4095, 1)] * 64, 0)],
                         ids=["mixed+padding", "decode 1x4096", "decode 64x4096"])
def test_the_triton_op_matches_the_expanded_reference(seqs, pad):
    inputs, cache, meta = mla_inputs(seqs, pad)
    scale = (NOPE + ROPE) ** -0.5
    want_cache, got_cache = cache.clone(), cache.clone()
    want = torch.ops.autodeploy.paged_mla(*inputs, want_cache, *meta, scale)
    got = torch.ops.autodeploy.paged_mla_triton(*inputs, got_cache, *meta, scale)
    real = got.shape[0] - pad
    assert torch.equal(got_cache, want_cache)
    assert pad == 0 or got[real:].abs().max() == 0
    assert rel_err(got[:real], want[:real]) < BF16_TOL
