import pytest
import torch
from transformers.models.llama.modeling_llama import repeat_kv

from autodeploy.testing import check_rewrite
from autodeploy.transforms.match_repeat_kv import MatchRepeatKV

REPEAT_KV = torch.ops.autodeploy.repeat_kv.default


class RepeatKV(torch.nn.Module):
    def __init__(self, n_rep: int):
        super().__init__()
        self.n_rep = n_rep

    def forward(self, k):
        return repeat_kv(k, self.n_rep) * 2.0


def _kv(seq: int, heads: int = 2) -> tuple[torch.Tensor]:
    return (torch.randn(1, heads, seq, 8),)


@pytest.mark.parametrize("n_rep", [2, 4])
def test_hf_repeat_kv_keeps_the_repeat_count(n_rep):
    check = check_rewrite(RepeatKV(n_rep), _kv(5), MatchRepeatKV(), expected_matches=1, second_inputs=_kv(9),
                          dynamic={0: 2})
    (node,) = [n for n in check.gm.graph.nodes if n.target == REPEAT_KV]
    assert node.args[1] == n_rep


def test_no_repeat_for_mha():
    check_rewrite(RepeatKV(1), _kv(5), MatchRepeatKV(), expected_matches=0)


def test_key_and_value_each_repeated():
    class KeyAndValue(torch.nn.Module):
        def forward(self, k, v):
            return repeat_kv(k, 2) + repeat_kv(v, 2)

    check = check_rewrite(KeyAndValue(), _kv(4) + _kv(4), MatchRepeatKV(), expected_matches=2)
    assert check.count(REPEAT_KV) == 2


def test_repeat_along_the_sequence_is_rejected():
    class RepeatSequence(torch.nn.Module):
        def forward(self, k):
            b, h, s, d = k.shape
            return k[:, :, None, :, :].expand(b, h, 2, s, d).reshape(b, h, 2 * s, d)

    result = check_rewrite(RepeatSequence(), _kv(5), MatchRepeatKV(), expected_matches=0).result
    assert result.rejected == 1
