"""match_sink_attention: gpt-oss's eager attention with learned sinks -> canonical attention with ``sinks``."""

import pytest
import torch
import torch.nn.functional as F
from test_match_attention import HEAD_DIM, Attention, _inputs, after_repeat_kv
from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

from autodeploy.testing import check_rewrite
from autodeploy.transforms.match_attention import MatchEagerAttention
from autodeploy.transforms.match_sink_attention import MatchSinkAttention

ATTENTION = torch.ops.autodeploy.attention.default


class SinkAttention(Attention):
    """gpt-oss's own eager attention (sinks appended to the scores, the row maximum subtracted)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.sinks = torch.nn.Parameter(torch.randn(self.heads) * 2)

    def attend(self, q, k, v, mask):
        out, _ = eager_attention_forward(self, q, k, v, mask, scaling=HEAD_DIM**-0.5)
        return out


class UnstabilizedSinks(SinkAttention):
    """The same without the max subtraction, unmasked (both spellings are patterns)."""

    def attend(self, q, k, v, mask):
        scores = torch.matmul(q, k.transpose(2, 3)) * 0.3
        sinks = self.sinks.reshape(1, -1, 1, 1).expand(q.shape[0], q.shape[1], q.shape[-2], -1)
        probs = F.softmax(torch.cat([scores, sinks], dim=-1), dim=-1, dtype=torch.float32)[..., :-1]
        return torch.matmul(probs.to(v.dtype), v).transpose(1, 2)


def _sink_node(module, n=(6, 15)):
    check = check_rewrite(module, _inputs(n[0]), after_repeat_kv(MatchSinkAttention()), expected_matches=1,
                          second_inputs=_inputs(n[1]), dynamic={0: 1, 1: 0})
    (node,) = [n for n in check.gm.graph.nodes if n.target == ATTENTION]
    return node


@pytest.mark.parametrize("kv_heads", [4, 2], ids=["mha", "gqa"])
def test_gpt_oss_eager_attention_with_sinks(kv_heads):
    node = _sink_node(SinkAttention(kv_heads=kv_heads))
    assert node.args[3:6] == (HEAD_DIM**-0.5, True, None)
    assert node.kwargs["sinks"].op == "get_attr" and node.kwargs["sinks"].target == "sinks"


def test_sliding_window_layer_keeps_its_window_and_sinks():
    node = _sink_node(SinkAttention(kv_heads=2, window=4))
    assert node.args[4:6] == (True, 4) and "sinks" in node.kwargs


def test_unmasked_sinks_without_the_max_subtraction():
    node = _sink_node(UnstabilizedSinks(masked=False))
    assert node.args[3:5] == (0.3, False) and "sinks" in node.kwargs


def test_plain_eager_rule_leaves_sink_attention_alone():
    check_rewrite(SinkAttention(), _inputs(6), after_repeat_kv(MatchEagerAttention()), expected_matches=0)


def test_sinks_that_are_not_one_per_head_are_rejected():
    class SharedSink(UnstabilizedSinks):
        def __init__(self):
            super().__init__(masked=False)
            self.sinks = torch.nn.Parameter(torch.randn(1))

    result = check_rewrite(SharedSink(), _inputs(6), MatchSinkAttention(), expected_matches=0).result
    assert any("expected one per head" in r for r in result.reasons)
