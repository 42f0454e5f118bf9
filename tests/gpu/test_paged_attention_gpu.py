"""The Triton paged attention on CUDA in bf16 against the reference op (``torch.ops.autodeploy.paged_attention``)
at the 8B attention shape: decode and prefill grids, RoPE folded in, every feature and variant on mixed steps
with padding (and forced split counts), split merges replayed from a CUDA graph, an FP8 (e4m3) pool. Where
the op writes the cache, the written cache must equal the reference's bit for bit."""

import pytest
import torch
from cuda_only import BF16_TOL, ON_CUDA
from gpu_harness import rel_err
from kernel_bench import D, HQ, PAGE, fp8_pool, paged_batch, rotary_rows

from autodeploy.kernels.attention_config import AttentionLaunch
from autodeploy.kernels.paged_attention import paged_attention_fwd

pytestmark = ON_CUDA
MIXED = [(37, 5), (0, 70), (300, 1), (0, 0), (129, 1), (16, 33), (1000, 1), (500, 40)]  # (context, new tokens)
FORCED = (AttentionLaunch(16, 32, 3, decode=True), AttentionLaunch(16, 32, 16, decode=True, preload_kv=True),
          AttentionLaunch(32, 32, 3))  # flash-decoding whatever the shape heuristic says; a prefill launch


def slopes():
    return (2.0 ** -torch.arange(1, HQ + 1, dtype=torch.float32, device="cuda")) * 4  # steeper than Bloom's


FEATURES = {
    "gqa4 d128": lambda: {},
    "window64 softcap30 sinks": lambda: dict(sliding_window=64, logit_softcap=30.0,
                                             sinks=torch.randn(HQ, device="cuda")),
    "chunk64": lambda: dict(chunk_size=64),
    "chunk1024": lambda: dict(chunk_size=1024),
    "alibi": lambda: dict(alibi_slopes=slopes()),
    "chunk48 window20 softcap30 alibi": lambda: dict(chunk_size=48, sliding_window=20, logit_softcap=30.0,
                                                     alibi_slopes=slopes()),
}


# (256 x 4096 tokens would pass the 2^31 elements of one layer's pool that the kernels' 32-bit offsets address,
# which KVPool caps: an illegal address, not a test)
@pytest.mark.parametrize("seqs", [[(c - 1, 1)] * b for c in (512, 4096) for b in (1, 8, 64, 256) if c * b < 2**20]
                         + [[(0, 1024)] * 4, [(1024, 1024)] * 4], ids=lambda seqs: f"{len(seqs)}x{seqs[0]}")
def test_decode_and_prefill_grids(seqs):
    batch = paged_batch(seqs)
    assert rel_err(batch.triton(), batch.reference()) < BF16_TOL


@pytest.mark.parametrize("name", FEATURES)
def test_mixed_steps_with_every_feature_padding_and_forced_launches(name):
    features = FEATURES[name]()
    batch = paged_batch(MIXED, pad_tokens=5)
    want_cache, got_cache = batch.cache.clone(), batch.cache.clone()
    want = batch.reference(want_cache, **features)
    got = batch.triton(cache=got_cache, **features)
    assert rel_err(got, want) < BF16_TOL
    assert got[-5:].abs().max() == 0 and torch.equal(got_cache, want_cache)  # padding: zero rows, no writes
    for launch in FORCED:
        assert rel_err(batch.triton(launch, **features), want) < BF16_TOL, launch


@pytest.mark.parametrize("heads,kv_heads,head_dim", [(8, 1, 64), (4, 4, 256)], ids=["mqa d64", "mha d256"])
def test_other_head_layouts_on_a_mixed_step(heads, kv_heads, head_dim):
    batch = paged_batch(MIXED, heads, kv_heads, head_dim, pad_tokens=5)
    want_cache, got_cache = batch.cache.clone(), batch.cache.clone()
    assert rel_err(batch.triton(cache=got_cache), batch.reference(want_cache)) < BF16_TOL
    assert torch.equal(got_cache, want_cache)


