import pytest

from autodeploy.kvcache.metadata import BatchMetadata, SequenceChunk


def test_logits_indices_default_to_the_last_token_of_each_chunk():
    batch = BatchMetadata.build([SequenceChunk((1, 2, 3), 0, (0,)), SequenceChunk((4,), 5, (1,))], 8, "cpu")
    assert batch.logits_indices.tolist() == [2, 3]
    assert batch.num_logits == 2


def test_num_logits_asks_for_the_chunks_last_tokens():
    chunks = [SequenceChunk((1, 2, 3), 0, (0,), num_logits=3), SequenceChunk((4, 5), 5, (1,), num_logits=1)]
    assert BatchMetadata.build(chunks, 8, "cpu").logits_indices.tolist() == [0, 1, 2, 4]


@pytest.mark.parametrize("num_logits", [0, 4])
def test_num_logits_out_of_range_is_an_error(num_logits):
    with pytest.raises(ValueError, match="num_logits"):
        BatchMetadata.build([SequenceChunk((1, 2, 3), 0, (0,), num_logits=num_logits)], 8, "cpu")
