"""The small-batch GEMV with fused prologues against the torch ops it replaces (Triton interpreter)."""

import pytest
import torch
import torch.nn.functional as F

from dataclasses import replace

from autodeploy.kernels.gemv import GemvLaunch, Prologue, Trigger, gemv
from autodeploy.ops.mlp import ACTIVATIONS
from autodeploy.ops.norm import rms_norm_reference

DTYPES = [torch.float32, torch.float16]
# several programs and K blocks at test sizes; the first weight tile loaded in the loop or before the
# (GPU-only) PDL wait, after which the loop starts at the second tile
SMALL = GemvLaunch(block_n=16, block_k=32, trigger=Trigger.START, preload=False)
PRELOADED = replace(SMALL, preload=True, trigger=Trigger.AFTER_WAIT)
LAUNCHES = pytest.mark.parametrize("launch", [SMALL, PRELOADED], ids=["loop", "preload"])


def _rel_err(got, want):
    return ((got.double() - want.double()).norm() / want.double().norm()).item()


def _bound(dtype):
    return 1e-5 if dtype == torch.float32 else 3e-3


def _inputs(m, k, n, dtype, cols=None):
    x = torch.randn(m, cols or k).to(dtype)
    w = (torch.randn(n, k) / k**0.5).to(dtype)
    return x, w


