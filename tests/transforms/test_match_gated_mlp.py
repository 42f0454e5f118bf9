import pytest
import torch
from transformers import AutoConfig
from transformers.models.gemma.modeling_gemma import GemmaMLP
from transformers.models.llama.modeling_llama import LlamaMLP
from transformers.models.phi3.modeling_phi3 import Phi3MLP

from autodeploy.testing import check_rewrite
from autodeploy.transforms.match_gated_mlp import MatchGatedMLP

SWIGLU = torch.ops.autodeploy.swiglu.default
HIDDEN, INTER = 16, 24


def _config(model_type: str, **fields):
    return AutoConfig.for_model(model_type, hidden_size=HIDDEN, intermediate_size=INTER, num_attention_heads=2,
                                 num_key_value_heads=2, head_dim=8, **fields)


def _tokens(n: int) -> tuple[torch.Tensor]:
    return (torch.randn(1, n, HIDDEN),)


def _activation(check) -> str:
    (node,) = [n for n in check.gm.graph.nodes if n.target == SWIGLU]
    return node.args[4]


def test_llama_swiglu():
    check = check_rewrite(LlamaMLP(_config("llama")), _tokens(5), MatchGatedMLP(), expected_matches=1,
                          second_inputs=_tokens(8), dynamic={0: 1})
    assert _activation(check) == "silu"


# transformers 5.25 reads a Gemma config's "gelu" as the tanh approximation (5.17 does not): the exact
# GELU is tested on a Llama MLP, whose config keeps it
@pytest.mark.parametrize("mlp, model_type, act, expected", [
    (GemmaMLP, "gemma", "gelu_pytorch_tanh", "gelu_tanh"), (LlamaMLP, "llama", "gelu", "gelu")])
def test_geglu(mlp, model_type, act, expected):
    check = check_rewrite(mlp(_config(model_type, hidden_act=act)), _tokens(5), MatchGatedMLP(),
                          expected_matches=1, second_inputs=_tokens(3), dynamic={0: 1})
    assert _activation(check) == expected


def test_phi3_fused_gate_up_is_sliced_in_halves():
    check = check_rewrite(Phi3MLP(_config("phi3")), _tokens(5), MatchGatedMLP(), expected_matches=1,
                          second_inputs=_tokens(2), dynamic={0: 1})
    (node,) = [n for n in check.gm.graph.nodes if n.target == SWIGLU]
    gate, up = node.args[1], node.args[2]
    assert (gate.args[2], gate.args[3]) == (0, INTER) and (up.args[2], up.args[3]) == (INTER, 2 * INTER)


def test_two_mlps_in_sequence():
    mlps = torch.nn.Sequential(LlamaMLP(_config("llama")), Phi3MLP(_config("phi3")))
    check = check_rewrite(mlps, _tokens(4), MatchGatedMLP(), expected_matches=2, second_inputs=_tokens(7),
                          dynamic={0: 1})
    assert check.count(SWIGLU) == 2


def test_mlp_with_bias_is_left_alone():
    check_rewrite(LlamaMLP(_config("llama", mlp_bias=True)), _tokens(3), MatchGatedMLP(), expected_matches=0)


def test_ungated_mlp_is_not_a_gated_mlp():
    mlp = torch.nn.Sequential(torch.nn.Linear(HIDDEN, INTER, bias=False), torch.nn.SiLU(),
                              torch.nn.Linear(INTER, HIDDEN, bias=False))
    check_rewrite(mlp, _tokens(3), MatchGatedMLP(), expected_matches=0)


def test_gated_activation_used_elsewhere_is_left_alone():
    class Leaky(LlamaMLP):
        def forward(self, x):
            gated = self.act_fn(self.gate_proj(x))
            return self.down_proj(gated * self.up_proj(x)) + gated.sum(-1, keepdim=True)

    check_rewrite(Leaky(_config("llama")), _tokens(3), MatchGatedMLP(), expected_matches=0)
