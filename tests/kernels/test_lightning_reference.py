"""Lightning attention's torch references and ops: chunked == recurrent, == the SSM recurrence it is a
case of, == HF's MiniMax layer (its block loop over several blocks, then its decode steps, and the state
it caches), and the cached op over a mixed step (starts, continued chunks, decodes, padding) == each
sequence alone."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from autodeploy.ops import state_reference
from autodeploy.ops.lightning_reference import lightning_chunked, lightning_recurrent

from state_cases import Step, split_rows

ad = torch.ops.autodeploy
HEADS, K, V = 3, 8, 6


def _gen(seed=0):
    return torch.Generator().manual_seed(seed)


def _inputs(length: int, seed: int = 0) -> dict:
    gen = _gen(seed)
    q, k = (torch.randn(length, HEADS, K, generator=gen) for _ in range(2))
    return {"q": q, "k": k, "v": torch.randn(length, HEADS, V, generator=gen),
            "slopes": torch.rand(HEADS, generator=gen) + 0.05}


@pytest.mark.parametrize("length,chunk", [(1, 4), (7, 4), (16, 4), (37, 16)])
def test_chunked_equals_recurrent(length, chunk):
    inputs, state = _inputs(length), torch.randn(HEADS, K, V, generator=_gen(1))
    out_rec, state_rec = lightning_recurrent(**inputs, state=state)
    out_chk, state_chk = lightning_chunked(**inputs, state=state, chunk=chunk)
    torch.testing.assert_close(out_chk, out_rec, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(state_chk, state_rec, atol=1e-4, rtol=1e-4)


def test_is_the_ssm_recurrence_with_unit_steps():
    """dt = 1, A = -slope, B = k, C = q, x = v: the Mamba-2 recurrence, its state [V, K] transposed."""
    inputs, state = _inputs(9), torch.randn(HEADS, K, V, generator=_gen(1))
    out, final = lightning_recurrent(**inputs, state=state)
    q, k, v, slopes = inputs.values()
    unit_steps = torch.ones(9, HEADS)
    y, ssm_final = state_reference.ssm_recurrent(v, unit_steps, -slopes, k, q, state.transpose(1, 2))
    torch.testing.assert_close(out, y)
    torch.testing.assert_close(final, ssm_final.transpose(1, 2))


def test_op_matches_hf_blocks_then_decode_steps_and_its_cached_state():
    """HF's layer, prefill of 37 tokens in blocks of 16 then 3 decode steps with its cache, against the
    cached op over the same projections (the prompt from zeros, each decode step from the state it left)."""
    from transformers.models.minimax.modeling_minimax import MiniMaxCache, MiniMaxLightningAttention

    from autodeploy.tiny import tiny_config

    torch.manual_seed(0)
    layer = MiniMaxLightningAttention(tiny_config("minimax", block_size=16), 0).eval()
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.2)
    hidden = torch.randn(1, 40, 64)
    cache = MiniMaxCache()
    with torch.no_grad():
        want = torch.cat([layer(hidden[:, :37], None, None, cache)[0]] +
                         [layer(hidden[:, t : t + 1], None, None, cache)[0] for t in range(37, 40)], dim=1)
        q, k, v = _qkv(layer, hidden[0])
        slopes = layer.slope_rate.flatten()
        state = torch.zeros(1, layer.num_attention_heads, 16, 16)
        prompt = [t[:37] for t in (q, k, v)]
        out = [ad.lightning_attention_cached(*prompt, slopes, state, **Step(seqs=((0, 0, 37),)).metadata())]
        torch.testing.assert_close(ad.lightning_attention(*prompt, slopes), out[0])
        for t in range(37, 40):
            token = [x[t : t + 1] for x in (q, k, v)]
            decode = Step(seqs=((0, t, 1),)).metadata()
            out.append(ad.lightning_attention_cached(*token, slopes, state, **decode))
        got = _finish(layer, torch.cat(out), hidden[0])
    torch.testing.assert_close(got[None], want, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(state[0], cache.linear_cache[0][0], atol=1e-5, rtol=1e-4)


def _qkv(layer, hidden):
    qkv = F.silu(layer.qkv_proj(hidden)).reshape(hidden.shape[0], layer.num_attention_heads, -1)
    return torch.split(qkv, layer.head_dim, dim=-1)


def _finish(layer, attn, hidden):
    attn = layer.norm(attn.reshape(hidden.shape[0], -1))
    return layer.out_proj(torch.sigmoid(layer.output_gate(hidden)) * attn)


MIXED = Step(seqs=((3, 0, 6), (0, 5, 1), (5, 9, 4), (2, 0, 1), (1, 12, 1)), pad_tokens=2, pad_seqs=2)


def test_cached_op_on_a_mixed_step_equals_each_sequence_alone():
    inputs, slots = _inputs(MIXED.num_tokens, seed=3), 6
    slopes = inputs.pop("slopes")
    state = torch.randn(slots, HEADS, K, V, generator=_gen(4))
    before = state.clone()
    out = ad.lightning_attention_cached(*inputs.values(), slopes, state, **MIXED.metadata())
    start = 0
    for (slot, context, n), rows in zip(MIXED.seqs, split_rows(inputs, MIXED)):
        initial = before[slot] if context > 0 else torch.zeros_like(before[slot])
        want, final = lightning_recurrent(*rows.values(), slopes, initial)
        torch.testing.assert_close(out[start : start + n], want, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(state[slot], final, atol=1e-5, rtol=1e-5)
        start += n
    assert not out[start:].any(), "padding tokens' rows must be zero"
    untouched = sorted(set(range(slots)) - {s for s, _, _ in MIXED.seqs})
    assert torch.equal(state[untouched], before[untouched]), "slots of no sequence must be left alone"
