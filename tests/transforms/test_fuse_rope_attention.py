import pytest
import torch

from autodeploy.kvcache.metadata import BatchMetadata, SequenceChunk
from autodeploy.testing import check_rewrite, pass_runner
from autodeploy.transforms.fuse_rope_attention import fuse_rope_attention

ROPE_QK = torch.ops.autodeploy.rope_qk.default
PAGED = torch.ops.autodeploy.paged_attention.default
PAGED_TRITON = torch.ops.autodeploy.paged_attention_triton.default
HEAD, PAGE = 8, 4


class RotatedPagedAttention(torch.nn.Module):
    """What insert_kv_cache leaves of a Llama attention: rope_qk on [1, H, T, D] views, then the layout
    back to [T, H, D] rows and the paged op. ``layout``/``cos_heads``/``leak`` spell the other cases."""

    def __init__(self, op=torch.ops.autodeploy.paged_attention, layout="llama", interleaved=False, leak=False):
        super().__init__()
        self.op, self.layout, self.interleaved, self.leak = op, layout, interleaved, leak

    def forward(self, q, k, v, cos, sin, query_lens, context_lens, cu_seqlens, block_table, slot_mapping, cache):
        if self.layout == "tokens-first":  # rope on [1, T, H, D] directly, cos [1, T, 1, R]; views to rows
            q, k = torch.ops.autodeploy.rope_qk(q, k, cos.transpose(1, 2), sin.transpose(1, 2), self.interleaved)
            q, k = (t.view(t.shape[1], t.shape[2], HEAD) for t in (q, k))
        else:
            q, k = torch.ops.autodeploy.rope_qk(q.transpose(1, 2), k.transpose(1, 2), cos, sin, self.interleaved)
            if self.layout == "mixed":  # [1, H, T, D] read as [T, H, D] rows: heads and tokens mixed up
                q, k = (t.flatten(0, 2).unflatten(0, (-1, t.shape[1])) for t in (q, k))
            else:
                q, k = q.transpose(1, 2).squeeze(0), k.transpose(1, 2).squeeze(0)
        out = self.op(q, k, v.squeeze(0), cache, query_lens, context_lens, cu_seqlens, block_table, slot_mapping,
                      scale=0.3)
        return (out, k) if self.leak else out


