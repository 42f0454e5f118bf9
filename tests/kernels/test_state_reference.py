"""The state ops' torch references: chunked == recurrent, resuming from a state == one pass, and the
cached ops over a mixed step (starts, continued chunks, decodes, padding) == each sequence alone."""

from __future__ import annotations

import pytest
import torch

from autodeploy.ops import state_reference as ref

from state_cases import Shapes, Step, conv_inputs, conv_params, delta_inputs, split_rows, ssm_inputs

ad = torch.ops.autodeploy
S = Shapes()


def _gen(seed=0):
    return torch.Generator().manual_seed(seed)


_FAMILIES = {  # inputs, state shape, recurrent form, chunked form
    "ssm": (ssm_inputs, (S.heads, S.head_dim, S.state), ref.ssm_recurrent, ref.ssm_chunked),
    "delta": (delta_inputs, (S.heads, S.state, S.head_dim), ref.delta_recurrent, ref.delta_chunked),
}


@pytest.mark.parametrize("family", sorted(_FAMILIES))
@pytest.mark.parametrize("length,chunk", [(1, 4), (7, 4), (16, 4), (37, 16)])
def test_chunked_equals_recurrent(family, length, chunk):
    make_inputs, state_shape, recurrent, chunked = _FAMILIES[family]
    inputs = make_inputs(length, S, _gen())
    state = torch.randn(*state_shape, generator=_gen(1))
    out_rec, state_rec = recurrent(**inputs, state=state)
    out_chk, state_chk = chunked(**inputs, state=state, chunk=chunk)
    torch.testing.assert_close(out_chk, out_rec, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(state_chk, state_rec, atol=1e-4, rtol=1e-4)


def test_ssm_recurrence_by_hand():
    """One head, one group, P = N = 1: y_t = sum_s exp(A * sum(dt_{s+1..t})) dt_s x_s B_s * C_t."""
    x, dt, B, C = (torch.rand(5, 1, 1, generator=_gen(i)) for i in range(4))
    dt = dt[..., 0]
    A = torch.tensor([-0.7])
    y, _ = ref.ssm_recurrent(x, dt, A, B, C, torch.zeros(1, 1, 1))
    for t in range(5):
        want = sum(torch.exp(A * dt[s + 1 : t + 1, 0].sum()) * dt[s, 0] * x[s, 0, 0] * B[s, 0, 0] for s in range(t + 1))
        torch.testing.assert_close(y[t, 0, 0], (want * C[t, 0, 0]).squeeze())


def test_split_sequence_resumes_from_state():
    """Prefill in three pieces, state handed over, == one pass (conv, SSM, delta)."""
    conv, params = conv_inputs(20, S, _gen())["x"], conv_params(S, _gen(1))
    whole, _ = ref.conv_sequence(conv, **params, state=torch.zeros(S.channels, S.kernel - 1))
    state, pieces = torch.zeros(S.channels, S.kernel - 1), []
    for rows in (slice(0, 2), slice(2, 3), slice(3, 20)):
        out, state = ref.conv_sequence(conv[rows], **params, state=state)
        pieces.append(out)
    torch.testing.assert_close(torch.cat(pieces), whole)
    inputs = ssm_inputs(20, S, _gen(2))
    whole, _ = ref.ssm_chunked(**inputs, state=torch.zeros(S.heads, S.head_dim, S.state))
    state, pieces = torch.zeros(S.heads, S.head_dim, S.state), []
    for rows in (slice(0, 5), slice(5, 6), slice(6, 20)):
        out, state = ref.ssm_chunked(**{k: v[rows] if v.dim() > 1 else v for k, v in inputs.items()}, state=state)
        pieces.append(out)
    torch.testing.assert_close(torch.cat(pieces), whole, atol=1e-5, rtol=1e-5)


def test_conv_matches_torch_conv1d_with_padding():
    x, params = conv_inputs(9, S, _gen())["x"], conv_params(S, _gen(1))
    want = torch.nn.functional.conv1d(x.T[None], params["weight"][:, None], params["bias"], padding=S.kernel - 1,
                                      groups=S.channels)[0, :, :9].T
    torch.testing.assert_close(ad.causal_conv1d(x, params["weight"], params["bias"]), want)


MIXED = Step(seqs=((3, 0, 6), (0, 5, 1), (5, 9, 4), (2, 0, 1), (1, 12, 1)), pad_tokens=2, pad_seqs=2)


def _run_mixed(kind: str, step: Step):
    """The cached op over ``step`` vs each sequence alone from its slot's state; the written slots."""
    gen, slots = _gen(3), 6
    if kind == "conv":
        params = conv_params(S, _gen(4))
        inputs = conv_inputs(step.num_tokens, S, gen)
        state = torch.randn(slots, S.channels, S.kernel - 1, generator=gen)
        op = lambda st: ad.causal_conv1d_cached(inputs["x"], params["weight"], params["bias"], st, **step.metadata())
        alone = lambda rows, init: ref.conv_sequence(rows["x"], params["weight"], params["bias"], init)
    elif kind == "ssm":
        inputs = ssm_inputs(step.num_tokens, S, gen)
        A = inputs.pop("A")
        state = torch.randn(slots, S.heads, S.head_dim, S.state, generator=gen)
        op = lambda st: ad.ssm_scan_cached(inputs["x"], inputs["dt"], A, inputs["B"], inputs["C"], st, **step.metadata())
        alone = lambda rows, init: ref.ssm_recurrent(rows["x"], rows["dt"], A, rows["B"], rows["C"], init)
    else:
        inputs = delta_inputs(step.num_tokens, S, gen)
        state = torch.randn(slots, S.heads, S.state, S.head_dim, generator=gen)
        op = lambda st: ad.gated_delta_rule_cached(*inputs.values(), st, **step.metadata())
        alone = lambda rows, init: ref.delta_recurrent(*rows.values(), init)
    return op, alone, inputs, state


@pytest.mark.parametrize("kind", ["conv", "ssm", "delta"])
def test_cached_op_on_a_mixed_step_equals_each_sequence_alone(kind):
    op, alone, inputs, state = _run_mixed(kind, MIXED)
    before = state.clone()
    out = op(state)
    start = 0
    for (slot, context, n), rows in zip(MIXED.seqs, split_rows(inputs, MIXED)):
        initial = before[slot] if context > 0 else torch.zeros_like(before[slot])
        want, final = alone(rows, initial)
        torch.testing.assert_close(out[start : start + n], want.to(out.dtype), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(state[slot], final.to(state.dtype), atol=1e-5, rtol=1e-5)
        start += n
    assert not out[start:].any(), "padding tokens' rows must be zero"
    untouched = sorted(set(range(state.shape[0])) - {s for s, _, _ in MIXED.seqs})
    assert torch.equal(state[untouched], before[untouched]), "slots of no sequence must be left alone"
