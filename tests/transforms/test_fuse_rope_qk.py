import torch

from autodeploy.testing import check_rewrite
from autodeploy.transforms.fuse_rope_qk import fuse_rope_qk

ROPE = torch.ops.autodeploy.rope.default
ROPE_QK = torch.ops.autodeploy.rope_qk.default


class RotatedAttention(torch.nn.Module):
    """What canonicalization leaves of a Llama attention: rope on q and k, then attention."""

    def __init__(self, share_cos=True):
        super().__init__()
        self.share_cos = share_cos

    def forward(self, q, k, v, cos, sin):
        q = torch.ops.autodeploy.rope(q.transpose(1, 2), cos, sin, False)
        k = torch.ops.autodeploy.rope(k.transpose(1, 2), cos if self.share_cos else cos * 2, sin, False)
        out = torch.ops.autodeploy.attention(q.transpose(1, 2), k.transpose(1, 2), v, 0.25, True, None, None)
        return out


def _inputs(seq):
    return (torch.randn(1, seq, 4, 8), torch.randn(1, seq, 2, 8), torch.randn(1, seq, 2, 8),
            torch.randn(1, 1, seq, 8), torch.randn(1, 1, seq, 8))


def test_q_and_k_rotations_fuse():
    check = check_rewrite(RotatedAttention(), _inputs(5), fuse_rope_qk, expected_matches=1)
    assert (check.count(ROPE), check.count(ROPE_QK)) == (0, 1)


def test_different_cos_are_not_fused():
    check = check_rewrite(RotatedAttention(share_cos=False), _inputs(5), fuse_rope_qk, expected_matches=0)
    assert check.count(ROPE) == 2
