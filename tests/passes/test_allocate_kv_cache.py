"""The KV sizing pass profiles the largest step the scheduler can build, not one sequence of it."""

from autodeploy.kvcache.metadata import BatchMetadata
from passes.allocate_kv_cache import profiling_chunks


def test_profiling_step_spans_max_num_tokens_in_sequences_of_max_seq_len():
    chunks, n_blocks = profiling_chunks(max_num_tokens=40, max_seq_len=16, max_batch_size=8, block_size=4)
    assert [len(c.token_ids) for c in chunks] == [16, 16, 8]
    assert all(c.context_len == 0 for c in chunks)
    blocks = [b for c in chunks for b in c.block_ids]
    assert blocks == list(range(1, n_blocks + 1)) and n_blocks == 4 + 4 + 2  # distinct, block 0 left alone
    batch = BatchMetadata.build(chunks, 4, "cpu")
    assert batch.input_ids.numel() == 40


def test_profiling_step_respects_the_batch_limit():
    chunks, n_blocks = profiling_chunks(max_num_tokens=8192, max_seq_len=1024, max_batch_size=2, block_size=16)
    assert [len(c.token_ids) for c in chunks] == [1024, 1024] and n_blocks == 128
    one, _ = profiling_chunks(max_num_tokens=100, max_seq_len=1024, max_batch_size=4, block_size=16)
    assert [len(c.token_ids) for c in one] == [100]
