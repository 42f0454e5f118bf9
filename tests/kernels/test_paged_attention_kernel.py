"""The Triton paged-attention kernel (one launch: cache write, attention, split merge) against the
reference op (interpreter, fp32/fp16)."""

import pytest
import torch
import triton
import triton.language as tl

from autodeploy.kernels.attention_config import AttentionLaunch
from autodeploy.kernels.paged_attention import paged_attention_fwd, split_counters
from autodeploy.kernels.paged_attention_blocks import _split_keys
from paged_batches import cache_bits, random_cache, shuffled_blocks, step_metadata

REFERENCE = torch.ops.autodeploy.paged_attention
FP8 = torch.float8_e4m3fn
# (context_len, query_len): chunked prefill, fresh prefill, decodes, an empty sequence
MIXED = [(5, 3), (0, 7), (12, 1), (0, 1), (3, 0)]


def _compare(seqs, heads, kv_heads, head_dim, dtype, launch, page=4, window=None, softcap=None, sinks=False,
             pad_tokens=0, cache_dtype=None, seed=0, chunk=None, alibi=False, **kv_scales):
    torch.manual_seed(seed)
    blocks = shuffled_blocks([c + n for c, n in seqs], page, num_blocks=64)
    query_lens, context_lens, cu, table, slots = step_metadata(
        [(c, n, b) for (c, n), b in zip(seqs, blocks)], page, pad_tokens)
    tokens = slots.shape[0]
    q, k, v = (torch.randn(tokens, h, head_dim).to(dtype) for h in (heads, kv_heads, kv_heads))
    sink_logits = torch.randn(heads) if sinks else None
    cache = random_cache(64, page, kv_heads, head_dim, cache_dtype or dtype)
    want_cache, got_cache = cache.clone(), cache.clone()
    features = (window, softcap, sink_logits)
    variants = {"chunk_size": chunk, "alibi_slopes": 2.0 ** -torch.arange(1, heads + 1.0) if alibi else None}
    want = REFERENCE(q, k, v, want_cache, query_lens, context_lens, cu, table, slots, 0.3, *features, **variants,
                     **kv_scales)
    got = paged_attention_fwd(q, k, v, got_cache, cu, context_lens, table, slots, 0.3, *features, **variants,
                              launch=launch, **kv_scales)
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(cache_bits(got_cache), cache_bits(want_cache), atol=0, rtol=0)
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)
    return got


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 2), (4, 1), (6, 2)], ids=["mha", "gqa", "mqa", "gqa3"])
@pytest.mark.parametrize("splits", [1, 3])
def test_mixed_batch_matches_reference(dtype, heads, kv_heads, splits):
    _compare(MIXED, heads, kv_heads, 16, dtype, AttentionLaunch(16, 16, splits))


@pytest.mark.parametrize("decode", [False, True], ids=["new-keys-in-two-loops", "new-keys-in-one-loop"])
@pytest.mark.parametrize("heads,kv_heads", [(7, 1), (8, 2)], ids=["group7", "group4"])
def test_both_loop_structures_on_a_mixed_batch(decode, heads, kv_heads):
    """Decode launches walk the new keys in one masked loop; prefill launches split off the keys every row
    sees. Both must be right for any step (a decode-shaped step may hold a prefill chunk)."""
    _compare([(9, 1), (0, 11), (21, 6), (4, 1)], heads, kv_heads, 16, torch.float32,
             AttentionLaunch(32, 8, 2, decode=decode))


@pytest.mark.parametrize("head_dim", [32, 64, 128, 80])
def test_head_dims(head_dim):
    _compare([(6, 2), (0, 5)], 4, 2, head_dim, torch.float16, AttentionLaunch(16, 16, 2))