@LAUNCHES
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m", [1, 3, 4])
@pytest.mark.parametrize("k", [80, 20])  # masked tails of several K blocks; a K of one partial block
def test_plain_gemv_with_and_without_bias(dtype, m, k, launch):
    x, w = _inputs(m, k, 40, dtype)  # N not a multiple of the block either
    bias = torch.randn(40).to(dtype)
    for b in (None, bias):
        out, summed = gemv(x, w, b, prologue=Prologue.NONE, launch=launch)
        assert summed is None and out.shape == (m, 40)
        assert _rel_err(out, F.linear(x.float(), w.float(), None if b is None else b.float())) < _bound(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_prologue(dtype):
    x, w = _inputs(4, 96, 48, dtype)
    x = x * 30  # rows far from unit RMS: the norm's scale matters
    norm_w = (1 + 0.1 * torch.randn(96)).to(dtype)
    out, _ = gemv(x.view(1, 4, 96), w, prologue=Prologue.RMS_NORM, norm_weight=norm_w, eps=1e-6, launch=SMALL)
    want = F.linear(rms_norm_reference(x, norm_w, 1e-6).float(), w.float())
    assert out.shape == (1, 4, 48) and _rel_err(out.view(4, 48), want) < _bound(dtype)


@LAUNCHES
@pytest.mark.parametrize("dtype", DTYPES)
def test_add_rms_norm_prologue_returns_the_sum_exactly(dtype, launch):
    x, w = _inputs(2, 64, 64, dtype)
    residual, norm_w = torch.randn(2, 64).to(dtype), torch.randn(64).to(dtype)
    bias = torch.randn(64).to(dtype)
    out, summed = gemv(x, w, bias, prologue=Prologue.ADD_RMS_NORM, residual=residual, norm_weight=norm_w, eps=1e-5,
                       launch=launch)
    want_sum = x + residual
    torch.testing.assert_close(summed, want_sum, atol=0, rtol=0)
    want = F.linear(rms_norm_reference(want_sum, norm_w, 1e-5).float(), w.float(), bias.float())
    assert _rel_err(out, want) < _bound(dtype)


@LAUNCHES
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("activation", sorted(ACTIVATIONS))
def test_gated_prologue_reads_gate_and_up_halves(dtype, activation, launch):
    gate_up, w = _inputs(3, 48, 32, dtype, cols=96)
    out, _ = gemv(gate_up, w, prologue=Prologue.GATED, activation=activation, launch=launch)
    gate, up = gate_up.float().chunk(2, dim=-1)
    hidden = (ACTIVATIONS[activation](gate) * up).to(dtype)  # act_mul rounds once, as the kernel does
    assert _rel_err(out, F.linear(hidden.float(), w.float())) < _bound(dtype)


@LAUNCHES
def test_fp16_norm_operand_does_not_overflow_where_the_reference_does_not(launch):
    """x * w would overflow fp16 (300 * 300 > 65504); x * w / rms does not: fp16 takes two passes."""
    x = torch.full((1, 64), 300.0, dtype=torch.float16)
    norm_w = torch.full((64,), 300.0, dtype=torch.float16)
    w = (torch.randn(16, 64) / 64).to(torch.float16)
    out, _ = gemv(x, w, prologue=Prologue.RMS_NORM, norm_weight=norm_w, eps=1e-6, launch=launch)
    want = F.linear(rms_norm_reference(x, norm_w, 1e-6).float(), w.float())
    assert torch.isfinite(out).all() and _rel_err(out, want) < 3e-3


def test_bad_inputs_are_refused():
    x, w = torch.randn(2, 32), torch.randn(16, 32)
    with pytest.raises(ValueError, match="columns"):
        gemv(x, w, prologue=Prologue.GATED)  # a gated prologue needs 2K columns
    with pytest.raises(ValueError, match="at most 4 rows"):
        gemv(torch.randn(5, 32), w)
    empty, _ = gemv(x[:0], w)
    assert empty.shape == (0, 16)


@pytest.mark.parametrize("rows", [1, 2])  # the GEMV path, and past GEMV_MAX_ROWS (1) the unfused pieces
def test_fused_linear_ops_take_the_gemv_only_for_few_rows(monkeypatch, rows):
    """The ops as CUDA runs them (use_triton forced on; the kernel runs in the interpreter) equal
    their CPU composition, and only small calls launch the GEMV."""
    from autodeploy.kernels import gemv as gemv_module
    from autodeploy.ops import fused_linear

    launched = []
    monkeypatch.setattr(fused_linear, "use_triton", lambda t: True)
    original = gemv_module._launch
    monkeypatch.setattr(gemv_module, "_launch", lambda *a: launched.append(a) or original(*a))
    x, w = torch.randn(1, rows, 32), torch.randn(48, 32) / 6
    residual, norm_w, bias = torch.randn(1, rows, 32), 1 + 0.1 * torch.randn(32), torch.randn(48)
    ops = torch.ops.autodeploy

    got = ops.rms_norm_linear(x, norm_w, 1e-6, w, bias)
    torch.testing.assert_close(got, F.linear(rms_norm_reference(x, norm_w, 1e-6), w, bias), atol=1e-5, rtol=1e-5)
    got, summed = ops.add_rms_norm_linear(x, residual, norm_w, 1e-6, w, None)
    torch.testing.assert_close(summed, x + residual, atol=0, rtol=0)
    want = F.linear(rms_norm_reference(x + residual, norm_w, 1e-6), w)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    gate_up = torch.randn(1, rows, 96)
    got = ops.swiglu_down(gate_up, w.t().contiguous(), "silu")
    gate, up = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(got, F.linear(F.silu(gate) * up, w.t()), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ops.linear(x, w, bias), F.linear(x, w, bias), atol=1e-5, rtol=1e-5)
    assert len(launched) == (4 if rows <= fused_linear.GEMV_MAX_ROWS else 0)
    if rows == 1:  # a weight past GEMV_MAX_WEIGHT_BYTES goes to the GEMM
        monkeypatch.setattr(fused_linear, "GEMV_MAX_WEIGHT_BYTES", w.numel() * w.element_size() - 1)
        ops.rms_norm_linear(x, norm_w, 1e-6, w, bias)
        torch.testing.assert_close(ops.linear(x, w), F.linear(x, w), atol=0, rtol=0)
        assert len(launched) == 4


def test_a_trace_buffer_of_the_wrong_shape_is_refused():
    from autodeploy.kernels import trace

    x, w = _inputs(1, 64, 40, torch.float32)
    with pytest.raises(ValueError, match="trace buffer must be int64"):
        gemv(x, w, launch=SMALL, trace_buffer=trace.buffer(2, torch.device("cpu")))  # 3 programs of 16 features
