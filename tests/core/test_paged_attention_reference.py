"""Golden test of the torch reference backend (rule 4): full-sequence attention == prefill then
token-by-token decode == chunked prefill, for MHA / GQA / MQA, with sliding window and softcap."""

import pytest
import torch

from autodeploy.kvcache.metadata import BatchMetadata, SequenceChunk

ATTN = torch.ops.autodeploy.attention.default
PAGED = torch.ops.autodeploy.paged_attention.default
BLOCK = 4


def _run(q, k, v, cache, chunks, **kw):
    batch = BatchMetadata.build(chunks, BLOCK, "cpu")
    meta = (batch.query_lens, batch.context_lens, batch.cu_seqlens, batch.block_table, batch.slot_mapping)
    return PAGED(q, k, v, cache, *meta, **kw)


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 2), (4, 1)])
@pytest.mark.parametrize("window,softcap", [(None, None), (5, None), (None, 3.0)])
def test_full_equals_decode_equals_chunked(heads, kv_heads, window, softcap):
    seq, dim = 13, 8
    q, k, v = torch.randn(seq, heads, dim), torch.randn(seq, kv_heads, dim), torch.randn(seq, kv_heads, dim)
    kw = dict(scale=dim**-0.5, sliding_window=window, logit_softcap=softcap)
    full = ATTN(q[None], k[None], v[None], dim**-0.5, True, window, softcap)[0]
    blocks = (3, 0, 5, 1)  # deliberately out of order

    def schedule(splits):
        cache = torch.zeros(8, 2, BLOCK, kv_heads, dim)
        outs, start = [], 0
        for end in splits:
            chunk = SequenceChunk(tuple(range(start, end)), start, blocks)
            outs.append(_run(q[start:end], k[start:end], v[start:end], cache, [chunk], **kw))
            start = end
        return torch.cat(outs)

    one_shot = schedule([seq])
    decode = schedule([6] + list(range(7, seq + 1)))
    chunked = schedule([4, 9, seq])
    for got in (one_shot, decode, chunked):
        torch.testing.assert_close(got, full, atol=1e-5, rtol=1e-5)


def test_mixed_batch_and_padding_slots():
    """Two sequences in one step (one prefilling, one decoding) plus slots marked -1 are not written."""
    heads, dim = 2, 8
    cache = torch.zeros(6, 2, BLOCK, heads, dim)
    a_q, a_k, a_v = (torch.randn(5, heads, dim) for _ in range(3))
    _run(a_q[:4], a_k[:4], a_v[:4], cache, [SequenceChunk((0,) * 4, 0, (2, 3))], scale=0.3)
    b = [torch.randn(3, heads, dim) for _ in range(3)]
    chunks = [SequenceChunk((0,), 4, (2, 3)), SequenceChunk((0,) * 3, 0, (4,))]
    q = torch.cat([a_q[4:], b[0]])
    out = _run(q, torch.cat([a_k[4:], b[1]]), torch.cat([a_v[4:], b[2]]), cache, chunks, scale=0.3)
    want_a = ATTN(a_q[None], a_k[None], a_v[None], 0.3)[0, 4:]
    want_b = ATTN(b[0][None], b[1][None], b[2][None], 0.3)[0]
    torch.testing.assert_close(out, torch.cat([want_a, want_b]), atol=1e-5, rtol=1e-5)

    before = cache.clone()
    batch = BatchMetadata.build([SequenceChunk((0,), 5, (2, 3))], BLOCK, "cpu")
    slots = torch.full_like(batch.slot_mapping, -1)
    PAGED(torch.randn(1, heads, dim), torch.randn(1, heads, dim), torch.randn(1, heads, dim), cache,
          batch.query_lens, batch.context_lens, batch.cu_seqlens, batch.block_table, slots, scale=0.3)
    assert torch.equal(cache, before)
