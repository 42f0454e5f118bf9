import math

import pytest
import torch
import torch.nn.functional as F
from transformers.models.gemma2.modeling_gemma2 import eager_attention_forward

from autodeploy.errors import PassError, UnsupportedPatternError
from autodeploy.graph.rewrite import RuleResult, apply_rule
from autodeploy.testing import check_rewrite, export_for_test, pass_runner
from autodeploy.transforms.match_attention import MatchEagerAttention, MatchSDPAAttention
from autodeploy.transforms.match_repeat_kv import MatchRepeatKV

ATTENTION = torch.ops.autodeploy.attention.default
HIDDEN, HEAD_DIM = 32, 8
ATTENTION_RULES = ["match_repeat_kv", "match_query_temperature", "match_eager_attention", "match_select_attention",
                   "match_bmm_attention", "match_sdpa_attention"]  # as autodeploy/pipeline/default.yaml


def additive_mask(position_ids: torch.Tensor, dtype: torch.dtype, window: int | None = None,
                  chunk: int | None = None) -> torch.Tensor:
    """[1, 1, T, T] causal (optionally sliding-window or chunked) mask, built from positions like HF does."""
    diff = position_ids[:, None] - position_ids[None, :]
    allowed = diff >= 0
    if window is not None:
        allowed = allowed & (diff < window)
    if chunk is not None:
        allowed = allowed & (position_ids[:, None] // chunk == position_ids[None, :] // chunk)
    return torch.zeros(allowed.shape, dtype=dtype).masked_fill(~allowed, torch.finfo(dtype).min)[None, None]


class Attention(torch.nn.Module):
    """q/k/v projections around one attention computation (``attend``), HF [B, H, S, D] layout."""

    def __init__(self, heads=4, kv_heads=4, window=None, masked=True, chunk=None, **attend_kwargs):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, HEAD_DIM
        self.num_key_value_groups = heads // kv_heads
        self.q = torch.nn.Linear(HIDDEN, heads * HEAD_DIM)
        self.kv = torch.nn.Linear(HIDDEN, 2 * kv_heads * HEAD_DIM)
        self.window, self.masked, self.chunk, self.attend_kwargs = window, masked, chunk, attend_kwargs

    def split(self, x, heads):
        return x.view(1, x.shape[1], heads, HEAD_DIM).transpose(1, 2)

    def forward(self, x, position_ids):
        q = self.split(self.q(x), self.heads)
        k, v = (self.split(t, self.kv_heads) for t in self.kv(x).chunk(2, dim=-1))
        mask = additive_mask(position_ids, x.dtype, self.window, self.chunk) if self.masked else None
        out = self.attend(q, k, v, mask)
        return out.reshape(1, x.shape[1], -1)

    def attend(self, q, k, v, mask):
        out, _ = eager_attention_forward(self, q, k, v, mask, **self.attend_kwargs)
        return out


class SDPA(Attention):
    def attend(self, q, k, v, mask):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, **self.attend_kwargs).transpose(1, 2)


