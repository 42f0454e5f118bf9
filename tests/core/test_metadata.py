import pytest
import torch

from autodeploy.kvcache.metadata import GRAPH_INPUTS, BatchMetadata, SequenceChunk
from autodeploy.kvcache.pool import KVCacheSpec, KVCapacity, KVPool


def test_build_flattens_chunks():
    chunks = [SequenceChunk((7, 8, 9), 0, (5,)), SequenceChunk((4,), 6, (1, 2))]
    b = BatchMetadata.build(chunks, block_size=4, device="cpu")
    assert b.input_ids.tolist() == [7, 8, 9, 4]
    assert b.position_ids.tolist() == [0, 1, 2, 6]
    assert b.query_lens.tolist() == [3, 1] and b.context_lens.tolist() == [0, 6]
    assert b.cu_seqlens.tolist() == [0, 3, 4]
    assert b.block_table.tolist() == [[5, -1], [1, 2]]
    assert b.slot_mapping.tolist() == [20, 21, 22, 2 * 4 + 2]
    assert b.logits_indices.tolist() == [2, 3]
    assert list(b.as_kwargs()) == list(GRAPH_INPUTS)
    assert all(t.dtype == torch.int64 for t in b.as_kwargs().values())


def test_build_rejects_missing_blocks_and_empty_steps():
    with pytest.raises(ValueError, match="needs 5 slots"):
        BatchMetadata.build([SequenceChunk((1, 2), 3, (0,))], block_size=4, device="cpu")
    with pytest.raises(ValueError, match="at least one"):
        BatchMetadata.build([], block_size=4, device="cpu")


def test_pool_layout_and_capacity():
    specs = [KVCacheSpec(2, 8, torch.float16), KVCacheSpec(2, 8, torch.float16)]
    assert specs[0].bytes_per_token() == 2 * 2 * 8 * 2
    per_block = KVPool.bytes_per_block(specs, 16)
    assert per_block == 16 * 2 * 64
    assert KVPool.blocks_for_budget(specs, 16, per_block * 10 + 5) == 10
    pool = KVPool(specs, 3, 16, "cpu")
    assert [tuple(c.shape) for c in pool.caches] == [(3, 2, 16, 2, 8)] * 2
    assert list(pool.as_kwargs()) == ["kv_cache_0", "kv_cache_1"]
    cap = KVCapacity(num_blocks=64, block_size=16, max_seq_len=256)
    assert cap.num_tokens == 1024 and cap.seqs_at_max_len == 4
    assert "64 blocks" in cap.describe()


def test_an_fp8_pool_holds_twice_the_tokens_of_a_bf16_one():
    bf16, fp8 = KVCacheSpec(2, 8, torch.bfloat16), KVCacheSpec(2, 8, torch.float8_e4m3fn)
    budget = KVPool.bytes_per_block([bf16], 16) * 10
    assert KVPool.blocks_for_budget([fp8], 16, budget) == 2 * KVPool.blocks_for_budget([bf16], 16, budget) == 20
    cap = KVCapacity(20, 16, 64, dtype=torch.float8_e4m3fn, model_dtype=torch.bfloat16)
    assert cap.describe().startswith("KV cache (float8_e4m3fn, 2x the tokens of a bfloat16 cache in the same memory)")
    assert KVCapacity(10, 16, 64, dtype=torch.bfloat16, model_dtype=torch.bfloat16).dtype_words() == "bfloat16"


def test_padding_for_static_shapes_and_reused_buffers():
    from autodeploy.kvcache.metadata import Padding, StepBuffers

    chunks = [SequenceChunk((3,), 4, (2, 7)), SequenceChunk((5,), 0, (1,))]
    pad = Padding(num_tokens=4, num_seqs=4, max_blocks=3)
    buffers = StepBuffers(pad.metadata_size, "cpu")
    b = BatchMetadata.build(chunks, block_size=4, device="cpu", pad=pad, buffers=buffers)
    assert b.input_ids.tolist() == [3, 5, 0, 0]
    assert b.slot_mapping.tolist() == [7 * 4 + 0, 4, -1, -1]  # padding tokens write nothing
    assert b.query_lens.tolist() == [1, 1, 0, 0] and b.cu_seqlens.tolist() == [0, 1, 2, 2, 2]
    assert b.block_table.tolist() == [[2, 7, -1], [1, -1, -1], [-1] * 3, [-1] * 3]
    again = BatchMetadata.build(chunks[:1], block_size=4, device="cpu", pad=pad, buffers=buffers)
    assert again.input_ids.data_ptr() == b.input_ids.data_ptr()  # same static storage, refilled
    assert b.query_lens.tolist() == [1, 0, 0, 0]
    with pytest.raises(ValueError, match="does not fit"):
        BatchMetadata.build(chunks * 3, block_size=4, device="cpu", pad=pad)


def test_decode_fast_path_equals_the_general_fill():
    """Small decode steps into reused buffers take a list-based path; it must write what numpy does."""
    from autodeploy.kvcache.metadata import Padding, StepBuffers

    chunks = [SequenceChunk((11 + i,), 2 * i + 3, tuple(range(3 * i, 3 * i + 3))) for i in range(5)]
    pad = Padding(num_tokens=8, num_seqs=8, max_blocks=4)
    fast = BatchMetadata.build(chunks, block_size=4, device="cpu", pad=pad, buffers=StepBuffers(pad.metadata_size, "cpu"))
    general = BatchMetadata.build(chunks, block_size=4, device="cpu", pad=pad)
    for name, value in general.as_kwargs().items():
        assert torch.equal(fast.as_kwargs()[name], value), name
    with pytest.raises(ValueError, match="needs 4 slots"):
        BatchMetadata.build([SequenceChunk((1,), 3, (0,))], block_size=2, device="cpu", pad=pad,
                            buffers=StepBuffers(pad.metadata_size, "cpu"))
