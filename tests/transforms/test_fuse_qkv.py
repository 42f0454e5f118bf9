import torch

from autodeploy.testing import check_rewrite
from autodeploy.transforms.fuse_qkv import fuse_sibling_linears

LINEAR = torch.ops.aten.linear.default


class QKV(torch.nn.Module):
    """Llama-style projections (q wider than k/v), each viewed into heads as HF does."""

    def __init__(self, bias=False):
        super().__init__()
        self.q_proj = torch.nn.Linear(32, 32, bias=bias)
        self.k_proj = torch.nn.Linear(32, 16, bias=bias)
        self.v_proj = torch.nn.Linear(32, 16, bias=bias)
        self.o_proj = torch.nn.Linear(32, 32, bias=False)

    def forward(self, x):
        q = self.q_proj(x).view(*x.shape[:-1], -1, 8)
        k = self.k_proj(x).view(*x.shape[:-1], -1, 8)
        v = self.v_proj(x).view(*x.shape[:-1], -1, 8)
        mixed = q * torch.cat([k, v], dim=-2)
        return self.o_proj(mixed.flatten(-2))


def _fuse(gm):
    result, _ = fuse_sibling_linears(gm)
    return result


def test_qkv_becomes_one_gemm():
    check = check_rewrite(QKV(), (torch.randn(1, 5, 32),), _fuse, expected_matches=1,
                          second_inputs=(torch.randn(1, 9, 32),), dynamic={0: 1})
    assert check.count(LINEAR) == 2  # fused qkv + o_proj
    names = dict(check.gm.named_parameters())
    assert tuple(names["fused_q_proj_k_proj_v_proj.weight"].shape) == (64, 32)
    assert not any(n.startswith(("q_proj", "k_proj", "v_proj")) for n in names)


def test_biases_are_stacked_too_and_pieces_name_their_sources():
    module = QKV(bias=True)
    gm_check = check_rewrite(module, (torch.randn(3, 32),), _fuse, expected_matches=1,
                             second_inputs=(torch.randn(7, 32),), dynamic={0: 0})
    assert "fused_q_proj_k_proj_v_proj.bias" in dict(gm_check.gm.named_parameters())
    from autodeploy.testing import export_for_test

    _, fused = fuse_sibling_linears(export_for_test(QKV(bias=True), (torch.randn(3, 32),)))
    assert [p.pieces for p in fused] == [
        (("q_proj.weight", 0, 32), ("k_proj.weight", 32, 48), ("v_proj.weight", 48, 64)),
        (("q_proj.bias", 0, 32), ("k_proj.bias", 32, 48), ("v_proj.bias", 48, 64)),
    ]


def test_shared_weights_mixed_bias_and_claimed_weights_are_left_alone():
    class Shared(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.randn(8, 8))
            self.a = torch.nn.Linear(8, 8, bias=True)
            self.b = torch.nn.Linear(8, 8, bias=False)

        def forward(self, x):
            tied = torch.nn.functional.linear(x, self.w) + torch.nn.functional.linear(x.sin(), self.w)
            return tied + self.a(x) + self.b(x)

    check_rewrite(Shared(), (torch.randn(2, 8),), _fuse, expected_matches=0)
    claimed = lambda gm: fuse_sibling_linears(gm, can_fuse=lambda name: name != "k_proj.weight")[0]  # noqa: E731
    check = check_rewrite(QKV(), (torch.randn(2, 32),), claimed, expected_matches=1)
    assert check.count(LINEAR) == 3  # q+v fused, k alone, o_proj
