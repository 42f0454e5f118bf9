import torch
import torch.nn.functional as F

from autodeploy.testing import check_rewrite, pass_runner
from autodeploy.transforms.fuse_norm_linear import fuse_norm_linear

ops = torch.ops.autodeploy
LINEAR = torch.ops.aten.linear.default


class FusedDecoderLayer(torch.nn.Module):
    """What the fuse stage leaves of a pre-norm layer: input norm -> qkv, add + norm -> gate/up,
    add + norm -> a final head that is not a linear's input (a gathered row)."""

    def __init__(self, bias=False):
        super().__init__()
        self.w_in, self.w_post, self.w_final = (torch.nn.Parameter(1 + 0.1 * torch.randn(16)) for _ in range(3))
        self.qkv = torch.nn.Parameter(torch.randn(24, 16) / 4)
        self.qkv_bias = torch.nn.Parameter(torch.randn(24)) if bias else None
        self.o = torch.nn.Parameter(torch.randn(16, 24) / 5)
        self.gate_up = torch.nn.Parameter(torch.randn(32, 16) / 4)
        self.down = torch.nn.Parameter(torch.randn(16, 16) / 4)

    def forward(self, x):
        qkv = F.linear(ops.rms_norm(x, self.w_in, 1e-6), self.qkv, self.qkv_bias)
        normed, summed = ops.fused_add_rms_norm(F.linear(qkv, self.o), x, self.w_post, 1e-6)
        mlp = ops.swiglu_down(F.linear(normed, self.gate_up), self.down, "silu")
        final, _ = ops.fused_add_rms_norm(mlp, summed, self.w_final, 1e-6)
        return final[:, -1:]


def _inputs(tokens):
    return (torch.randn(1, tokens, 16) * 3,)


def test_norms_fold_into_the_linears_they_feed():
    check = check_rewrite(FusedDecoderLayer(bias=True), _inputs(5), fuse_norm_linear, expected_matches=2,
                          second_inputs=_inputs(3), dynamic={0: 1})
    counts = (check.count(ops.rms_norm_linear.default), check.count(ops.add_rms_norm_linear.default),
              check.count(ops.fused_add_rms_norm.default), check.count(ops.rms_norm.default), check.count(LINEAR))
    assert counts == (1, 1, 1, 0, 1)  # the final norm stays; the o projection stays a linear
    assert check.result.rejected == 1 and "other than one linear" in check.result.reasons[0]


def test_a_norm_with_a_second_consumer_stays():
    class SharedNorm(FusedDecoderLayer):
        def forward(self, x):
            normed = ops.rms_norm(x, self.w_in, 1e-6)
            return F.linear(normed, self.qkv) + normed.sum(-1, keepdim=True)

    check = check_rewrite(SharedNorm(), _inputs(4), fuse_norm_linear, expected_matches=0)
    assert check.count(ops.rms_norm.default) == 1 and check.result.rejected == 1


def test_a_norm_feeding_the_weight_side_stays():
    class NormAsWeight(FusedDecoderLayer):
        def forward(self, x):
            return F.linear(self.qkv[:, :16], ops.rms_norm(x[0], self.w_in, 1e-6))

    check = check_rewrite(NormAsWeight(), _inputs(4), fuse_norm_linear, expected_matches=0)
    assert check.count(ops.rms_norm.default) == 1


def test_the_pass_runs_the_rule():
    check = check_rewrite(FusedDecoderLayer(), _inputs(6), pass_runner("fuse_norm_linear"), expected_matches=2)
    assert check.count(ops.add_rms_norm_linear.default) == 1


def test_a_weight_computed_from_the_residual_sum_stays():
    class SumScaledWeight(FusedDecoderLayer):
        def forward(self, x):
            normed, summed = ops.fused_add_rms_norm(x, x * 2, self.w_in, 1e-6)
            return F.linear(normed, self.qkv[:, :16] * summed.mean())

    check = check_rewrite(SumScaledWeight(), _inputs(4), fuse_norm_linear, expected_matches=0)
    assert check.result.reasons and "depends on the norm" in check.result.reasons[0]


def test_an_add_norm_whose_sum_nobody_reads_folds_without_the_sum():
    """The final norm after gather_logits moved the gather above it: its sum has no consumer."""
    class GatheredFinalNorm(FusedDecoderLayer):
        def forward(self, x):
            normed, _ = ops.fused_add_rms_norm(x, x * 0.5, self.w_final, 1e-6)
            return F.linear(normed, self.qkv)

    check = check_rewrite(GatheredFinalNorm(), _inputs(4), fuse_norm_linear, expected_matches=1,
                          second_inputs=_inputs(2), dynamic={0: 1})
    (fused,) = check.gm.graph.find_nodes(op="call_function", target=ops.add_rms_norm_linear.default)
    assert [u.args[1] for u in fused.users] == [0]
    assert check.count(ops.fused_add_rms_norm.default) == 0