@pytest.mark.parametrize("splits", [1, 2])
def test_sliding_window_softcap_and_sinks(splits):
    _compare(MIXED, 4, 2, 16, torch.float32, AttentionLaunch(16, 16, splits), window=3)
    _compare(MIXED, 4, 2, 16, torch.float32, AttentionLaunch(16, 16, splits), softcap=2.5)
    _compare(MIXED, 4, 2, 16, torch.float32, AttentionLaunch(32, 8, splits), window=5, softcap=4.0, sinks=True)


@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("chunk", [5, 8, 16])
def test_chunked_attention(splits, chunk):
    """Llama-4's chunks: a token sees the earlier keys of its own chunk only. Tiles and key blocks
    straddle chunk boundaries (chunk 5: none aligned; 8: the page and half a key block; 16: a key
    block), prefill chunks and decodes start mid-chunk, and splits cover only the chunk's keys."""
    seqs = [(5, 3), (0, 7), (12, 1), (0, 1), (3, 0), (30, 9), (16, 1), (14, 20)]
    _compare(seqs, 4, 2, 16, torch.float32, AttentionLaunch(16, 16, splits), chunk=chunk)
    _compare(seqs, 4, 2, 16, torch.float16, AttentionLaunch(32, 8, splits, decode=True, preload_kv=True),
             page=8, chunk=chunk)


@pytest.mark.parametrize("splits", [1, 3])
def test_alibi(splits):
    """ALiBi slopes (one per query head, GQA groups included) with prefill, chunked prefill and decodes."""
    seqs = [(5, 3), (0, 7), (12, 1), (0, 1), (3, 0), (30, 9)]
    _compare(seqs, 4, 2, 16, torch.float32, AttentionLaunch(16, 16, splits), alibi=True)
    _compare(seqs, 8, 2, 16, torch.float16, AttentionLaunch(16, 16, splits, decode=True, preload_kv=True),
             alibi=True)
    _compare(seqs, 4, 1, 16, torch.float32, AttentionLaunch(32, 8, splits), alibi=True, window=6, softcap=3.0,
             sinks=True, chunk=8)


@pytest.mark.parametrize("splits", [1, 3])
def test_long_contexts_mix_unmasked_and_diagonal_blocks(splits):
    _compare([(150, 3), (40, 30), (0, 45)], 4, 2, 16, torch.float16, AttentionLaunch(32, 16, splits), page=8)


@pytest.mark.parametrize("splits", [2, 5, 8])
def test_decode_splits_some_with_no_keys(splits):
    """Decodes only, one new key each; with short contexts the last splits get no key at all, and a
    context of a whole number of key blocks puts the new key in a block of its own."""
    seqs = [(37, 1), (2, 1), (16, 1), (0, 1), (63, 1)]
    _compare(seqs, 8, 2, 16, torch.float32, AttentionLaunch(16, 16, splits, decode=True), page=4)
    _compare(seqs, 8, 2, 16, torch.float32, AttentionLaunch(16, 16, splits, decode=True), page=8, sinks=True)


@pytest.mark.parametrize("preload,second_early", [(True, False), (True, True), (False, False)],
                         ids=["first-block-before-wait", "second-block-early", "all-blocks-after-wait"])
@pytest.mark.parametrize("splits", [1, 3])
def test_decode_with_and_without_the_preloaded_key_block(preload, second_early, splits):
    """Decode launches load each split's first pooled block before the PDL wait and attend to it before
    the new keys (and, ``second_block_early``, the second block's table entries before the wait and its
    K/V right after q): same result as the plain loop order, with a window (the first block partly
    outside it), a softcap, sinks, a context shorter than one block and a sequence with no pooled key."""
    seqs = [(37, 1), (2, 1), (16, 1), (0, 1), (63, 1), (20, 3)]
    launch = AttentionLaunch(16, 16, splits, decode=True, preload_kv=preload, second_block_early=second_early)
    _compare(seqs, 8, 2, 16, torch.float32, launch, page=4)
    _compare(seqs, 8, 2, 16, torch.float32, launch, page=8, window=9, softcap=3.0, sinks=True)


