"""autodeploy's ExpertsInterface entry: MoE experts export as ``autodeploy::moe`` where the op computes
them, through transformers' ``batched_mm`` code (for match_moe) where it does not."""

from types import SimpleNamespace

import pytest
import torch
from transformers import AutoModelForCausalLM
from transformers.activations import ACT2FN
from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS, use_experts_implementation

from autodeploy import hf_experts
from autodeploy.errors import ExportError, PassError
from autodeploy.export import export_model
from autodeploy.graph.matcher import schema_values
from autodeploy.model_loading import build_meta_model
from autodeploy.testing import export_for_test, pass_runner
from autodeploy.tiny import tiny_config

MOE = torch.ops.autodeploy.moe.default
ZOO_MOE = ("mixtral", "qwen3_moe", "qwen2_moe", "olmoe", "granitemoe", "phimoe")
HIDDEN, EXPERTS, TOP_K, INTER = 16, 4, 2, 8


def _first_experts(model: torch.nn.Module) -> torch.nn.Module:
    return next(m for m in model.modules() if hf_experts.is_experts_module(m))


def _routing(tokens: int, experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.stack([torch.randperm(experts)[:TOP_K] for _ in range(tokens)])
    return ids, torch.rand(tokens, TOP_K)


@pytest.mark.parametrize("model_type", ZOO_MOE)
def test_direct_moe_equals_transformers_batched_mm(model_type):
    torch.manual_seed(0)
    hf_experts.register()
    config = tiny_config(model_type)
    config._experts_implementation = hf_experts.IMPLEMENTATION
    experts = _first_experts(AutoModelForCausalLM.from_config(config).eval())
    hf_experts.plan_experts(experts)
    assert hf_experts._PLANS[experts] == hf_experts.ExpertsPlan("silu")
    x = torch.randn(7, config.hidden_size)
    ids, weights = _routing(7, experts.gate_up_proj.shape[0])
    with torch.no_grad():
        want = ALL_EXPERTS_FUNCTIONS[hf_experts.FALLBACK](experts, x, ids, weights)
        got = experts(x, ids, weights)  # dispatched by transformers to autodeploy's implementation
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_exported_mixtral_has_moe_ops_before_any_rule_ran():
    model, _ = build_meta_model(tiny_config("mixtral"), torch.float32, "eager")
    gm = export_model(model)
    assert len(gm.graph.find_nodes(op="call_function", target=MOE)) == 2
    assert not gm.graph.find_nodes(op="call_function", target=torch.ops.aten.bmm.default)


@pytest.mark.parametrize("hidden_act, name", [("silu", "silu"), ("gelu", "gelu"),
                                               ("gelu_pytorch_tanh", "gelu_tanh"), ("relu", None)])
def test_activation_is_identified_by_evaluation(hidden_act, name):
    assert hf_experts.activation_name(ACT2FN[hidden_act]) == name


@use_experts_implementation(has_bias=True)
class BiasedExperts(torch.nn.Module):
    """A decorated experts class with biases and the given activation (relu: one the op lacks)."""

    def __init__(self, config, act="silu"):
        super().__init__()
        self.num_experts = EXPERTS
        self.gate_up_proj = torch.nn.Parameter(torch.randn(EXPERTS, 2 * INTER, HIDDEN) * 0.3)
        self.gate_up_proj_bias = torch.nn.Parameter(torch.randn(EXPERTS, 2 * INTER))
        self.down_proj = torch.nn.Parameter(torch.randn(EXPERTS, HIDDEN, INTER) * 0.3)
        self.down_proj_bias = torch.nn.Parameter(torch.randn(EXPERTS, HIDDEN))
        self.act_fn = ACT2FN[act]

    def forward(self, hidden_states, top_k_index, top_k_weights):
        raise AssertionError("transformers dispatches to the registered implementation")


class Block(torch.nn.Module):
    def __init__(self, act="silu"):
        super().__init__()
        self.router = torch.nn.Linear(HIDDEN, EXPERTS, bias=False)
        self.experts = BiasedExperts(SimpleNamespace(_experts_implementation=hf_experts.IMPLEMENTATION), act)

    def forward(self, x):
        weights, ids = torch.topk(torch.softmax(self.router(x), dim=-1), TOP_K, dim=-1)
        return self.experts(x, ids, weights)


def test_biased_experts_export_as_moe():
    hf_experts.register()
    block = Block().eval()
    hf_experts.plan_experts(block)
    assert hf_experts._PLANS[block.experts] == hf_experts.ExpertsPlan("silu")
    x = torch.randn(5, HIDDEN)
    gm = export_for_test(block, (x,), {0: 0})
    (moe,) = gm.graph.find_nodes(op="call_function", target=MOE)
    args = dict(schema_values(moe))
    assert args["b_gate_up"] is not None and args["b_down"] is not None
    with torch.no_grad():
        want = ALL_EXPERTS_FUNCTIONS[hf_experts.FALLBACK](block.experts, x, *_routing_of(block, x))
    torch.testing.assert_close(gm(x), want, rtol=1e-5, atol=1e-5)


def _routing_of(block, x):
    weights, ids = torch.topk(torch.softmax(block.router(x), dim=-1), TOP_K, dim=-1)
    return ids, weights


def test_gpt_oss_experts_export_as_moe_with_clamped_swiglu():
    """Transposed, interleaved gate/up, biases, clamped SwiGLU: the op equals transformers' batched_mm
    and gpt-oss's own loop (the eager reference), with gates driven past the clamp limit."""
    torch.manual_seed(0)
    hf_experts.register()
    config = tiny_config("gpt_oss", num_local_experts=EXPERTS, num_experts_per_tok=TOP_K)
    config._experts_implementation = hf_experts.IMPLEMENTATION
    experts = _first_experts(AutoModelForCausalLM.from_config(config).eval())
    with torch.no_grad():
        for p in experts.parameters():
            p.normal_(0.0, 1.5)  # projections well past the clamp limit of 7
    hf_experts.plan_experts(experts)
    plan = hf_experts._PLANS[experts]
    assert (plan.activation, plan.interleaved, plan.swiglu_alpha, plan.swiglu_limit) == (
        "clamped_swiglu", True, experts.alpha, experts.limit)
    x = torch.randn(9, config.hidden_size) * 3
    ids, weights = _routing(9, EXPERTS)
    with torch.no_grad():
        got = experts(x, ids, weights)
        want = ALL_EXPERTS_FUNCTIONS[hf_experts.FALLBACK](experts, x, ids, weights)
        config._experts_implementation = "eager"
        eager = experts(x, ids, weights)  # gpt-oss's own per-expert loop
    scale = want.abs().max().item()
    assert scale > 10
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6 * scale)
    torch.testing.assert_close(got, eager, rtol=1e-5, atol=1e-6 * scale)


