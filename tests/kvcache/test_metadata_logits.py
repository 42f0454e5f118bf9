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


def test_a_padded_decode_step_has_one_logits_row_per_token_in_token_order():
    """gather_logits's ``gather_rows`` is the identity when there are as many logits rows as tokens:
    the real rows of a CUDA-graph decode step padded to its captured size are 0 .. B-1."""
    from autodeploy.kvcache.metadata import Padding, StepBuffers

    pad = Padding(num_tokens=8, num_seqs=8, max_blocks=4)
    chunks = [SequenceChunk((7,), 3, (2,)), SequenceChunk((9,), 17, (0, 5, 1))]
    batch = BatchMetadata.build(chunks, 8, "cpu", pad=pad, buffers=StepBuffers(pad.metadata_size, "cpu"))
    assert batch.num_logits == batch.input_ids.shape[0] == 8
    assert batch.logits_indices[: len(chunks)].tolist() == [0, 1]