def _inputs(chunks, heads=4, kv_heads=2, rot_dim=HEAD, cos_heads=1):
    """q/k/v [1, T, H, D], cos/sin [1, cos_heads, T, R], metadata of (context, new tokens) chunks, a cache."""
    seqs, first = [], 0
    for context, new in chunks:
        blocks = -(-(context + new) // PAGE)
        seqs.append(SequenceChunk(tuple([0] * new), context, tuple(range(first, first + blocks))))
        first += blocks
    meta = BatchMetadata.build(seqs, PAGE, "cpu")
    tokens = meta.slot_mapping.shape[0]
    positions = torch.cat([torch.arange(c, c + n) for c, n in chunks]).float()
    angles = positions[None, None, :, None] * torch.linspace(0.1, 1.0, rot_dim) + torch.zeros(1, cos_heads, 1, 1)
    return (torch.randn(1, tokens, heads, HEAD), torch.randn(1, tokens, kv_heads, HEAD),
            torch.randn(1, tokens, kv_heads, HEAD), angles.cos(), angles.sin(), meta.query_lens, meta.context_lens,
            meta.cu_seqlens, meta.block_table, meta.slot_mapping, torch.randn(16, 2, PAGE, kv_heads, HEAD))


DYNAMIC = {0: 1, 1: 1, 2: 1, 3: 2, 4: 2, 9: 0}  # the token dimension of each input
# (context, new tokens) per sequence: 8 and 10 tokens; sequence count and block-table width are static
FIRST, SECOND = [(3, 2), (0, 5), (6, 1)], [(0, 6), (6, 1), (2, 3)]


def _check(module, expected_matches, **shape):
    return check_rewrite(module, _inputs(FIRST, **shape), fuse_rope_attention, expected_matches=expected_matches,
                         second_inputs=_inputs(SECOND, **shape), dynamic=DYNAMIC)


def _fused(check):
    (node,) = [n for n in check.gm.graph.nodes if n.target in (PAGED, PAGED_TRITON)]
    return node


def test_llama_layout_folds_into_the_attention():
    check = _check(RotatedPagedAttention(), 1)
    assert (check.count(ROPE_QK), check.count(PAGED)) == (0, 1)
    node = _fused(check)
    assert node.kwargs["rope_cos"].meta["val"].shape[-1] == HEAD and node.kwargs["rope_interleaved"] is False


def test_the_cache_holds_the_rotated_keys():
    check = _check(RotatedPagedAttention(), 1)
    args = _inputs(FIRST)
    eager_cache, graph_cache = args[-1].clone(), args[-1].clone()
    RotatedPagedAttention()(*args[:-1], eager_cache)
    check.gm(*args[:-1], graph_cache)
    torch.testing.assert_close(graph_cache, eager_cache, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("interleaved", [False, True])
def test_views_partial_rotary_and_the_layout_flag(interleaved):
    check = _check(RotatedPagedAttention(layout="tokens-first", interleaved=interleaved), 1, rot_dim=4)
    assert check.count(ROPE_QK) == 0 and _fused(check).kwargs["rope_interleaved"] is interleaved


def test_the_triton_backend_op_folds_too():
    """Eager: rope_qk, then the Triton attention (interpreter); folded: the kernel rotates q and k."""
    check = _check(RotatedPagedAttention(op=torch.ops.autodeploy.paged_attention_triton), 1, heads=4, kv_heads=1)
    assert check.count(ROPE_QK) == 0 and _fused(check).target == PAGED_TRITON


def test_attention_without_rope_is_left_alone():
    class Plain(torch.nn.Module):
        def forward(self, q, k, v, cos, sin, query_lens, context_lens, cu_seqlens, block_table, slot_mapping, cache):
            return torch.ops.autodeploy.paged_attention(q[0], k[0], v[0], cache, query_lens, context_lens, cu_seqlens,
                                                        block_table, slot_mapping, scale=0.3)

    check = _check(Plain(), 0)
    assert check.result.rejected == 0 and check.count(PAGED) == 1


@pytest.mark.parametrize("module,shape,reason", [
    (RotatedPagedAttention(layout="mixed"), {}, "beyond size-1 dims"),
    (RotatedPagedAttention(), {"kv_heads": 4, "cos_heads": 4}, "varies along dim 1"),
    (RotatedPagedAttention(leak=True), {}, "read by more than the attention"),
], ids=["heads-and-tokens-mixed", "cos-per-head", "rotated-k-read-elsewhere"])
def test_unsupported_cases_are_rejected_with_a_reason(module, shape, reason):
    check = _check(module, 0, **shape)
    assert check.result.rejected == 1 and reason in check.result.reasons[0]
    assert check.count(ROPE_QK) == 1 and "rope_cos" not in _fused(check).kwargs


def _fp8_pool(inputs):
    """``inputs`` with the cache as an FP8 (e4m3) pool of the same values."""
    return (*inputs[:-1], inputs[-1].to(torch.float8_e4m3fn))


@pytest.mark.parametrize("fp8_pools", [False, True])
def test_an_fp8_pool_keeps_its_rope_qk_unless_asked(fp8_pools):
    """Over an FP8 pool the kernel with RoPE keeps more registers (fewer programs an SM): the rotation stays a
    rope_qk by default; ``fp8_pools=True`` folds it as over any pool. Both compute the eager graph's values."""
    module, matches = RotatedPagedAttention(), int(fp8_pools)
    check = check_rewrite(module, _fp8_pool(_inputs(FIRST)), lambda gm: fuse_rope_attention(gm, fp8_pools=fp8_pools),
                          expected_matches=matches, second_inputs=_fp8_pool(_inputs(SECOND)), dynamic=DYNAMIC)
    assert check.count(ROPE_QK) == 1 - matches and ("rope_cos" in _fused(check).kwargs) is fp8_pools
    assert check.result.rejected == 1 - matches
    assert fp8_pools or "FP8" in check.result.reasons[0]


def test_a_wider_pool_folds_whatever_fp8_pools_says():
    check = check_rewrite(RotatedPagedAttention(), _inputs(FIRST), lambda gm: fuse_rope_attention(gm, fp8_pools=False),
                          expected_matches=1, second_inputs=_inputs(SECOND), dynamic=DYNAMIC)
    assert check.count(ROPE_QK) == 0


def test_the_pass_leaves_fp8_pools_by_default_and_says_why(caplog):
    runner = pass_runner("fuse_rope_attention")
    with caplog.at_level("INFO", logger="autodeploy"):
        check = check_rewrite(RotatedPagedAttention(), _fp8_pool(_inputs(FIRST)), runner, expected_matches=0,
                              second_inputs=_fp8_pool(_inputs(SECOND)), dynamic=DYNAMIC)
    assert check.count(ROPE_QK) == 1 and "1 rejected, 1 left (paged_attention: its KV pool is FP8" in caplog.text
    folded = pass_runner("fuse_rope_attention", fp8_pools=True)
    folded_check = check_rewrite(RotatedPagedAttention(), _fp8_pool(_inputs(FIRST)), folded, expected_matches=1)
    assert folded_check.count(ROPE_QK) == 0


def test_the_pass_reports_what_it_folded():
    check = check_rewrite(RotatedPagedAttention(), _inputs(FIRST), pass_runner("fuse_rope_attention"),
                          expected_matches=1, second_inputs=_inputs(SECOND), dynamic=DYNAMIC)
    assert check.count(ROPE_QK) == 0