@pytest.mark.parametrize("search_block", [2, 4, 16])
def test_tiles_find_their_sequence_past_one_search_block(monkeypatch, search_block):
    """A tile counts the sequences before it in blocks of SEARCH_BLOCK; under one block the lengths come
    from the same loads, from one block on they are loaded again. Both, with padding tiles."""
    import autodeploy.kernels.paged_attention as kernel

    monkeypatch.setattr(kernel, "SEARCH_BLOCK", search_block)
    seqs = [(5, 3), (0, 7), (12, 1), (0, 1), (3, 0), (9, 1), (2, 5)]
    _compare(seqs, 4, 2, 16, torch.float32, AttentionLaunch(16, 16, 2, decode=True, preload_kv=True), pad_tokens=3)
    _compare(seqs, 4, 2, 16, torch.float32, AttentionLaunch(32, 8, 1), pad_tokens=5)


def test_decode_tokens_merge_split_by_split_when_a_group_is_too_large(monkeypatch):
    """Past MAX_TOKEN_MERGE values (large MQA groups) a decode token's splits merge in the loop."""
    import autodeploy.kernels.paged_attention as kernel

    seqs = [(37, 1), (2, 1), (63, 1)]
    assert kernel._token_merge_fits(4, 8, 16)
    monkeypatch.setattr(kernel, "MAX_TOKEN_MERGE", 16)
    assert not kernel._token_merge_fits(4, 8, 16)
    _compare(seqs, 8, 1, 16, torch.float32, AttentionLaunch(16, 16, 4, decode=True, preload_kv=True), page=4)


def test_consecutive_launches_leave_the_split_counters_at_zero():
    """The last split to arrive resets its counter, so a second launch (or graph replay) merges right."""
    launch = AttentionLaunch(16, 16, 4, decode=True)
    for seed in range(2):
        _compare([(40, 1), (25, 1), (9, 1)], 4, 2, 16, torch.float32, launch, seed=seed)
        assert not split_counters(1, torch.device("cpu")).any()


def test_padding_rows_are_zero_and_write_nowhere():
    out = _compare([(2, 3), (4, 0), (0, 2)], 4, 2, 16, torch.float32, AttentionLaunch(16, 16, 2), pad_tokens=3)
    assert out[-3:].abs().max() == 0


@pytest.mark.parametrize("pad_tokens", [1, 9])
def test_cuda_graph_padding_across_several_tiles(pad_tokens):
    """A padded decode batch: padding tokens (slot -1) past the real ones, padding sequences with no tokens;
    more padding tokens than one tile's BLOCK_Q so that several programs zero rows."""
    seqs = [(5, 1), (11, 1), (0, 0), (0, 0)]
    launch = AttentionLaunch(16, 16, 3, decode=True)
    out = _compare(seqs, 8, 2, 16, torch.float32, launch, pad_tokens=pad_tokens)
    assert out[2:].abs().max() == 0


@pytest.mark.parametrize("decode", [False, True], ids=["prefill-launch", "decode-launch"])
def test_a_whole_step_graphs_padding_under_either_launch(decode):
    """A prefill or mixed step padded to a whole-step graph's shape (``autodeploy/mixed_graphs.py``):
    prompt chunks and a decode, then padding sequences (no tokens, no blocks) and padding tokens."""
    seqs = [(0, 9), (6, 5), (12, 1), (0, 0), (0, 0), (0, 0)]
    out = _compare(seqs, 4, 2, 16, torch.float32, AttentionLaunch(16, 16, 2, decode=decode), pad_tokens=6)
    assert out[15:].abs().max() == 0


def test_a_step_of_padding_only():
    launch = AttentionLaunch(16, 16, 2, decode=True)
    out = _compare([(0, 0), (0, 0)], 4, 2, 16, torch.float16, launch, pad_tokens=5)
    assert out.abs().max() == 0


def test_cache_in_another_dtype_than_the_inputs():
    """New keys are attended to as the pool stores them (rounded to its dtype), like the reference."""
    _compare(MIXED, 4, 2, 16, torch.float32, AttentionLaunch(16, 16, 2), cache_dtype=torch.float16)


