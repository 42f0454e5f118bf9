"""cleanup_graph drops ``x.tensor_split([n], dim)[0]`` when n is the whole dim (transformers 5.25's
Mamba-2 mixers cut their token-shaped inputs at the token count), and keeps a real split."""

import torch

from autodeploy.testing import export_for_test

SPLIT = torch.ops.aten.tensor_split.indices


class CutAt(torch.nn.Module):
    def __init__(self, whole: bool):
        super().__init__()
        self.whole = whole

    def forward(self, x):
        n = x.shape[1] if self.whole else x.shape[1] - 1
        return x.tensor_split([n], dim=1)[0] * 2


def test_a_split_at_the_whole_length_is_the_identity():
    x = torch.randn(1, 6, 4)
    gm = export_for_test(CutAt(whole=True), (x,), {0: 1})
    assert not gm.graph.find_nodes(op="call_function", target=SPLIT)
    torch.testing.assert_close(gm(torch.randn(1, 3, 4) * 0 + 1), torch.full((1, 3, 4), 2.0))


def test_a_real_split_stays():
    gm = export_for_test(CutAt(whole=False), (torch.randn(1, 6, 4),), {0: 1})
    assert gm.graph.find_nodes(op="call_function", target=SPLIT)
    assert gm(torch.ones(1, 5, 4)).shape == (1, 4, 4)