def _inputs(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(1, n, HIDDEN), torch.arange(n)


def after_repeat_kv(rule):
    """Apply match_repeat_kv first (as the pipeline does); report the attention rule's matches."""

    def run(gm) -> RuleResult:
        apply_rule(gm, MatchRepeatKV(), provenance="test")
        return apply_rule(gm, rule, provenance="test")

    return run


def check_attention(module, rule, expected_matches=1, n=(6, 13)):
    check = check_rewrite(module, _inputs(n[0]), after_repeat_kv(rule), expected_matches=expected_matches,
                          second_inputs=_inputs(n[1]), dynamic={0: 1, 1: 0})
    nodes = [node for node in check.gm.graph.nodes if node.target == ATTENTION]
    assert len(nodes) == expected_matches
    return dict(zip(("scale", "causal", "sliding_window", "logit_softcap"), nodes[0].args[3:7])) if nodes else {}


# ---------------------------------------------------------------------------------- eager


@pytest.mark.parametrize("kv_heads", [4, 2, 1], ids=["mha", "gqa", "mqa"])
def test_eager_causal_attention(kv_heads):
    flags = check_attention(Attention(kv_heads=kv_heads, scaling=HEAD_DIM**-0.5), MatchEagerAttention())
    assert flags == {"scale": HEAD_DIM**-0.5, "causal": True, "sliding_window": None, "logit_softcap": None}


def test_eager_sliding_window_is_read_off_the_mask():
    flags = check_attention(Attention(kv_heads=2, window=4, scaling=0.3), MatchEagerAttention(), n=(6, 15))
    assert flags["causal"] and flags["sliding_window"] == 4 and flags["scale"] == 0.3


@pytest.mark.parametrize("spelling", ["eager", "sdpa"])
def test_chunked_attention_is_read_off_the_mask(spelling):
    """Llama-4's chunks (of 4 tokens here): both lengths cross several chunk boundaries."""
    module = Attention(kv_heads=2, chunk=4, scaling=0.3) if spelling == "eager" else SDPA(kv_heads=2, chunk=4,
                                                                                             enable_gqa=True)
    rule = MatchEagerAttention() if spelling == "eager" else MatchSDPAAttention()
    check = check_rewrite(module, _inputs(7), after_repeat_kv(rule), expected_matches=1, second_inputs=_inputs(15),
                          dynamic={0: 1, 1: 0})
    (node,) = [n for n in check.gm.graph.nodes if n.target == ATTENTION]
    assert node.args[4:6] == (True, None) and node.kwargs == {"chunk_size": 4}


def test_eager_softcap_and_query_pre_attn_scale():
    module = Attention(kv_heads=2, scaling=32**-0.5, softcap=0.5)
    flags = check_attention(module, MatchEagerAttention())
    assert flags["logit_softcap"] == 0.5 and flags["scale"] == 32**-0.5


def test_eager_without_scale_multiply_gets_scale_one():
    class PreScaledQuery(Attention):
        def attend(self, q, k, v, mask):
            probs = F.softmax(torch.matmul(q * 0.5, k.transpose(2, 3)) + mask, dim=-1, dtype=torch.float32)
            return torch.matmul(probs.to(q.dtype), v).transpose(1, 2)

    assert check_attention(PreScaledQuery(), MatchEagerAttention())["scale"] == 1.0


class DividedScores(Attention):
    """GPT-J (``scores / sqrt(d)``), Falcon (``scores /= sqrt(d)``, in place) and CodeGen (mask added
    before the division) spellings."""

    def __init__(self, spelling: str, **kwargs):
        super().__init__(**kwargs)
        self.spelling = spelling

    def attend(self, q, k, v, mask):
        scores = torch.matmul(q.float(), k.float().transpose(-1, -2))
        if self.spelling == "in_place":
            scores /= math.sqrt(HEAD_DIM)
        elif self.spelling == "mask_first":
            scores = (scores + mask) / math.sqrt(HEAD_DIM)
        else:
            scores = scores / math.sqrt(HEAD_DIM)
        if self.spelling != "mask_first":
            scores = scores + mask
        probs = F.softmax(scores, dim=-1).to(v.dtype)
        return torch.matmul(probs, v).transpose(1, 2)


@pytest.mark.parametrize("spelling", ["divide", "in_place", "mask_first"])
def test_eager_scores_divided_by_sqrt_head_dim(spelling):
    flags = check_attention(DividedScores(spelling), MatchEagerAttention())
    assert flags["scale"] == pytest.approx(1 / math.sqrt(HEAD_DIM)) and flags["causal"]


def test_eager_scale_computed_at_run_time_is_rejected():
    class TensorScale(Attention):
        def attend(self, q, k, v, mask):
            scores = torch.matmul(q, k.transpose(2, 3)) * q.abs().mean()
            return torch.matmul(F.softmax(scores + mask, dim=-1), v).transpose(1, 2)

    result = check_rewrite(TensorScale(), _inputs(5), MatchEagerAttention(), expected_matches=0,
                           second_inputs=_inputs(8), dynamic={0: 1, 1: 0}).result
    assert result.rejected >= 1 and any("computed at run time" in r for r in result.reasons)


def test_two_layers_with_different_windows():
    layers = torch.nn.ModuleList([Attention(window=3, scaling=0.25), Attention(scaling=0.25)])

    class Stack(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = layers

        def forward(self, x, position_ids):
            for layer in self.layers:
                x = x + layer(x, position_ids)
            return x

    check = check_rewrite(Stack(), _inputs(7), MatchEagerAttention(), expected_matches=2,
                          second_inputs=_inputs(12), dynamic={0: 1, 1: 0})
    windows = [n.args[5] for n in check.gm.graph.nodes if n.target == ATTENTION]
    assert windows == [3, None]


def test_bidirectional_mask_fails_loudly():
    class Bidirectional(Attention):
        def attend(self, q, k, v, mask):
            return super().attend(q, k, v, torch.zeros_like(mask))

    with pytest.raises(UnsupportedPatternError, match="bidirectional"):
        check_attention(Bidirectional(scaling=0.25), MatchEagerAttention())


def test_softmax_of_a_linear_is_not_attention():
    classifier = torch.nn.Sequential(torch.nn.Linear(HIDDEN, 8), torch.nn.Softmax(dim=-1))
    check_rewrite(classifier, (torch.randn(3, HIDDEN),), MatchEagerAttention(), expected_matches=0)


# ----------------------------------------------------------------------------------- sdpa


def test_sdpa_is_causal_without_mask():
    flags = check_attention(SDPA(masked=False, is_causal=True), MatchSDPAAttention())
    assert flags == {"scale": 1 / math.sqrt(HEAD_DIM), "causal": True, "sliding_window": None, "logit_softcap": None}


def test_sdpa_explicit_sliding_mask_and_scale():
    flags = check_attention(SDPA(window=5, scale=0.2), MatchSDPAAttention(), n=(7, 16))
    assert flags["sliding_window"] == 5 and flags["scale"] == 0.2 and flags["causal"]


def test_sdpa_enable_gqa_is_native_gqa():
    check_attention(SDPA(kv_heads=2, masked=False, is_causal=True, enable_gqa=True), MatchSDPAAttention())


def test_sdpa_after_repeat_kv():
    class RepeatedSDPA(SDPA):
        def attend(self, q, k, v, mask):
            from transformers.models.llama.modeling_llama import repeat_kv

            return super().attend(q, repeat_kv(k, 2), repeat_kv(v, 2), mask)

    check_attention(RepeatedSDPA(kv_heads=2, is_causal=True, masked=False), MatchSDPAAttention())


def test_sdpa_with_dropout_is_rejected():
    # dropout_p is applied even in eval mode, so outputs are random: no comparison with eager here
    gm = export_for_test(SDPA(masked=False, is_causal=True, dropout_p=0.1), _inputs(5))
    result = apply_rule(gm, MatchSDPAAttention(), provenance="test")
    assert result.matches == 0 and result.rejected >= 1  # each SDPA variant that fits says why
    assert all("dropout" in reason for reason in result.reasons)


# --------------------------------------------------------------------------------- the pass


def test_canonicalize_attention_pass_counts_repeat_kv_and_attention():
    run = pass_runner("canonicalize_attention", rules=ATTENTION_RULES)
    check = check_rewrite(Attention(kv_heads=2, scaling=0.25), _inputs(6), run, expected_matches=3,
                          second_inputs=_inputs(9), dynamic={0: 1, 1: 0})
    assert check.count(torch.ops.autodeploy.repeat_kv.default) == 0


def test_canonicalize_attention_pass_fails_naming_itself_when_attention_remains():
    class BmmAttention(Attention):  # a spelling no rule matches: batched bmm on [B*H, S, D]
        def attend(self, q, k, v, mask):
            flat = [t.reshape(-1, t.shape[2], HEAD_DIM) for t in (q, k, v)]
            probs = F.softmax(torch.bmm(flat[0], flat[1].transpose(1, 2)) + mask[0], dim=-1)
            return torch.bmm(probs, flat[2]).view(1, self.heads, -1, HEAD_DIM).transpose(1, 2)

    run = pass_runner("canonicalize_attention", rules=ATTENTION_RULES)
    with pytest.raises(PassError, match="pass 'canonicalize_attention' failed: .*not canonicalized.*softmax"):
        check_rewrite(BmmAttention(), _inputs(5), run, expected_matches=0)