@pytest.mark.parametrize("dtype, launch", [
    (torch.float32, AttentionLaunch(16, 16, 1)), (torch.float16, AttentionLaunch(16, 16, 3, decode=True)),
    (torch.float32, AttentionLaunch(32, 8, 2))], ids=["prefill-fp32", "decode-split3-fp16", "prefill-split2-fp32"])
def test_fp8_cache(dtype, launch):
    """An FP8 pool: the bytes written equal the reference's, saturation included (k_scale makes every
    |k| > 1.8 saturate), and the new keys are attended to as they are cached."""
    _compare(MIXED, 4, 2, 16, dtype, launch, pad_tokens=2, cache_dtype=FP8, k_scale=0.004, v_scale=0.3)


def test_fp8_cache_with_window_softcap_sinks_chunks_and_alibi():
    _compare(MIXED, 6, 2, 16, torch.float32, AttentionLaunch(16, 16, 2, decode=True), window=4, softcap=3.0,
             sinks=True, chunk=5, alibi=True, cache_dtype=FP8, k_scale=0.01, v_scale=0.02)


def test_fp8_cache_decode_launch_quantizes_new_keys_in_blocks_of_16():
    """A decode launch over an FP8 pool quantizes the new keys in blocks of 16 (``decode_tuning``), not its 64
    keys a block: a prompt chunk of 40 tokens in a decode-shaped step takes several such blocks."""
    _compare([(37, 1), (0, 40), (3, 1)], 4, 2, 16, torch.float16, AttentionLaunch(16, 64, 2, decode=True), page=8,
             cache_dtype=FP8, k_scale=0.01, v_scale=0.02)


@pytest.mark.parametrize("magnitude", [2.0 ** 20, 2.0 ** -20], ids=["beyond-fp16", "fp16-subnormal"])
def test_fp8_cache_with_bf16_queries_beyond_fp16s_range(magnitude):
    """Over an FP8 pool the dots run in fp16 (e4m3 widens to it in one instruction a pair): bf16 queries go in
    scaled by a power of two, so that queries of 2**20 (fp16 overflows at 65504) or 2**-20 (fp16 subnormals)
    give the reference's result to the output's rounding. (The interpreter runs these bf16 launches right:
    their dots are fp16.)"""
    torch.manual_seed(0)
    blocks = shuffled_blocks([c + n for c, n in MIXED], 4, num_blocks=64)
    query_lens, context_lens, cu, table, slots = step_metadata(
        [(c, n, b) for (c, n), b in zip(MIXED, blocks)], 4, 2)
    q = (torch.randn(slots.shape[0], 4, 16) * magnitude).to(torch.bfloat16)
    k, v = (torch.randn(slots.shape[0], 2, 16).to(torch.bfloat16) for _ in range(2))
    want_cache = random_cache(64, 4, 2, 16, FP8)
    got_cache = want_cache.clone()
    scales = dict(k_scale=0.01, v_scale=0.02)
    want = REFERENCE(q, k, v, want_cache, query_lens, context_lens, cu, table, slots, 0.3 / magnitude, **scales)
    got = paged_attention_fwd(q, k, v, got_cache, cu, context_lens, table, slots, 0.3 / magnitude,
                              launch=AttentionLaunch(16, 16, 3, decode=True), **scales)
    assert torch.equal(cache_bits(got_cache), cache_bits(want_cache))
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=1e-2)  # bf16: one ulp of ~2.4


def test_tiles_larger_than_pages_and_pages_larger_than_tiles():
    _compare(MIXED, 4, 2, 16, torch.float32, AttentionLaunch(64, 32, 1), page=2)
    _compare(MIXED, 4, 2, 16, torch.float32, AttentionLaunch(16, 8, 1), page=16)


