import torch
import torch.nn.functional as F

from autodeploy.testing import check_rewrite, pass_runner
from autodeploy.transforms.decode_linear import use_decode_linear

ops = torch.ops.autodeploy
LINEAR = torch.ops.aten.linear.default


class AttentionOutputAndHead(torch.nn.Module):
    """The linears fuse_norm_linear leaves: an output projection (no bias) and a head with a bias,
    next to a fused norm-linear that the rule must leave alone."""

    def __init__(self):
        super().__init__()
        self.norm_w = torch.nn.Parameter(1 + 0.1 * torch.randn(16))
        self.qkv = torch.nn.Parameter(torch.randn(24, 16) / 4)
        self.o = torch.nn.Parameter(torch.randn(16, 24) / 5)
        self.head = torch.nn.Parameter(torch.randn(40, 16) / 4)
        self.head_bias = torch.nn.Parameter(torch.randn(40))

    def forward(self, x):
        qkv = ops.rms_norm_linear(x, self.norm_w, 1e-6, self.qkv, None)
        return F.linear(F.linear(qkv, self.o) + x, self.head, self.head_bias)


def _inputs(tokens):
    return (torch.randn(1, tokens, 16),)


def test_plain_linears_become_the_decode_linear_op():
    check = check_rewrite(AttentionOutputAndHead(), _inputs(5), use_decode_linear, expected_matches=2,
                          second_inputs=_inputs(1), dynamic={0: 1}, atol=0, rtol=0)  # F.linear on the CPU
    assert (check.count(LINEAR), check.count(ops.linear.default), check.count(ops.rms_norm_linear.default)) == (0, 2, 1)
    head = next(n for n in check.gm.graph.nodes if n.target == ops.linear.default and n.args[2] is not None)
    assert head.meta["autodeploy_provenance"] == "decode_linear" and tuple(head.meta["val"].shape)[-1] == 40


def test_a_graph_without_linears_is_left_alone():
    class NoLinear(torch.nn.Module):
        def forward(self, x):
            return x * 2

    check = check_rewrite(NoLinear(), _inputs(3), use_decode_linear, expected_matches=0)
    assert check.count(ops.linear.default) == 0


def test_the_pass_runs_the_rule():
    check = check_rewrite(AttentionOutputAndHead(), _inputs(4), pass_runner("decode_linear"), expected_matches=2)
    assert check.count(LINEAR) == 0
