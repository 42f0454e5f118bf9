import torch

from autodeploy.testing import check_rewrite
from autodeploy.transforms.fuse_add_rms_norm import fold_norm_input_casts, fuse_add_rms_norm

RMS = torch.ops.autodeploy.rms_norm.default
FUSED = torch.ops.autodeploy.fused_add_rms_norm.default
CAST = torch.ops.aten.to.dtype


class PreNormBlock(torch.nn.Module):
    """Two residual adds each followed by a norm, as canonicalize_norms leaves a decoder layer;
    ``upcast``: HF's RMSNorm in a half-precision model (norm of an fp32 copy, cast back)."""

    def __init__(self, upcast=False):
        super().__init__()
        self.w1, self.w2 = torch.nn.Parameter(torch.randn(16)), torch.nn.Parameter(torch.randn(16))
        self.upcast = upcast

    def norm(self, h, w):
        if self.upcast:
            return torch.ops.autodeploy.rms_norm(h.to(torch.float32), w, 1e-6).to(h.dtype)
        return torch.ops.autodeploy.rms_norm(h, w, 1e-6)

    def forward(self, x, attn_out):
        h = x + attn_out
        mlp_out = self.norm(h, self.w1).sin()
        h2 = h + mlp_out
        return self.norm(h2, self.w2) * 2 + h2


def test_residual_add_and_norm_fuse():
    inputs = (torch.randn(1, 5, 16), torch.randn(1, 5, 16))
    check = check_rewrite(PreNormBlock(), inputs, fuse_add_rms_norm, expected_matches=2)
    assert (check.count(FUSED), check.count(RMS), check.count(torch.ops.aten.add.Tensor)) == (2, 0, 1)  # the output add


def test_half_precision_norm_reads_the_sum_directly():
    module = PreNormBlock(upcast=True).half()
    inputs = (torch.randn(2, 16).half(), torch.randn(2, 16).half())
    check = check_rewrite(module, inputs, fuse_add_rms_norm, expected_matches=2, atol=0, rtol=0)
    assert check.count(CAST) == 0  # no fp32 copy of the residual, no cast back


def test_norm_consumed_in_fp32_is_not_fused():
    class Fp32Consumer(PreNormBlock):
        def forward(self, x, attn_out):
            h = x + attn_out
            return torch.ops.autodeploy.rms_norm(h.float(), self.w1, 1e-6) + h

    check = check_rewrite(Fp32Consumer().half(), (torch.randn(2, 16).half(), torch.randn(2, 16).half()),
                          fuse_add_rms_norm, expected_matches=0)
    assert check.result.rejected == 1


def test_input_norm_cast_is_folded():
    class InputNorm(PreNormBlock):
        def forward(self, x, unused):
            return self.norm(x * 3, self.w1)

    module = InputNorm(upcast=True).half()
    check = check_rewrite(module, (torch.randn(4, 16).half(), torch.randn(4, 16).half()), fold_norm_input_casts,
                          expected_matches=1, atol=0, rtol=0)
    (norm,) = [n for n in check.gm.graph.nodes if n.target == RMS]
    assert norm.meta["val"].dtype == torch.float16 and check.count(CAST) == 0


class GemmaWeight(torch.nn.Module):
    """The norm weight is computed (``1 + w``) between the residual add and the norm."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(16))

    def forward(self, x, attn_out):
        h = x + attn_out
        return torch.ops.autodeploy.rms_norm(h, 1.0 + self.w.float(), 1e-6) + h


def test_weight_computed_after_the_add_moves_up_with_the_fused_op():
    inputs = (torch.randn(1, 5, 16), torch.randn(1, 5, 16))
    check = check_rewrite(GemmaWeight(), inputs, fuse_add_rms_norm, expected_matches=1,
                          second_inputs=(torch.randn(1, 3, 16), torch.randn(1, 3, 16)), dynamic={0: 1, 1: 1})
    assert check.count(FUSED) == 1
