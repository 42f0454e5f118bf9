import torch
from transformers.models.gpt_neox.modeling_gpt_neox import apply_rotary_pos_emb as neox_partial_rope
from transformers.models.gptj.modeling_gptj import apply_rotary_pos_emb as gptj_interleaved_rope
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb as llama_rope

from autodeploy.testing import check_rewrite, pass_runner
from autodeploy.transforms.match_rope import MatchRoPE

ROPE = torch.ops.autodeploy.rope.default
HEADS, HEAD_DIM = 2, 8
ROPE_RULES = ["match_rope", "match_partial_rope"]


def frequencies(position_ids: torch.Tensor, dim: int) -> torch.Tensor:
    inv_freq = 1.0 / (10000 ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    return position_ids[:, None].float() * inv_freq[None]  # [T, dim / 2]


class Rotated(torch.nn.Module):
    """q/k projections, rotated by ``rotate(q, k, position_ids)``; returns both, concatenated."""

    def __init__(self, rotate):
        super().__init__()
        self.qk = torch.nn.Linear(HEADS * HEAD_DIM, 2 * HEADS * HEAD_DIM)
        self.rotate = rotate

    def forward(self, x, position_ids):
        q, k = (t.view(1, x.shape[1], HEADS, HEAD_DIM).transpose(1, 2) for t in self.qk(x).chunk(2, dim=-1))
        q, k = self.rotate(q, k, position_ids)
        return torch.cat([q, k], dim=1)


def half_rotate(rotary_dim: int = HEAD_DIM, apply=llama_rope):
    def rotate(q, k, position_ids):
        emb = torch.cat([frequencies(position_ids, rotary_dim)] * 2, dim=-1)[None]
        return apply(q, k, emb.cos(), emb.sin())

    return rotate


def interleaved(rotary_dim: int = HEAD_DIM):
    """GPT-J: sin/cos repeated pairwise, rotary part sliced off and concatenated back."""

    def rotate(q, k, position_ids):
        freqs = frequencies(position_ids, rotary_dim)[None]
        sin, cos = freqs.sin(), freqs.cos()
        out = []
        for t in (q, k):
            t = t.transpose(1, 2)  # GPT-J rotates in [B, S, H, D]
            rot = gptj_interleaved_rope(t[..., :rotary_dim], sin, cos)
            out.append(torch.cat([rot, t[..., rotary_dim:]], dim=-1).transpose(1, 2))
        return out

    return rotate


def _inputs(n: int):
    return torch.randn(1, n, HEADS * HEAD_DIM), torch.arange(n)


def check_rope(rotate, rule, expected_matches: int):
    return check_rewrite(Rotated(rotate), _inputs(5), rule, expected_matches=expected_matches,
                         second_inputs=_inputs(11), dynamic={0: 1, 1: 0})


def _interleaved_flags(check) -> list[bool]:
    return [n.args[3] for n in check.gm.graph.nodes if n.target == ROPE]


def test_llama_half_rotate_on_q_and_k():
    check = check_rope(half_rotate(), MatchRoPE(), expected_matches=2)
    assert _interleaved_flags(check) == [False, False]


def test_neox_partial_rotary_folds_into_one_op_per_tensor():
    check = check_rope(half_rotate(4, neox_partial_rope), pass_runner("canonicalize_rope", rules=ROPE_RULES),
                       expected_matches=4)  # 2 rotations + 2 partial folds
    assert check.count(ROPE) == 2
    assert check.count(torch.ops.aten.slice.Tensor) == 0  # rotary/pass-through split folded away


def test_gptj_interleaved_full_head():
    check = check_rope(interleaved(), pass_runner("canonicalize_rope", rules=ROPE_RULES), expected_matches=2)
    assert _interleaved_flags(check) == [True, True]


def test_gptj_interleaved_partial():
    check = check_rope(interleaved(4), pass_runner("canonicalize_rope", rules=ROPE_RULES), expected_matches=4)
    assert _interleaved_flags(check) == [True, True] and check.count(ROPE) == 2


def test_rotation_split_off_the_halves_is_rejected():
    def lopsided(q, k, position_ids):
        emb = torch.cat([frequencies(position_ids, HEAD_DIM)] * 2, dim=-1)[None, None]
        cos, sin = emb.cos(), emb.sin()
        rot = [torch.cat((-t[..., 3:], t[..., :3]), dim=-1) for t in (q, k)]
        return q * cos + rot[0] * sin, k * cos + rot[1] * sin

    result = check_rope(lopsided, MatchRoPE(), expected_matches=0).result
    assert result.rejected == 2 and "halves" in result.reasons[0]


def test_sign_flipped_rotation_is_not_rope():
    def flipped(q, k, position_ids):
        emb = torch.cat([frequencies(position_ids, HEAD_DIM)] * 2, dim=-1)[None, None]
        half = HEAD_DIM // 2
        rot = [torch.cat((t[..., half:], -t[..., :half]), dim=-1) for t in (q, k)]
        return q * emb.cos() + rot[0] * emb.sin(), k * emb.cos() + rot[1] * emb.sin()

    check_rope(flipped, MatchRoPE(), expected_matches=0)


def test_scaling_by_cos_alone_is_not_rope():
    check_rope(lambda q, k, pos: (q * frequencies(pos, 2 * HEAD_DIM)[None, None].cos(), k), MatchRoPE(),
               expected_matches=0)
