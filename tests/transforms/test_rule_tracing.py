"""apply_rule traces a rule's patterns only when it tries them, and stops once the graph lacks an op
every pattern needs (``RewriteRule.required_ops``): each declaration is checked against every pattern."""

import pytest
import torch
from transformers.models.llama.modeling_llama import eager_attention_forward

from autodeploy.graph.matcher import _SAME_OP, TRANSPARENT_OPS
from autodeploy.graph.rewrite import RewriteRule, apply_rule
from autodeploy.testing import export_for_test
from autodeploy.transforms import RULES
from autodeploy.transforms.match_attention import MatchEagerAttention
from autodeploy.transforms.match_repeat_kv import MatchRepeatKV
from autodeploy.transforms.match_moe import MatchMoE

ATTENTION = torch.ops.autodeploy.attention.default


class LlamaAttention(torch.nn.Module):
    """Llama's eager attention (repeat_kv, scores * scale, additive causal mask) on 4 / 2 heads of 8."""

    num_key_value_groups = 2

    def __init__(self):
        super().__init__()
        self.q, self.kv = torch.nn.Linear(32, 32), torch.nn.Linear(32, 32)
        self.training = False

    def forward(self, x, position_ids):
        n = x.shape[1]
        q = self.q(x).view(1, n, 4, 8).transpose(1, 2)
        k, v = (t.view(1, n, 2, 8).transpose(1, 2) for t in self.kv(x).chunk(2, dim=-1))
        blocked = position_ids[None, :] > position_ids[:, None]
        mask = torch.zeros(n, n).masked_fill(blocked, torch.finfo(torch.float32).min)[None, None]
        out, _ = eager_attention_forward(self, q, k, v, mask, scaling=8**-0.5)
        return out.reshape(1, n, 32)


def _llama_attention_graph():
    gm = export_for_test(LlamaAttention(), (torch.randn(1, 6, 32), torch.arange(6)), {0: 1, 1: 0})
    apply_rule(gm, MatchRepeatKV(), provenance="test")
    return gm


def _pattern_ops(pattern) -> set:
    return {n.target for n in pattern.graph.nodes if n.op == "call_function"}


@pytest.mark.parametrize("name", sorted(RULES.names()))
def test_every_pattern_contains_the_rules_required_ops(name):
    rule = RULES.get(name)()
    # the graph is searched for these exact targets: none may be matched through or by a stand-in
    assert not rule.required_ops & (TRANSPARENT_OPS | set(_SAME_OP))
    for pattern in rule.traced_patterns():
        missing = rule.required_ops - _pattern_ops(pattern)
        assert not missing, f"{name}: pattern {pattern.name} lacks required ops {missing}"


@pytest.fixture
def traces(monkeypatch):
    """Names of the patterns traced from now on (the per-process cache emptied for the test)."""
    names = []
    real = RewriteRule.traced_pattern

    def counting(self, index, spec):
        key = (f"{type(self).__module__}.{type(self).__qualname__}", index)
        if key not in RewriteRule._traced:
            names.append(spec.name or f"{self.name}[{index}]")
        return real(self, index, spec)

    monkeypatch.setattr(RewriteRule, "_traced", {})
    monkeypatch.setattr(RewriteRule, "traced_pattern", counting)
    return names


def test_patterns_after_the_last_attention_are_not_traced(traces):
    gm = _llama_attention_graph()
    traces.clear()
    result = apply_rule(gm, MatchEagerAttention(), provenance="test")
    assert result.matches == 1 and len(gm.graph.find_nodes(op="call_function", target=ATTENTION)) == 1
    all_patterns = len(MatchEagerAttention().patterns())
    assert 1 <= len(traces) < all_patterns, traces
    assert traces[-1] == "eager(repeat=True,scale=mul,softcap=False,mask=True)"  # the one that matched


def test_a_rule_whose_ops_are_absent_traces_nothing(traces):
    gm = _llama_attention_graph()
    traces.clear()
    result = apply_rule(gm, MatchMoE(), provenance="test")  # no bmm in a dense model
    assert result.matches == 0 and traces == []
