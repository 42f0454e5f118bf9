"""match_mla: HF's DeepseekV2/V3 attention modules -> ``autodeploy::mla`` (exact count, equal to eager at two
lengths), in their variants: compressed or plain query projection, interleaved / half-rotate / complex RoPE,
YaRN's mscale in the softmax scale, eager and SDPA code; and the attention it must not take."""

import pytest
import torch
from test_match_attention import additive_mask
from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2Attention, DeepseekV2RotaryEmbedding
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention, DeepseekV3RotaryEmbedding

from autodeploy.testing import check_rewrite
from autodeploy.tiny import tiny_config
from autodeploy.transforms.match_mla import MatchMLA

MLA = torch.ops.autodeploy.mla.default


class Layer(torch.nn.Module):
    """One HF MLA attention with its rotary embedding and an additive causal mask (or none)."""

    def __init__(self, model_type="deepseek_v3", implementation="eager", masked=True, **overrides):
        super().__init__()
        config = tiny_config(model_type, **overrides)
        config._attn_implementation = implementation
        v3 = model_type == "deepseek_v3"
        self.attn = (DeepseekV3Attention if v3 else DeepseekV2Attention)(config, 0).eval()
        self.rotary = (DeepseekV3RotaryEmbedding if v3 else DeepseekV2RotaryEmbedding)(config)
        self.v3, self.masked = v3, masked
        with torch.no_grad():
            for p in self.attn.parameters():
                p.normal_(0.0, 0.3)

    def forward(self, x, position_ids):
        rotary = self.rotary(x, position_ids[None])
        mask = additive_mask(position_ids, x.dtype) if self.masked else None
        if self.v3:
            return self.attn(x, rotary, mask)[0]
        return self.attn(x, mask, position_embeddings=rotary)[0]


def _inputs(n):
    return torch.randn(1, n, 64), torch.arange(n)


def check_mla(module, expected=1):
    check = check_rewrite(module, _inputs(7), MatchMLA(), expected_matches=expected, second_inputs=_inputs(13),
                          dynamic={0: 1, 1: 0})
    return check, check.gm.graph.find_nodes(op="call_function", target=MLA)


@pytest.mark.parametrize("q_lora_rank, rope_interleave", [(32, True), (None, False)],
                         ids=["q_a-q_b-interleaved", "q_proj-half-rotate"])
def test_deepseek_v3_attention(q_lora_rank, rope_interleave):
    """Also: YaRN's mscale (tiny deepseek_v3: factor 4, mscale_all_dim 1) is in the captured scale."""
    module = Layer(q_lora_rank=q_lora_rank, rope_interleave=rope_interleave)
    assert module.attn.scaling > module.attn.qk_head_dim**-0.5 * 1.2
    _, (node,) = check_mla(module)
    assert node.args[-1] == pytest.approx(module.attn.scaling)


def test_deepseek_v2_attention_with_complex_rope():
    check_mla(Layer("deepseek_v2"))


@pytest.mark.parametrize("masked", [True, False])
def test_sdpa_code(masked):
    """HF's SDPA path: with the mask, or with ``is_causal`` (no mask passed, several queries)."""
    _, (node,) = check_mla(Layer(implementation="sdpa", masked=masked))
    assert node.args[-1] == pytest.approx(Layer().attn.scaling)


def test_unmasked_eager_attention_is_not_causal_and_rejected():
    check, _ = check_mla(Layer(masked=False), expected=0)
    assert any("plain causal mask only" in reason for reason in check.result.reasons)


def test_plain_attention_is_left_to_the_attention_rules():
    from test_match_attention import Attention

    check_rewrite(Attention(scaling=0.3), (torch.randn(1, 6, 32), torch.arange(6)), MatchMLA(), expected_matches=0)