def test_default_launch_choice():
    cpu = torch.device("cpu")  # the interpreter pretends to be one SM wanting 12 programs
    decode = AttentionLaunch.choose(64, 64, 32, 8, 128, 4096, cpu)
    prefill = AttentionLaunch.choose(4096, 4, 32, 8, 128, 1024, cpu)
    assert (decode.block_m, decode.block_q(4), decode.num_splits, decode.decode) == (16, 4, 1, True)
    assert prefill.block_m == 128 and not prefill.decode
    assert AttentionLaunch.choose(1, 1, 32, 8, 128, 4096, cpu).num_splits == 2  # 8 tiles -> 2 splits
    assert AttentionLaunch.choose(1, 1, 4, 1, 128, 4096, cpu).num_splits == 8  # 12 wanted, a power of two
    assert AttentionLaunch.choose(250 + 256, 252, 32, 8, 128, 4096, cpu).decode  # decodes + 2 prompt chunks
    assert not AttentionLaunch.choose(5 * 64, 64, 32, 8, 128, 4096, cpu).decode
    assert AttentionLaunch.choose(1, 1, 4, 1, 128, 128, cpu).num_splits == 4  # >= 32 keys per split
    assert AttentionLaunch.choose(64, 1, 4, 1, 128, 8192, cpu).num_splits == 1  # prefill: 2 programs per SM


def test_fp32_prefill_tiles_fit_shared_memory():
    """fp32 at head 128 with RoPE folded in needs 257 KB of shared memory at 64 keys per step (sm_90
    compile, tests/kernels/compile_sm90.py; the H200 has 227 KB): 32 keys for 4-byte elements; bf16 unchanged."""
    cpu = torch.device("cpu")
    assert AttentionLaunch.choose(4096, 4, 32, 8, 128, 1024, cpu, element_size=4).block_n == 32
    assert AttentionLaunch.choose(4096, 4, 32, 8, 128, 1024, cpu, element_size=2).block_n == 64
    assert AttentionLaunch.choose(4096, 4, 32, 8, 64, 1024, cpu, element_size=4).block_n == 64
    assert AttentionLaunch.choose(64, 64, 32, 8, 128, 4096, cpu, element_size=4).block_n == 64  # decode: 78 KB


@pytest.mark.parametrize("seqs, keys, splits", [(1, 512, 16), (1, 592, 16), (8, 512, 4), (64, 512, 1), (1, 4096, 16),
                                                (8, 4096, 4), (64, 4096, 1), (256, 4096, 1)])
def test_decode_splits_on_an_h200(monkeypatch, seqs, keys, splits):
    """The split counts the H200 measured fastest (attention_config's comment) for 32/8 heads."""
    import autodeploy.kernels.attention_config as config

    monkeypatch.setattr(config, "_sm_count_of", lambda device: 132)
    assert AttentionLaunch.choose(seqs, seqs, 32, 8, 128, keys, torch.device("cuda")).num_splits == splits


def test_an_engine_meets_few_launch_variants(monkeypatch):
    """Each distinct launch config is a Triton compile when an eager step first meets it (seconds on
    the H200, while requests wait): every step shape an engine of max batch 512 and 8192 tokens
    per step can run, with any block-table width, maps onto a handful of configs."""
    import autodeploy.kernels.attention_config as config

    monkeypatch.setattr(config, "_sm_count_of", lambda device: 132)
    seen = set()
    for seqs in range(1, 513):
        for tokens in {seqs, seqs + 1, 2 * seqs, 4 * seqs, 4 * seqs + 1, 8192}:
            if tokens >= seqs:
                for max_kv in (16, 544, 4096, 131072):
                    seen.add(AttentionLaunch.choose(tokens, seqs, 32, 8, 128, max_kv, torch.device("cuda")))
    assert {launch.num_splits for launch in seen} <= {1, 2, 4, 8, 16, 32, 64}
    assert len(seen) <= 2 * 7, sorted(seen, key=str)  # decode or prefill tiles x 7 split counts (was ~2 x 64)


