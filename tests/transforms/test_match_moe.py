import pytest
import torch
import torch.nn.functional as F
from transformers import AutoConfig
from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

from autodeploy.errors import PassError
from autodeploy.testing import check_rewrite, export_for_test, pass_runner
from autodeploy.transforms.match_moe import MatchMoE

MOE = torch.ops.autodeploy.moe.default
HIDDEN, EXPERTS, TOP_K, INTER = 16, 4, 2, 8


def _hf_block(block_cls, model_type: str, **fields) -> torch.nn.Module:
    """A real HF sparse-MoE block with the experts code path the compiler exports (batched_mm)."""
    config = AutoConfig.for_model(model_type, hidden_size=HIDDEN, num_experts=EXPERTS,
                                  num_experts_per_tok=TOP_K, **fields)
    config._experts_implementation = "batched_mm"
    block = block_cls(config)
    for param in block.parameters():
        torch.nn.init.normal_(param, std=0.5)
    return block.eval()


def _tokens(n: int) -> tuple[torch.Tensor]:
    return (torch.randn(1, n, HIDDEN),)


class BatchedExperts(torch.nn.Module):
    """transformers' batched_mm experts after a softmax/top-k router, with a configurable
    activation and expert-id clamp (to build near-misses; None: no clamp, as transformers >= 5.2x)."""

    def __init__(self, act=F.silu, clamp_max: int | None = EXPERTS - 1, repeats=TOP_K):
        super().__init__()
        self.router = torch.nn.Parameter(torch.randn(EXPERTS, HIDDEN))
        self.gate_up_proj = torch.nn.Parameter(torch.randn(EXPERTS, 2 * INTER, HIDDEN) * 0.3)
        self.down_proj = torch.nn.Parameter(torch.randn(EXPERTS, HIDDEN, INTER) * 0.3)
        self.act, self.clamp_max, self.repeats = act, clamp_max, repeats

    def forward(self, x):
        weights, ids = torch.topk(F.softmax(F.linear(x, self.router), dim=-1), TOP_K, dim=-1)
        selected = x.repeat_interleave(self.repeats, dim=0)
        ids = ids.reshape(-1)
        if self.clamp_max is not None:
            ids = ids.clamp(0, self.clamp_max)
        gate, up = torch.bmm(self.gate_up_proj[ids], selected.unsqueeze(-1)).squeeze(-1).chunk(2, dim=-1)
        out = torch.bmm(self.down_proj[ids], (self.act(gate) * up).unsqueeze(-1)).squeeze(-1)
        out = out * weights.reshape(-1).unsqueeze(-1)
        return out.view(x.shape[0], TOP_K, HIDDEN).sum(dim=1)


def test_mixtral_block_becomes_one_moe_op():
    block = _hf_block(MixtralSparseMoeBlock, "mixtral", intermediate_size=INTER)
    check = check_rewrite(block, _tokens(5), MatchMoE(), expected_matches=1, second_inputs=_tokens(11),
                          dynamic={0: 1})
    (node,) = [n for n in check.gm.graph.nodes if n.target == MOE]
    assert node.args[5] == "silu"
    assert not [n for n in check.gm.graph.nodes if n.target == torch.ops.aten.bmm.default]


def test_qwen3_moe_block_with_renormalized_topk():
    block = _hf_block(Qwen3MoeSparseMoeBlock, "qwen3_moe", moe_intermediate_size=INTER, norm_topk_prob=True)
    check_rewrite(block, _tokens(4), MatchMoE(), expected_matches=1, second_inputs=_tokens(9), dynamic={0: 1})


def test_gelu_tanh_experts():
    module = BatchedExperts(act=lambda x: F.gelu(x, approximate="tanh"))
    check = check_rewrite(module, (torch.randn(6, HIDDEN),), MatchMoE(), expected_matches=1,
                          second_inputs=(torch.randn(3, HIDDEN),), dynamic={0: 0})
    (node,) = [n for n in check.gm.graph.nodes if n.target == MOE]
    assert node.args[5] == "gelu_tanh"


def test_experts_without_the_id_clamp_as_transformers_5_25_spells_them():
    check = check_rewrite(BatchedExperts(clamp_max=None), (torch.randn(6, HIDDEN),), MatchMoE(), expected_matches=1,
                          second_inputs=(torch.randn(2, HIDDEN),), dynamic={0: 0})
    assert not check.gm.graph.find_nodes(op="call_function", target=torch.ops.aten.clamp.default)


