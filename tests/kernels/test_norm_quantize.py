"""The step before an FP8 GEMM fused with the activation quantizer (``kernels/norm_quantize.py``) against
the two steps apart: the torch step rounded to the activations' dtype, then the quantizer's reference
(Triton interpreter, fp32 and fp16)."""

import pytest
import torch

from autodeploy.kernels import quant_reference as ref
from autodeploy.kernels.norm_quantize import act_mul_quantize, rms_norm_quantize

from test_quant_gemv import DTYPES


def _rms_norm(x, weight, eps):
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(x.dtype)


def _dequantized(q, scale):
    return q.float() * scale.float()


def _close(got, want):
    """Same e4m3 values up to the rare one-step disagreement that a last-bit difference of the rounded
    input (the norm's sum of squares taken in another order) can move across a rounding boundary."""
    (q, scale), (want_q, want_scale) = got, want
    torch.testing.assert_close(scale, want_scale, rtol=1e-2, atol=0)
    differ = (q.view(torch.uint8) != want_q.view(torch.uint8)).float().mean().item()
    assert differ < 0.01
    err = (_dequantized(q, scale) - _dequantized(want_q, want_scale)).norm() / _dequantized(want_q, want_scale).norm()
    assert err < 1e-2


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("static", [False, True])
def test_rms_norm_quantize_equals_the_norm_then_the_quantizer(dtype, static):
    x = (torch.randn(5, 3, 96) * 4).to(dtype)
    x[1, 0] = 0.0  # a zero row: a finite scale, zeros
    weight, scale = (torch.rand(96) + 0.5).to(dtype), torch.tensor(0.02) if static else None
    q, found, summed = rms_norm_quantize(x, weight, 1e-6, scale)
    assert q.shape == x.shape and q.dtype == torch.float8_e4m3fn and summed is None
    assert found is scale if static else found.shape == (5, 3, 1)
    _close((q, found), ref.fp8_quantize_reference(_rms_norm(x, weight, 1e-6), scale))
    assert torch.count_nonzero(q[1, 0].view(torch.uint8)) == 0


@pytest.mark.parametrize("dtype", DTYPES)
def test_add_rms_norm_quantize_returns_the_sum_it_normalized(dtype):
    x, residual = torch.randn(4, 80).to(dtype), torch.randn(4, 80).to(dtype)
    weight = (torch.rand(80) + 0.5).to(dtype)
    q, found, summed = rms_norm_quantize(x, weight, 1e-5, residual=residual)
    want_sum = (x.float() + residual.float()).to(dtype)
    assert torch.equal(summed, want_sum)
    _close((q, found), ref.fp8_quantize_reference(_rms_norm(want_sum, weight, 1e-5)))


@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_act_mul_quantize_equals_the_activation_then_the_quantizer(activation, dtype):
    gate_up = (torch.randn(6, 2 * 72) * 3).to(dtype)
    gate, up = gate_up.float().chunk(2, dim=-1)
    act = torch.nn.functional.silu(gate) if activation == "silu" else torch.nn.functional.gelu(gate, approximate="tanh")
    q, found = act_mul_quantize(gate_up, activation)
    assert q.shape == (6, 72) and found.shape == (6, 1)
    _close((q, found), ref.fp8_quantize_reference((act * up).to(dtype)))


def test_bad_inputs_are_refused():
    x = torch.randn(2, 64)
    with pytest.raises(ValueError, match="must match x"):
        rms_norm_quantize(x, torch.ones(64), 1e-6, residual=torch.randn(2, 64, dtype=torch.float16))
    with pytest.raises(ValueError, match="one float32 value"):
        rms_norm_quantize(x, torch.ones(64), 1e-6, torch.ones(2))
    with pytest.raises(ValueError, match="unknown activation"):
        act_mul_quantize(x, "relu2")
    with pytest.raises(ValueError, match="odd number of columns"):
        act_mul_quantize(torch.randn(2, 63))
    with pytest.raises(ValueError, match="at most 16384 columns"):
        rms_norm_quantize(torch.randn(1, 16385), torch.ones(16385), 1e-6)


@pytest.mark.parametrize("op", ["rms_norm_linear", "add_rms_norm_linear", "swiglu_down"])
@pytest.mark.parametrize("activations", ["token", "static"])
def test_fused_fp8_ops_quantize_in_the_step_beyond_the_weight_only_rows(monkeypatch, op, activations):
    """The canonical FP8 fused ops on 'CUDA' (the interpreter) at 20 rows: the step and the quantizer in
    one kernel, then the FP8 GEMM of the quantized rows; equal to the reference path (the step, the fake
    quantization, the dequantized linear) but for the GEMM's fp32 summation order."""
    import autodeploy.kernels.norm_quantize as nq
    from autodeploy.ops import quant_linear as ql

    n, k = 40, 64
    x = torch.randn(4, 5, 2 * k if op == "swiglu_down" else k, dtype=torch.float16)
    residual, norm_weight = torch.randn(4, 5, k, dtype=torch.float16), torch.rand(k, dtype=torch.float16) + 0.5
    weight = (torch.randn(n, k) * 40).clamp(-448, 448).to(torch.float8_e4m3fn)
    linear = (weight, torch.rand(n) * 0.02 + 1e-3, torch.tensor(0.05) if activations == "static" else None,
              torch.randn(n, dtype=torch.float16), None, activations)
    fn = getattr(ql, f"fp8_{op}")
    args = {"rms_norm_linear": (x, norm_weight, 1e-5), "add_rms_norm_linear": (x, residual, norm_weight, 1e-5),
            "swiglu_down": (x,)}[op] + linear
    want = fn(*args)
    fused = []
    for name in ("rms_norm_quantize", "act_mul_quantize"):
        kernel = getattr(nq, name)
        monkeypatch.setattr(nq, name, lambda *a, kernel=kernel, **kw: fused.append(kernel) or kernel(*a, **kw))
    monkeypatch.setattr(ql, "use_triton", lambda t: True)
    got = fn(*args)
    assert len(fused) == 1
    for g, w in zip(got if isinstance(got, tuple) else (got,), want if isinstance(want, tuple) else (want,)):
        assert g.shape == w.shape and g.dtype == w.dtype
        assert ((g.float() - w.float()).norm() / w.float().norm()).item() < 2e-2