@pytest.mark.parametrize("tokens,heads,head_dim", [(1, 32, 128), (3, 9, 64), (7, 5, 72), (513, 3, 80)])
def test_split_partials_keep_strides_the_jit_specializes(tokens, heads, head_dim):
    """The partials' strides are specialized (not in _DYNAMIC_ARGS), which makes the merge's loads
    16-byte vectors: they must be multiples of 16 elements for every step size, or a new step size
    would compile another kernel while an engine serves."""
    from autodeploy.kernels.paged_attention import _DYNAMIC_ARGS, _partials

    out, lse = _partials(4, torch.empty(tokens, heads, head_dim))
    assert out.shape == (4, tokens, heads, head_dim) and lse.shape == (4, tokens, heads)
    assert all(stride % 16 == 0 for stride in (*out.stride()[:3], *lse.stride()[:2]))
    assert out.stride(-1) == lse.stride(-1) == 1
    assert not {"stride_ps", "stride_pt", "stride_ph", "stride_ls", "stride_lt"} & set(_DYNAMIC_ARGS)


@triton.jit
def _split_keys_probe(out_ptr, ctx_len, q_len, window, chunk, BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr,
                      HAS_WINDOW: tl.constexpr, HAS_CHUNK: tl.constexpr):
    split = tl.program_id(0)
    lo, hi, active = _split_keys(0, q_len, ctx_len, split, window, chunk, 16, BLOCK_N, NUM_SPLITS, HAS_WINDOW,
                                 HAS_CHUNK)
    tl.store(out_ptr + split * 3, lo)
    tl.store(out_ptr + split * 3 + 1, hi)
    tl.store(out_ptr + split * 3 + 2, active)


def _split_shares(ctx_len, q_len, splits, block_n=32, window=0, chunk=0):
    out = torch.zeros(splits, 3, dtype=torch.int32)
    _split_keys_probe[(splits,)](out, ctx_len, q_len, window, chunk, BLOCK_N=block_n, NUM_SPLITS=splits,
                                 HAS_WINDOW=window > 0, HAS_CHUNK=chunk > 0)
    active = int(out[0, 2])
    return [(int(lo), int(hi)) for lo, hi, _ in out[:active]], active


@pytest.mark.parametrize("ctx_len,q_len,window,chunk", [(512, 1, 0, 0), (520, 1, 0, 0), (100, 1, 0, 0), (0, 1, 0, 0),
                                                        (31, 4, 0, 0), (700, 1, 200, 0), (700, 3, 2, 0),
                                                        (700, 3, 0, 256), (700, 1, 200, 640), (700, 1, 20, 64)])
def test_splits_share_the_visible_keys_in_whole_blocks(ctx_len, q_len, window, chunk):
    """Every key visible to the tile falls to exactly one split, in whole blocks but the last share; at
    512 cached keys + 1 new over 16 splits of 32-key blocks: 9 splits of 64 keys, the last holding only
    the new key. (Sharing out the pooled keys alone, the new one going to the 16th split, measured
    level on the H200: bench/probes/layer_chain.py, 2026-12-03.) With a window or a chunk the shares start at
    the first key the tile's first query sees."""
    shares, active = _split_shares(ctx_len, q_len, 16, window=window, chunk=chunk)
    first = max(ctx_len + 1 - window, 0) if window else 0  # the window of the tile's first query
    first = max(first, ctx_len // chunk * chunk) if chunk else first  # the start of its chunk
    assert shares[0][0] == first and shares[-1][1] == ctx_len + q_len
    assert all(a[1] == b[0] for a, b in zip(shares, shares[1:]))
    assert all((hi - lo) % 32 == 0 for lo, hi in shares[:-1]) and all(hi > lo for lo, hi in shares)
    if (ctx_len, q_len, window, chunk) == (512, 1, 0, 0):
        assert active == 9 and shares[-1] == (512, 513) and all(hi - lo == 64 for lo, hi in shares[:-1])
