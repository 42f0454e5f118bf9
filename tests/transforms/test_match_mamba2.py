"""match_causal_conv1d and match_mamba2_ssd: the counts they must find and what they must leave alone.

HF's own Mamba-2 mixers are matched in the model zoo (bamba, nemotron_h, granitemoehybrid count their
``ssm_scan_cached`` / ``causal_conv1d_cached`` ops there); exporting one here would cost half a minute."""

import pytest
import torch
import torch.nn.functional as F

from autodeploy.testing import check_rewrite
from autodeploy.transforms import match_mamba
from autodeploy.transforms.match_causal_conv1d import MatchCausalConv1d
from autodeploy.transforms.match_mamba import MatchMamba2SSD

ad = torch.ops.autodeploy


class _Scan(torch.nn.Module):
    """One spelling of the SSD scan (the rule's own pattern functions are the eager code)."""

    def __init__(self, fn):
        super().__init__()
        self.fn = fn
        self.A, self.D, self.dt_bias = (torch.nn.Parameter(t) for t in (-torch.rand(4), torch.randn(4), torch.randn(4)))

    def forward(self, x, dt, B, C):
        return self.fn(x, dt, self.A, B, C, self.D, self.dt_bias, 0.001, 100.0)


def _scan_inputs(tokens):
    return (torch.randn(1, tokens, 4, 3), torch.randn(1, tokens, 4), torch.randn(1, tokens, 2, 5),
            torch.randn(1, tokens, 2, 5))


@pytest.mark.parametrize("fn", [match_mamba.ssd_sum_product, match_mamba.ssd_einsum], ids=["sum_product", "einsum"])
def test_both_spellings_of_the_scan_match_and_run_any_length(fn):
    """Exported at fewer tokens than a chunk, as the compiler's 8-token export sees a real model's
    chunks of 128-256 (export specializes the code to one chunk; the zoo runs the replaced scan over
    several)."""
    dyn = {i: 1 for i in range(4)}
    check = check_rewrite(_Scan(fn), _scan_inputs(3), MatchMamba2SSD(), expected_matches=1,
                          second_inputs=_scan_inputs(4), dynamic=dyn)
    (scan,) = check.gm.graph.find_nodes(op="call_function", target=ad.ssm_scan.default)
    clamp = scan.args[1].args[0]
    assert clamp.args[1:] == (0.001, 100.0)  # the time-step limits come from the code, not the pattern


class _Conv(torch.nn.Module):
    def __init__(self, padding, groups=8, keep_first=True):
        super().__init__()
        self.conv = torch.nn.Conv1d(8, 8, 4, padding=padding, groups=groups)
        self.keep_first = keep_first

    def forward(self, x):  # [1, T, C] -> [1, T, C], as the mixers transpose around their convolution
        h = x.transpose(1, 2)
        y = self.conv(h)
        y = y[:, :, : h.shape[-1]] if self.keep_first else y[:, :, -h.shape[-1]:]
        return F.silu(y).transpose(1, 2)


def test_causal_depthwise_conv_matches():
    check = check_rewrite(_Conv(padding=3), (torch.randn(1, 7, 8),), MatchCausalConv1d(), expected_matches=1,
                          second_inputs=(torch.randn(1, 2, 8),), dynamic={0: 1})
    assert check.count(ad.causal_conv1d.default) == 1


@pytest.mark.parametrize("conv", [_Conv(padding=1), _Conv(padding=3, groups=1), _Conv(padding=3, keep_first=False)],
                         ids=["not_causal_padding", "not_depthwise", "keeps_the_last_outputs"])
def test_other_convolutions_are_left_alone(conv):
    check_rewrite(conv, (torch.randn(1, 7, 8),), MatchCausalConv1d(), expected_matches=0,
                  second_inputs=(torch.randn(1, 5, 8),), dynamic={0: 1})