@pytest.mark.parametrize("batch_size", (1, 64))
def test_decode_with_rope_folded_in_writes_the_rotated_keys(batch_size):
    seqs = [(511, 1)] * batch_size
    batch, (cos, sin) = paged_batch(seqs), rotary_rows(seqs)
    want_cache, got_cache = batch.cache.clone(), batch.cache.clone()
    got = batch.triton(cache=got_cache, rope_cos=cos, rope_sin=sin)
    assert rel_err(got, batch.reference(want_cache, rope_cos=cos, rope_sin=sin)) < BF16_TOL
    written = (batch.slots // PAGE, slice(None), batch.slots % PAGE)
    assert rel_err(got_cache[written], want_cache[written]) < BF16_TOL


def test_split_merges_replayed_from_a_cuda_graph():
    """The last split of each tile resets its counter: every replay must merge right (a leftover count would
    skip a merge)."""
    batch = paged_batch([(c, 1) for c in (4095, 300, 17, 0, 1000, 64, 2047, 511)] * 8)
    want, launch = batch.reference(), AttentionLaunch(16, 32, 16, decode=True)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        batch.triton(launch)  # compile and allocate the counters outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = batch.triton(launch)
    for _ in range(20):
        out.zero_()
        graph.replay()
        torch.cuda.synchronize()
        assert rel_err(out, want) < BF16_TOL


@pytest.mark.parametrize("rope", [False, True], ids=["", "rope"])
@pytest.mark.parametrize("seqs,pad", [([(4095, 1)] * 64, 0), ([(4095, 1)], 0), ([(511, 1)] * 64, 0),
                                      (MIXED, 5)], ids=["64x4096", "1x4096", "64x512", "mixed+padding"])
def test_fp8_pool_against_the_reference_on_the_same_pool_and_against_bf16(seqs, pad, rope):
    """Kernel vs reference on the same e4m3 pool (the kernel's error) and vs the bf16 pool's reference (the
    quantization's: ~3-4e-2 on random values); the bytes written equal the reference's. With RoPE folded in
    (the engine's default; its FP8 decode runs uncapped, without RoPE at FP8_DECODE_MAX_REGISTERS) the kernel
    rounds the rotated keys as rope_qk does, not as the reference: a few e4m3 codes differ by one step (0.2-0.3%
    of them under the interpreter, on main too), so the written keys are compared as values."""
    batch = paged_batch(seqs, pad_tokens=pad)
    fp8, (k_scale, v_scale) = fp8_pool(batch.cache)
    features = dict(zip(("rope_cos", "rope_sin"), rotary_rows(seqs + [(0, pad)] if pad else seqs))) if rope else {}
    want_bf16 = batch.reference(batch.cache.clone(), **features)
    want_cache, got_cache = fp8.clone(), fp8.clone()
    want = batch.reference(want_cache, k_scale=k_scale, v_scale=v_scale, **features)
    got = batch.triton(cache=got_cache, k_scale=k_scale, v_scale=v_scale, **features)
    if rope:
        written = (batch.slots[batch.slots >= 0] // PAGE, slice(None), batch.slots[batch.slots >= 0] % PAGE)
        assert rel_err(got_cache[written].float(), want_cache[written].float()) < BF16_TOL
    else:
        assert torch.equal(got_cache.view(torch.uint8), want_cache.view(torch.uint8))
    assert rel_err(got, want) < BF16_TOL
    assert rel_err(got, want_bf16) < 8e-2


@pytest.mark.parametrize("magnitude", [2.0 ** 20, 2.0 ** -20], ids=["beyond-fp16", "fp16-subnormal"])
def test_fp8_pool_with_bf16_queries_beyond_fp16s_range(magnitude):
    """The FP8 kernel's dots run in fp16: bf16 queries of 2**20 (fp16 overflows at 65504) or 2**-20 go in scaled
    by a power of two, and the result is the reference's (decode and mixed launches, splits or not)."""
    for seqs in ([(4095, 1)] * 64, [(4095, 1)], MIXED):
        batch = paged_batch(seqs)
        batch.q.mul_(magnitude)
        fp8, (k_scale, v_scale) = fp8_pool(batch.cache)
        scales = dict(k_scale=k_scale, v_scale=v_scale)
        want = torch.ops.autodeploy.paged_attention(
            batch.q, batch.k, batch.v, fp8.clone(), batch.query_lens, batch.context_lens, batch.cu_seqlens,
            batch.block_table, batch.slots, D ** -0.5 / magnitude, **scales)
        got = paged_attention_fwd(batch.q, batch.k, batch.v, fp8.clone(), batch.cu_seqlens, batch.context_lens,
                                  batch.block_table, batch.slots, D ** -0.5 / magnitude, **scales)
        assert rel_err(got, want) < BF16_TOL, (len(seqs), magnitude)
