"""The state ops' decode steps (``ops/state_decode.py``: batched torch; ``kernels/state_update.py``:
Triton, interpreted) against the references, one sequence at a time: padded rows write no slot, a
broken step is NaN, and the torch form reads no value on the host (CUDA-graph capturable)."""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from autodeploy.kernels.state_update import conv_update, ssm_update
from autodeploy.ops import state_decode
from autodeploy.ops import state_reference as ref
from autodeploy.ops.lightning_reference import lightning_recurrent

from state_cases import Shapes, Step, conv_inputs, conv_params, delta_inputs, ssm_inputs

ad = torch.ops.autodeploy
S = Shapes()
SLOTS = 6
# a decode graph's step: resuming sequences, a first token (context 0), the capture's dummy row (slot
# -1, one token), then padding (no tokens, slot -1), as many padding tokens as padding sequences
DECODE = Step(seqs=((3, 5, 1), (0, 0, 1), (5, 9, 1), (-1, 0, 1), (1, 12, 1)), pad_tokens=2, pad_seqs=2)
IMPLS = {  # kind -> name -> the decode step (x-like inputs..., state, metadata) -> out
    "conv": {"torch": state_decode.conv_step, "triton": conv_update},
    "ssm": {"torch": state_decode.ssm_step, "triton": ssm_update},
    "delta": {"torch": state_decode.delta_step},
    "lightning": {"torch": state_decode.lightning_step},
}
CASES = [(kind, impl) for kind, impls in IMPLS.items() for impl in impls]


def _case(kind: str, step: Step, dtype: torch.dtype, taps: int = S.kernel):
    """(inputs of the op before the state, state pool, one sequence's reference (rows, initial))."""
    gen = torch.Generator().manual_seed(7)
    if kind == "conv":
        shapes = Shapes(kernel=taps)
        params = conv_params(shapes, gen, dtype)
        x = conv_inputs(step.num_tokens, shapes, gen, dtype)["x"]
        state = torch.randn(SLOTS, S.channels, taps - 1, generator=gen).to(dtype)
        return [x, params["weight"], params["bias"]], state, lambda r, init: ref.conv_sequence(
            x[r], params["weight"], params["bias"], init)
    if kind == "ssm":
        inputs = ssm_inputs(step.num_tokens, S, gen, dtype)
        args = [inputs[k] for k in ("x", "dt", "A", "B", "C")]
        state = torch.randn(SLOTS, S.heads, S.head_dim, S.state, generator=gen)
        return args, state, lambda r, init: ref.ssm_recurrent(*(a[r] if a.dim() > 1 else a for a in args), init)
    if kind == "lightning":
        q, k, v = (torch.randn(step.num_tokens, S.heads, dim, generator=gen).to(dtype) * 0.5
                   for dim in (S.state, S.state, S.head_dim))
        slopes = torch.rand(S.heads, generator=gen) + 0.05
        state = torch.randn(SLOTS, S.heads, S.state, S.head_dim, generator=gen)
        return [q, k, v, slopes], state, lambda r, init: lightning_recurrent(q[r], k[r], v[r], slopes, init)
    inputs = delta_inputs(step.num_tokens, S, gen, dtype)
    args = list(inputs.values())
    state = torch.randn(SLOTS, S.heads, S.state, S.head_dim, generator=gen)
    return args, state, lambda r, init: ref.delta_recurrent(*(a[r] for a in args), init)


def _tol(dtype):
    return {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 3e-3, "rtol": 3e-3}


def _check_against_reference(kind, impl, dtype, taps=S.kernel):
    args, state, alone = _case(kind, DECODE, dtype, taps)
    before = state.clone()
    out = IMPLS[kind][impl](*args, state, **DECODE.metadata())
    for row, (slot, context, _) in enumerate(DECODE.seqs):
        initial = before[slot] if slot >= 0 and context > 0 else torch.zeros_like(before[0])
        want, final = alone(slice(row, row + 1), initial)
        torch.testing.assert_close(out[row : row + 1], want.to(out.dtype), **_tol(dtype))
        if slot >= 0:
            torch.testing.assert_close(state[slot], final.to(state.dtype), **_tol(dtype))
    assert not out[len(DECODE.seqs):].any(), "padding rows' outputs must be zero"
    untouched = sorted(set(range(SLOTS)) - {s for s, _, _ in DECODE.seqs})
    assert torch.equal(state[untouched], before[untouched]), "padding rows must write no slot"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("kind,impl", CASES)
def test_decode_step_equals_the_reference_and_padding_writes_nothing(kind, impl, dtype):
    _check_against_reference(kind, impl, dtype)


@pytest.mark.parametrize("taps", [2, 3])
def test_conv_kernel_of_fewer_taps(taps):
    _check_against_reference("conv", "triton", torch.float32, taps)


def test_the_cached_ops_take_the_decode_path_on_decode_steps(monkeypatch):
    """T == B goes through state_decode (no host loop); the results equal the per-sequence loop's."""
    for kind, op in (("conv", ad.causal_conv1d_cached), ("ssm", ad.ssm_scan_cached), ("delta", ad.gated_delta_rule_cached),
                     ("lightning", ad.lightning_attention_cached)):
        args, state, _ = _case(kind, DECODE, torch.float32)
        looped_state = state.clone()
        monkeypatch.setattr(state_decode, "is_decode_step", lambda *a: False)
        looped = op(*args, looped_state, **DECODE.metadata())
        monkeypatch.undo()
        torch.testing.assert_close(op(*args, state, **DECODE.metadata()), looped, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(state, looped_state, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kind,impl", CASES)
def test_a_step_with_more_tokens_than_one_per_sequence_is_nan_and_writes_nothing(kind, impl):
    """T == B with a two-token sequence (a padding rule broken): never a plausible wrong answer."""
    broken = Step(seqs=((3, 5, 2), (0, 4, 1)), pad_seqs=1)
    args, state, _ = _case(kind, broken, torch.float32)
    before = state.clone()
    out = IMPLS[kind][impl](*args, state, **broken.metadata())
    assert out[:2].isnan().all() and torch.equal(state[3], before[3])


def test_all_padding_writes_nothing():
    """The capture's dummy step: no row has a slot, so the spare write rewrites slot 0's own value."""
    step = Step(seqs=((-1, 0, 1),), pad_tokens=3, pad_seqs=3)
    for kind in IMPLS:
        args, state, _ = _case(kind, step, torch.float32)
        before = state.clone()
        IMPLS[kind]["torch"](*args, state, **step.metadata())
        assert torch.equal(state, before)


@pytest.mark.parametrize("kind", sorted(IMPLS))
def test_the_torch_decode_step_reads_no_value_on_the_host(kind):
    """Under fake tensors a host read (.item(), .tolist(), a value-dependent shape) raises: the
    decode step holds none, so a CUDA graph can capture it."""
    args, state, _ = _case(kind, DECODE, torch.float32)
    with FakeTensorMode() as mode:
        fake = [mode.from_tensor(t) for t in (*args, state)]
        meta = {k: mode.from_tensor(v) for k, v in DECODE.metadata().items()}
        out = IMPLS[kind]["torch"](*fake, **meta)
    assert out.shape[0] == DECODE.num_tokens
