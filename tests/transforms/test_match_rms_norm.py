import torch

from autodeploy.testing import check_rewrite
from autodeploy.transforms.match_rms_norm import MatchRMSNorm

RMS = torch.ops.autodeploy.rms_norm.default


class LlamaStyle(torch.nn.Module):
    def __init__(self, dim=16, eps=1e-6):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(dim))
        self.eps = eps

    def forward(self, x):
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


class GemmaStyle(LlamaStyle):
    def forward(self, x):
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * (1.0 + self.weight.float())).type_as(x)


class TwoNorms(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b, self.proj = LlamaStyle(eps=1e-5), GemmaStyle(), torch.nn.Linear(16, 16)

    def forward(self, x):
        return self.b(self.proj(self.a(x))) + x


def test_llama_rms_norm_matches_and_keeps_eps():
    check = check_rewrite(LlamaStyle(), (torch.randn(2, 5, 16),), MatchRMSNorm(), expected_matches=1,
                          second_inputs=(torch.randn(2, 9, 16),), dynamic={0: 1})
    (node,) = [n for n in check.gm.graph.nodes if n.target == RMS]
    assert node.args[2] == 1e-6


def test_gemma_one_plus_weight_and_two_norms():
    check = check_rewrite(TwoNorms(), (torch.randn(1, 4, 16),), MatchRMSNorm(), expected_matches=2,
                          second_inputs=(torch.randn(1, 7, 16),), dynamic={0: 1})
    assert check.count(RMS) == 2


def test_layer_norm_is_not_an_rms_norm():
    ln = torch.nn.LayerNorm(16)
    check_rewrite(ln, (torch.randn(3, 16),), MatchRMSNorm(), expected_matches=0)


def test_norm_with_shared_intermediate_is_left_alone():
    class Leaky(LlamaStyle):
        def forward(self, x):
            h = x.to(torch.float32)
            var = h.pow(2).mean(-1, keepdim=True)
            return self.weight * (h * torch.rsqrt(var + self.eps)).to(x.dtype) + var  # var used outside

    check_rewrite(Leaky(), (torch.randn(2, 16),), MatchRMSNorm(), expected_matches=0)
