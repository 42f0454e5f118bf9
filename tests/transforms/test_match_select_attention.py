"""match_select_attention on the real HF attention modules of GPT-Neo (its causal / local buffer mask
through ``where``, unscaled scores) and MPT (ALiBi bias + ``masked_fill``): exact match counts, equal to
eager on two lengths, the window and the slopes read off the graph, and a selection that is no mask."""

import pytest
import torch
import torch.nn.functional as F
from transformers import GPTNeoConfig, MptConfig
from transformers.models.gpt_neo.modeling_gpt_neo import GPTNeoSelfAttention
from transformers.models.mpt.modeling_mpt import MptAttention, build_mpt_alibi_tensor

from autodeploy.graph.rewrite import apply_rule
from autodeploy.testing import check_rewrite
from autodeploy.transforms.match_select_attention import MatchSelectAttention
from test_match_attention import HIDDEN, additive_mask

ATTENTION = torch.ops.autodeploy.attention.default
HEADS = 4
MAX_POSITIONS = 4096  # the buffers' length, as long as export_for_test's token range (a shorter one fails it)


def _inputs(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(1, n, HIDDEN), torch.arange(n)


class GPTNeoLayers(torch.nn.Module):
    def __init__(self):
        super().__init__()
        config = GPTNeoConfig(hidden_size=HIDDEN, num_heads=HEADS, max_position_embeddings=MAX_POSITIONS,
                              window_size=5, num_layers=2, attention_types=[[["local", "global"], 1]])
        self.attn = torch.nn.ModuleList([GPTNeoSelfAttention(config, kind, layer_id=i)
                                         for i, kind in enumerate(config.attention_layers)])

    def forward(self, x, position_ids):
        for attn in self.attn:
            x = x + attn(x, attention_mask=additive_mask(position_ids, torch.float32))[0]
        return x


class MptLayer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = MptAttention(MptConfig(d_model=HIDDEN, n_heads=HEADS, max_seq_len=MAX_POSITIONS))

    def forward(self, x, position_ids):
        blocked = additive_mask(position_ids, torch.float32) != 0
        return self.attn(x, build_mpt_alibi_tensor(HEADS, MAX_POSITIONS), attention_mask=blocked)[0]


def _attention_nodes(gm):
    return [n for n in gm.graph.nodes if n.target == ATTENTION]


def test_gpt_neo_local_and_global_layers():
    check = check_rewrite(GPTNeoLayers(), _inputs(7), MatchSelectAttention(), expected_matches=2,
                          second_inputs=_inputs(12), dynamic={0: 1, 1: 0})
    flags = [node.args[3:7] for node in _attention_nodes(check.gm)]
    assert flags == [(1.0, True, 5, None), (1.0, True, None, None)]  # unscaled scores; a window of 5, none


def test_mpt_alibi_and_masked_fill():
    check = check_rewrite(MptLayer(), _inputs(7), MatchSelectAttention(), expected_matches=1,
                          second_inputs=_inputs(12), dynamic={0: 1, 1: 0})
    (node,) = _attention_nodes(check.gm)
    assert node.args[3:7] == (pytest.approx(1 / (HIDDEN // HEADS) ** 0.5), True, None, None)
    bias = build_mpt_alibi_tensor(HEADS, 2)  # [H, 1, 2]: slope * (j - 1)
    torch.testing.assert_close(getattr(check.gm, node.kwargs["alibi_slopes"].target), bias[:, 0, 1] - bias[:, 0, 0])


def test_mpt_past_its_bias_length_is_refused():
    """The bias holds MAX_POSITIONS positions: a longer max_seq_len cannot be checked, and is refused."""
    from autodeploy.errors import UnsupportedPatternError
    from autodeploy.testing import export_for_test

    gm = export_for_test(MptLayer(), _inputs(7), {0: 1, 1: 0})
    gm.meta["autodeploy_max_seq_len"] = 2 * MAX_POSITIONS
    with pytest.raises(UnsupportedPatternError, match="position bias .* does not evaluate"):
        apply_rule(gm, MatchSelectAttention(), provenance="test")


def test_a_selection_that_keeps_masked_scores_finite_is_not_a_mask():
    class SelectZero(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.qkv = torch.nn.Linear(HIDDEN, 3 * HIDDEN)

        def forward(self, x, position_ids):
            q, k, v = (t.view(1, -1, HEADS, 8).transpose(1, 2) for t in self.qkv(x).chunk(3, dim=-1))
            causal = additive_mask(position_ids, x.dtype) == 0
            scores = torch.where(causal, torch.matmul(q, k.transpose(-1, -2)), torch.tensor(-1.0))
            probs = F.softmax(scores + additive_mask(position_ids, x.dtype), dim=-1)
            return torch.matmul(probs, v)

    check = check_rewrite(SelectZero(), _inputs(6), MatchSelectAttention(), expected_matches=0,
                          second_inputs=_inputs(9), dynamic={0: 1, 1: 0})
    assert any("masked scores are set to -1.0" in reason for reason in check.result.reasons)
