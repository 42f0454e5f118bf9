"""match_bmm_attention on the real HF attention modules of XGLM (clamped bmm attention) and Bloom
(ALiBi through baddbmm): exact match counts, equal to eager on two lengths, the slopes read off the
bias, and the spellings it must not take."""

import pytest
import torch
import torch.nn.functional as F
from transformers import BloomConfig
from transformers.models.bloom.modeling_bloom import BloomAttention, build_alibi_tensor
from transformers.models.xglm.modeling_xglm import XGLMAttention

from autodeploy.graph.rewrite import apply_rule
from autodeploy.testing import check_rewrite
from autodeploy.transforms.match_bmm_attention import MatchBmmAttention
from test_match_attention import HIDDEN, additive_mask

ATTENTION = torch.ops.autodeploy.attention.default
HEADS = 4


def _inputs(n: int, hidden: int = HIDDEN) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(1, n, hidden), torch.arange(n)


class XGLMLayers(torch.nn.Module):
    def __init__(self, layers: int = 1):
        super().__init__()
        self.attn = torch.nn.ModuleList([XGLMAttention(HIDDEN, HEADS, layer_idx=i) for i in range(layers)])

    def forward(self, x, position_ids):
        mask = additive_mask(position_ids, x.dtype).expand(x.shape[0], -1, -1, -1)
        for attn in self.attn:
            x = x + attn(x, attention_mask=mask)[0]
        return x


class BloomLayers(torch.nn.Module):
    """Bloom's attention blocks sharing one ALiBi tensor, built from the (all-ones) padding mask as the
    model builds it."""

    def __init__(self, layers: int = 1, heads: int = HEADS):
        super().__init__()
        config = BloomConfig(hidden_size=8 * heads, n_head=heads)
        self.heads = heads
        self.attn = torch.nn.ModuleList([BloomAttention(config, layer_idx=i) for i in range(layers)])

    def forward(self, x, position_ids):
        alibi = build_alibi_tensor(torch.ones(1, x.shape[1]), self.heads, x.dtype)
        mask = additive_mask(position_ids, x.dtype)
        for attn in self.attn:
            x = attn(x, torch.zeros_like(x), alibi, mask)[0]
        return x


def _attention_nodes(gm):
    return [n for n in gm.graph.nodes if n.target == ATTENTION]


@pytest.mark.parametrize("layers", [1, 2])
def test_xglm_attention(layers):
    check = check_rewrite(XGLMLayers(layers), _inputs(6), MatchBmmAttention(), expected_matches=layers,
                          second_inputs=_inputs(11), dynamic={0: 1, 1: 0})
    node = _attention_nodes(check.gm)[0]
    assert node.args[3:7] == (1.0, True, None, None)  # q is scaled before the bmm
    assert check.count(torch.ops.aten.bmm.default) == 0


@pytest.mark.parametrize("heads", [4, 6], ids=["power-of-two-heads", "six-heads"])
def test_bloom_alibi_slopes_are_read_off_the_bias(heads):
    check = check_rewrite(BloomLayers(2, heads), _inputs(6, 8 * heads), MatchBmmAttention(), expected_matches=2,
                          second_inputs=_inputs(13, 8 * heads), dynamic={0: 1, 1: 0})
    nodes = _attention_nodes(check.gm)
    slopes = {n.kwargs["alibi_slopes"].target for n in nodes}
    assert len(slopes) == 1  # one buffer for the layers' shared bias
    got = getattr(check.gm, slopes.pop())
    want = build_alibi_tensor(torch.ones(1, 2), heads, torch.float32)[:, 0, 1]  # slope * position 1
    torch.testing.assert_close(got, want)
    assert nodes[0].args[3] == pytest.approx(1 / 8 ** 0.5)


def test_bmm_attention_of_several_batch_rows_is_not_taken():
    """Batch 2: the bmm operands hold 2 x heads rows, not the heads of one sequence."""
    module = XGLMLayers()
    x = torch.randn(2, 6, HIDDEN)
    check = check_rewrite(module, (x, torch.arange(6)), MatchBmmAttention(), expected_matches=0)
    assert any("one batch row" in reason for reason in check.result.reasons)


def test_a_clamp_above_the_lowest_value_is_not_attention():
    class Clamped(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.q = torch.nn.Linear(HIDDEN, HIDDEN)

        def forward(self, x, position_ids):
            q = self.q(x).view(1, -1, HEADS, 8).transpose(1, 2).reshape(HEADS, -1, 8)
            scores = torch.bmm(q, q.transpose(1, 2)).view(1, HEADS, x.shape[1], -1) + additive_mask(position_ids,
                                                                                                     x.dtype)
            scores = torch.max(scores, torch.full((), -5.0))
            probs = F.softmax(scores.view(HEADS, x.shape[1], -1), dim=-1)
            return torch.bmm(probs.view(1, HEADS, x.shape[1], -1).view(HEADS, x.shape[1], -1), q)

    check = check_rewrite(Clamped(), _inputs(6), MatchBmmAttention(), expected_matches=0,
                          second_inputs=_inputs(9), dynamic={0: 1, 1: 0})
    assert any("clamped at -5.0" in reason for reason in check.result.reasons)


def test_no_bmm_attention_no_match():
    gm_module = torch.nn.Sequential(torch.nn.Linear(HIDDEN, 8), torch.nn.Softmax(dim=-1))
    from autodeploy.testing import export_for_test

    gm = export_for_test(gm_module, (torch.randn(3, HIDDEN),))
    assert apply_rule(gm, MatchBmmAttention(), provenance="test").matches == 0