def test_clamp_that_drops_an_expert_is_rejected():
    result = check_rewrite(BatchedExperts(clamp_max=EXPERTS - 2), (torch.randn(6, HIDDEN),), MatchMoE(),
                           expected_matches=0).result
    assert result.rejected == 1 and "clamped" in result.reasons[0]


def test_sum_over_other_groups_than_a_tokens_experts_is_rejected():
    class WrongGroups(BatchedExperts):
        def forward(self, x):
            weights, ids = torch.topk(F.softmax(F.linear(x, self.router), dim=-1), TOP_K, dim=-1)
            ids = ids.reshape(-1).clamp(0, EXPERTS - 1)
            selected = x.repeat_interleave(TOP_K, dim=0)
            gate, up = torch.bmm(self.gate_up_proj[ids], selected.unsqueeze(-1)).squeeze(-1).chunk(2, dim=-1)
            out = torch.bmm(self.down_proj[ids], (F.silu(gate) * up).unsqueeze(-1)).squeeze(-1)
            out = out * weights.reshape(-1).unsqueeze(-1)
            return out.view(TOP_K, x.shape[0], HIDDEN).sum(dim=1)  # sums over tokens, not experts

    result = check_rewrite(WrongGroups(), (torch.randn(6, HIDDEN),), MatchMoE(), expected_matches=0).result
    assert result.rejected == 1 and "groups of 6" in result.reasons[0]


def test_dense_mlp_is_not_moe():
    mlp = torch.nn.Sequential(torch.nn.Linear(HIDDEN, INTER), torch.nn.SiLU(), torch.nn.Linear(INTER, HIDDEN))
    check_rewrite(mlp, (torch.randn(3, HIDDEN),), MatchMoE(), expected_matches=0)


def test_canonicalize_moe_pass_fails_naming_itself_when_experts_remain():
    run = pass_runner("canonicalize_moe", rules=["match_moe"])
    with pytest.raises(PassError, match="pass 'canonicalize_moe' failed: .*not canonicalized.*clamped"):
        check_rewrite(BatchedExperts(clamp_max=EXPERTS - 2), (torch.randn(6, HIDDEN),), run, expected_matches=0)


def test_canonicalize_moe_pass_counts_matches():
    run = pass_runner("canonicalize_moe", rules=["match_moe"])
    check_rewrite(BatchedExperts(), (torch.randn(6, HIDDEN),), run, expected_matches=1)


class DenseExperts(torch.nn.Module):
    """Every expert on every token, weighted by a dense routing matrix: no batched_mm, no rule."""

    def __init__(self):
        super().__init__()
        self.w_up = torch.nn.Parameter(torch.randn(EXPERTS, INTER, HIDDEN) * 0.3)
        self.w_down = torch.nn.Parameter(torch.randn(EXPERTS, HIDDEN, INTER) * 0.3)

    def forward(self, x, routing):
        hidden = F.silu(torch.einsum("th,eih->tei", x, self.w_up))
        return torch.einsum("tei,ehi,te->th", hidden, self.w_down, routing)


def test_canonicalize_moe_fails_for_an_experts_module_that_did_not_become_moe():
    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.router, self.experts = torch.nn.Linear(HIDDEN, EXPERTS), DenseExperts()

        def forward(self, x):
            return self.experts(x, F.softmax(self.router(x), dim=-1))

    gm = export_for_test(Block(), (torch.randn(5, HIDDEN),), {0: 0})
    pass_runner("canonicalize_moe", rules=["match_moe"])(gm)  # nothing says it is MoE: nothing to do
    gm.meta["autodeploy_experts_modules"] = ("experts",)  # what the compiler records from the HF model
    with pytest.raises(PassError, match=r"MoE experts layer in experts \(DenseExperts\) is not supported"):
        pass_runner("canonicalize_moe", rules=["match_moe"])(gm)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_moe_op_equals_transformers_experts_in_each_dtype(dtype):
    """The reference op follows batched_mm: expert GEMMs in the input dtype, routing-weighted sum
    in fp32, one rounding to the input dtype at the end."""
    block = _hf_block(MixtralSparseMoeBlock, "mixtral", intermediate_size=INTER).to(dtype)
    x = torch.randn(7, HIDDEN, dtype=dtype)
    _, weights, ids = block.gate(x)
    want = block.experts(x, ids, weights)
    got = MOE(x, ids, weights, block.experts.gate_up_proj, block.experts.down_proj, "silu")
    assert got.dtype == want.dtype == dtype
    tol = 1e-2 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)