def test_gate_the_op_cannot_compute_falls_back_and_the_pass_names_its_module():
    hf_experts.register()
    block = Block(act="relu").eval()
    hf_experts.plan_experts(block)
    assert hf_experts._PLANS[block.experts].activation is None
    assert "gate function (BiasedExperts._apply_gate with act_fn ReLU" in hf_experts._PLANS[block.experts].fallback_reason
    x = torch.randn(5, HIDDEN)
    gm = export_for_test(block, (x,), {0: 0})
    torch.testing.assert_close(gm(x), block(x))  # transformers' batched_mm code, exported as is
    gm.meta["autodeploy_experts_modules"] = ("experts",)
    run = pass_runner("canonicalize_moe", rules=["match_moe"])
    with pytest.raises(PassError, match=r"the MoE experts layer in experts \(BiasedExperts\) is not supported"):
        run(gm)


def test_experts_module_without_a_plan_fails_the_export():
    hf_experts.register()
    experts = BiasedExperts(SimpleNamespace(_experts_implementation=hf_experts.IMPLEMENTATION))
    with pytest.raises(ExportError, match="without a plan"):
        experts(torch.randn(3, HIDDEN), *_routing(3, EXPERTS))


def test_changed_interface_contract_fails_loudly():
    config = tiny_config("mixtral")
    config._experts_implementation = hf_experts.IMPLEMENTATION
    hf_experts.register()
    experts = _first_experts(AutoModelForCausalLM.from_config(config))
    hf_experts.plan_experts(experts)
    ids, weights = _routing(3, EXPERTS)
    with pytest.raises(ExportError, match="ExpertsInterface contract changed"):
        experts(torch.randn(1, 3, config.hidden_size), ids, weights)  # [B, T, H] instead of [T, H]
