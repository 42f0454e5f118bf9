"""match_gated_rms_norm: HF's gated RMSNorm over token-head rows -> ``rms_norm`` per head times ``silu(z)``.

The module under test is transformers' own ``Qwen3NextRMSNormGated`` with the flattening its Gated
DeltaNet layer wraps it in; the zero-match cases are a gated norm without the flattening, and one whose
result is reshaped to another shape than its input's (rejected by the rule's check)."""

import pytest
import torch
from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextRMSNormGated

from autodeploy.graph.token_flow import token_mixing
from autodeploy.testing import check_rewrite
from autodeploy.transforms.match_gated_rms_norm import MatchGatedRMSNorm

ad = torch.ops.autodeploy
HEADS, HEAD_DIM = 4, 16


class _GatedOutput(torch.nn.Module):
    """[1, T, H, V] activations and gate -> [1, T, H * V], as ``Qwen3NextGatedDeltaNet.forward`` ends."""

    def __init__(self, flatten_rows: bool = True, back_to: str = "input"):
        super().__init__()
        self.norm = Qwen3NextRMSNormGated(HEAD_DIM, eps=1e-6)
        with torch.no_grad():
            self.norm.weight.copy_(torch.randn(HEAD_DIM))
        self.flatten_rows, self.back_to = flatten_rows, back_to

    def forward(self, x, z):
        if not self.flatten_rows:
            return self.norm(x, z).flatten(2)
        out = self.norm(x.reshape(-1, x.shape[-1]), z.reshape(-1, z.shape[-1]))
        out = out.reshape(z.shape) if self.back_to == "input" else out.reshape(z.shape[0], z.shape[1], -1)
        return out.reshape(out.shape[0], out.shape[1], -1)


def _inputs(tokens: int):
    return torch.randn(1, tokens, HEADS, HEAD_DIM), torch.randn(1, tokens, HEADS, HEAD_DIM)


def test_the_flattened_gated_norm_becomes_a_per_head_rms_norm():
    check = check_rewrite(_GatedOutput(), _inputs(5), MatchGatedRMSNorm(), expected_matches=1,
                          second_inputs=_inputs(9), dynamic={0: 1, 1: 1})
    assert check.count(ad.rms_norm.default) == 1
    assert token_mixing(check.gm) == []  # no row count of H * T left to prove


@pytest.mark.parametrize("module", [_GatedOutput(flatten_rows=False), _GatedOutput(back_to="tokens")],
                         ids=["not_flattened", "reshaped_to_another_shape"])
def test_other_spellings_are_left_alone(module):
    check_rewrite(module, _inputs(5), MatchGatedRMSNorm(), expected_matches=0, second_inputs=_inputs(9),
                  dynamic={0: 1, 1: 1})
