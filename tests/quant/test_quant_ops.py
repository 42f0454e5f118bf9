"""The quantized linear ops: torch references against independent arithmetic, fused variants against
their composition, fakes, and the CUDA dispatch (kernel choice and the agreed kernel signatures,
with recording stand-ins for ``autodeploy.kernels.quant_gemv`` / ``quant_gemm``)."""

import sys
import types

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

import autodeploy.ops  # noqa: F401  (registers the ops)
from autodeploy.ops import quant_linear as ql
from autodeploy.quantization import numerics as nm

ops = torch.ops.autodeploy
FP8 = torch.float8_e4m3fn


def _fp8_weight(kind, n=48, k=64):
    w = torch.randn(n, k)
    if kind == "block":
        return (*nm.quantize_fp8_blocks(w, (16, 32)), [16, 32])
    q, s = nm.quantize_fp8_per_channel(w) if kind == "channel" else nm.quantize_fp8_per_tensor(w)
    return q, s, None


def test_fp8_static_per_tensor_is_the_fp8_gemm_arithmetic():
    x, bias = torch.randn(5, 64), torch.randn(48)
    q, ws, _ = _fp8_weight("tensor")
    xs = torch.tensor(0.02)
    want = ((x / xs).clamp(-448, 448).to(FP8).float() * xs) @ (q.float() * ws).T + bias
    got = ops.fp8_linear(x, q, ws, xs, bias, None, "static")
    torch.testing.assert_close(got, want)


def test_fp8_dynamic_per_token_per_channel():
    x = torch.randn(3, 64) * torch.tensor([[0.1], [1.0], [30.0]])
    q, ws, _ = _fp8_weight("channel")
    row_scale = x.abs().amax(1, keepdim=True) / 448
    want = ((x / row_scale).to(FP8).float() * row_scale) @ (q.float() * ws[:, None]).T
    torch.testing.assert_close(ops.fp8_linear(x, q, ws, None, None, None, "token"), want)


def test_fp8_block_scales_with_token_group_activations():
    x = torch.randn(4, 64)
    q, ws, block = _fp8_weight("block")
    groups = x.reshape(4, 2, 32)
    gs = groups.abs().amax(-1, keepdim=True) / 448
    xq = ((groups / gs).to(FP8).float() * gs).reshape(4, 64)
    w = q.float() * ws.repeat_interleave(16, 0)[:48].repeat_interleave(32, 1)
    torch.testing.assert_close(ops.fp8_linear(x, q, ws, None, None, block, "group"), xq @ w.T)


@pytest.mark.parametrize("kind", ["tensor", "channel", "block"])
def test_fp8_weight_only_is_a_linear_on_the_dequantized_weight(kind):
    x = torch.randn(2, 7, 64, dtype=torch.bfloat16)
    q, ws, block = _fp8_weight(kind)
    got = ops.fp8_linear(x, q, ws, None, None, block, "none")
    want = (x.float() @ nm.dequantize_fp8(q, ws, tuple(block) if block else None).T).to(torch.bfloat16)
    assert got.dtype == torch.bfloat16 and got.shape == (2, 7, 48)
    torch.testing.assert_close(got, want)


def test_nvfp4_linear_is_weight_only():
    x, bias = torch.randn(6, 64), torch.randn(32)
    packed, scale, scale_2 = nm.quantize_nvfp4(torch.randn(32, 64))
    want = F.linear(x, nm.dequantize_nvfp4(packed, scale, scale_2), bias)
    torch.testing.assert_close(ops.nvfp4_linear(x, packed, scale, scale_2, bias), want)


def test_fused_variants_are_their_composition():
    x, r, nw = torch.randn(3, 64), torch.randn(3, 64), torch.rand(64) + 0.5
    q, ws, _ = _fp8_weight("channel", n=64)
    lin = (q, ws, None, None, None, "token")
    normed = ops.rms_norm(x, nw, 1e-6)
    torch.testing.assert_close(ops.fp8_rms_norm_linear(x, nw, 1e-6, *lin), ops.fp8_linear(normed, *lin))
    out, summed = ops.fp8_add_rms_norm_linear(x, r, nw, 1e-6, *lin)
    torch.testing.assert_close(summed, x + r)
    torch.testing.assert_close(out, ops.fp8_linear(ops.rms_norm(x + r, nw, 1e-6), *lin))
    gate_up = torch.randn(3, 128)
    q2, ws2, _ = _fp8_weight("channel", n=64, k=64)
    hidden = F.silu(gate_up[:, :64]) * gate_up[:, 64:]
    torch.testing.assert_close(ops.fp8_swiglu_down(gate_up, q2, ws2, None, None, None, "token", "silu"),
                               ops.fp8_linear(hidden, q2, ws2, None, None, None, "token"))
    packed, scale, scale_2 = nm.quantize_nvfp4(torch.randn(64, 64))
    torch.testing.assert_close(ops.nvfp4_rms_norm_linear(x, nw, 1e-6, packed, scale, scale_2),
                               ops.nvfp4_linear(normed, packed, scale, scale_2))
    torch.testing.assert_close(ops.nvfp4_swiglu_down(gate_up, packed, scale, scale_2, None, "silu"),
                               ops.nvfp4_linear(hidden, packed, scale, scale_2))


def test_fakes_give_output_shapes_and_dtypes():
    with FakeTensorMode():
        x = torch.empty(2, 5, 64, dtype=torch.bfloat16)
        w8, s8 = torch.empty(48, 64, dtype=FP8), torch.empty(48)
        assert ops.fp8_linear(x, w8, s8, None, None, None, "token").shape == (2, 5, 48)
        w4, s4 = torch.empty(48, 32, dtype=torch.uint8), torch.empty(48, 4, dtype=FP8)
        out = ops.nvfp4_add_rms_norm_linear(x, x, torch.empty(64), 1e-6, w4, s4, torch.empty(()))
        assert out[0].shape == (2, 5, 48) and out[1].dtype == torch.bfloat16
        assert ops.fp8_swiglu_down(torch.empty(5, 128), w8, s8).shape == (5, 48)


@pytest.mark.parametrize("rows, on_gpu, kind, activations, path", [
    (1, False, "fp8", "token", "reference"), (4, True, "fp8", "static", "gemv"),
    (5, True, "fp8", "token", "weight_only"), (16, True, "fp8", "static", "weight_only"), (17, True, "fp8", "token", "gemm"),
    (64, True, "fp8", "none", "weight_only"), (1, True, "nvfp4", "none", "gemv"), (64, True, "nvfp4", "none", "gemm"),
])
def test_kernel_choice(rows, on_gpu, kind, activations, path):
    assert ql.quant_kernel(rows, on_gpu, kind, activations) == path


@pytest.fixture
def kernels(monkeypatch):
    """Recording stand-ins for the kernel modules (the reference math), and 'CUDA' inputs."""
    calls = []

    def record(name, result):
        def kernel(*args, **kwargs):
            calls.append((name, args, kwargs))
            return result(*args, **kwargs)
        return kernel

    gemv = types.ModuleType("autodeploy.kernels.quant_gemv")
    gemv.fp8_gemv = record("fp8_gemv", lambda x, w, s, block_size=None, bias=None:
                           ql.fp8_linear_reference(x, w, s, None, bias, block_size, "none"))
    gemv.nvfp4_gemv = record("nvfp4_gemv", lambda x, w, s, s2, bias=None: ql.nvfp4_linear_reference(x, w, s, s2, bias))
    gemm = types.ModuleType("autodeploy.kernels.quant_gemm")
    gemm.fp8_gemm = record("fp8_gemm", lambda x, w, s, input_scale=None, block_size=None, bias=None:
                           ql.fp8_linear_reference(x, w, s, input_scale, bias, block_size,
                                                   "static" if input_scale is not None else "token"))
    gemm.fp8_weight_only_gemm = record("fp8_weight_only_gemm", lambda x, w, s, block_size=None, bias=None:
                                       ql.fp8_linear_reference(x, w, s, None, bias, block_size, "none"))
    gemm.nvfp4_gemm = record("nvfp4_gemm", lambda x, w, s, s2, bias=None: ql.nvfp4_linear_reference(x, w, s, s2, bias))
    monkeypatch.setitem(sys.modules, gemv.__name__, gemv)
    monkeypatch.setitem(sys.modules, gemm.__name__, gemm)
    monkeypatch.setattr(ql, "use_triton", lambda t: True)
    return calls


def test_cuda_dispatch_calls_the_agreed_signatures(kernels):
    x = torch.randn(2, 12, 64)
    q, ws, block = _fp8_weight("block")
    bias = torch.randn(48)
    out = ql._fp8(x[:, :1], q, ws, None, bias, block, "group")  # 2 rows: the GEMV, block size as a tuple
    name, args, kwargs = kernels[-1]
    assert name == "fp8_gemv" and args[0].shape == (2, 64) and kwargs == {"block_size": (16, 32), "bias": bias}
    assert out.shape == (2, 1, 48)
    q, ws, _ = _fp8_weight("tensor")
    out = ql._fp8(x, q, ws, torch.tensor(0.5), None, None, "static")  # 24 rows: the GEMM, static input scale
    name, args, kwargs = kernels[-1]
    assert name == "fp8_gemm" and args[0].shape == (24, 64) and torch.equal(kwargs["input_scale"], torch.tensor(0.5))
    torch.testing.assert_close(out, ql.fp8_linear_reference(x, q, ws, torch.tensor(0.5), None, None, "static"))
    ql._fp8(x, q, ws, None, None, None, "token")
    assert kernels[-1][0] == "fp8_gemm" and kernels[-1][2]["input_scale"] is None  # dynamic: no scale given
    ql._fp8(x, q, ws, None, None, None, "none")  # FP8 weight-only at any rows: the weight-only tensor-core GEMM
    assert kernels[-1][0] == "fp8_weight_only_gemm"
    ql._fp8(x[:, :3], q, ws, None, None, None, "token")  # 6 rows: weight-only too (no quantizer launch)
    assert kernels[-1][0] == "fp8_weight_only_gemm" and kernels[-1][1][0].shape == (6, 64) and len(kernels) == 5


def test_cuda_dispatch_of_nvfp4_with_per_row_global_scales(kernels):
    x, bias = torch.randn(8, 64), torch.randn(32)
    packed, scale, scale_2 = nm.quantize_nvfp4(torch.randn(32, 64))
    per_row = scale_2 * torch.linspace(1, 2, 32)
    got = ql._nvfp4(x, packed, scale, per_row, bias)
    name, args, kwargs = kernels[-1]
    assert name == "nvfp4_gemm" and args[3] is per_row and kwargs == {"bias": bias}  # applied in the kernel
    torch.testing.assert_close(got, ql.nvfp4_linear_reference(x, packed, scale, per_row, bias))
    ql._nvfp4(x[:1], packed, scale, per_row, bias)  # one row: the GEMV, likewise
    assert kernels[-1][0] == "nvfp4_gemv" and kernels[-1][1][3] is per_row


@pytest.mark.parametrize("rows, activations, block_scaled, path", [
    (1, "token", False, "small_m"), (16, "static", False, "small_m"), (17, "token", False, "gemm"),
    (1, "none", False, "gemv"), (1, "group", True, "gemv"), (1, "token", True, "gemv"), (0, "token", False, "gemv"),
])
def test_kernel_choice_with_the_small_m_switch(monkeypatch, rows, activations, block_scaled, path):
    monkeypatch.setattr(ql, "FP8_SMALL_M_MAX_ROWS", 16)  # AUTODEPLOY_FP8_SMALL_M_MAX_ROWS=16
    assert ql.quant_kernel(rows, True, "fp8", activations, block_scaled) == path
    assert ql.quant_kernel(rows, True, "nvfp4") == ("gemv" if rows <= 4 else "gemm")  # NVFP4: unchanged


@pytest.fixture
def small_m_calls(monkeypatch):
    """The switch on, 'CUDA' inputs, and the swap-AB kernel (run by the Triton interpreter) recorded."""
    from autodeploy.kernels import fp8_small_m

    calls, kernel = [], fp8_small_m.fp8_small_m_gemm
    monkeypatch.setattr(ql, "FP8_SMALL_M_MAX_ROWS", 16)
    monkeypatch.setattr(ql, "use_triton", lambda t: True)
    monkeypatch.setattr(fp8_small_m, "fp8_small_m_gemm", lambda *a, **k: calls.append(a[0].shape) or kernel(*a, **k))
    return calls


@pytest.mark.parametrize("activations", ["token", "static"])
def test_small_m_switch_runs_every_fp8_op_on_the_swap_ab_kernel(small_m_calls, activations):
    """Each op (the fused ones through norm_quantize) on the kernel, against the torch reference."""
    x, r, nw, gate_up = torch.randn(2, 3, 64), torch.randn(2, 3, 64), torch.rand(64) + 0.5, torch.randn(3, 128)
    q, ws, _ = _fp8_weight("channel")
    lin = (q, ws, torch.tensor(0.05) if activations == "static" else None, torch.randn(48), None, activations)
    want = ql.fp8_linear_reference(x, *lin[:2], lin[2], lin[3], None, activations)
    torch.testing.assert_close(ops.fp8_linear(x, *lin), want, rtol=1e-4, atol=1e-4)
    normed = ql.rms_norm(x + r, nw, 1e-6)
    out, summed = ops.fp8_add_rms_norm_linear(x, r, nw, 1e-6, *lin)
    torch.testing.assert_close(summed, x + r)
    torch.testing.assert_close(out, ql.fp8_linear_reference(normed, *lin[:2], lin[2], lin[3], None, activations),
                               rtol=1e-4, atol=1e-4)
    q2, ws2, _ = _fp8_weight("tensor", n=48, k=64)
    hidden = F.silu(gate_up[:, :64]) * gate_up[:, 64:]
    torch.testing.assert_close(ops.fp8_swiglu_down(gate_up, q2, ws2, lin[2], None, None, activations, "silu"),
                               ql.fp8_linear_reference(hidden, q2, ws2, lin[2], None, None, activations),
                               rtol=1e-4, atol=1e-4)
    assert small_m_calls == [(6, 64), (6, 64), (3, 64)]



@pytest.fixture
def gemv_steps(monkeypatch):
    """'CUDA' inputs on the real quantized GEMVs (the Triton interpreter; NVFP4's one row: the word kernel), the
    prologue of each launch recorded."""
    from autodeploy.kernels import nvfp4_gemv, quant_gemv

    steps, launch, one_row = [], quant_gemv._launch, nvfp4_gemv.launch_one_row
    monkeypatch.setattr(ql, "use_triton", lambda t: True)
    monkeypatch.setattr(quant_gemv, "_launch", lambda *a: steps.append(a[8].kind.name) or launch(*a))
    monkeypatch.setattr(nvfp4_gemv, "launch_one_row", lambda *a: steps.append(a[5].kind.name) or one_row(*a))
    return steps


def _linears(activations, bias, n=48, k=64):
    """(fused op prefix, linear args after x, the weight-only reference of an operand) per weight kind: FP8
    per tensor, per channel, per block; NVFP4 with per-row global scales (fused parts')."""
    for kind in ("tensor", "channel", "block"):
        q, ws, block = _fp8_weight(kind, n, k)
        yield ("fp8", (q, ws, None, bias, block, activations),
               lambda a, q=q, ws=ws, block=block: ql.fp8_linear_reference(a, q, ws, None, bias, block, "none"))
    packed, scale, scale_2 = nm.quantize_nvfp4(torch.randn(n, k))
    per_row = scale_2 * torch.linspace(0.5, 2, n)
    yield ("nvfp4", (packed, scale, per_row, bias),
           lambda a: ql.nvfp4_linear_reference(a, packed, scale, per_row, bias))


def _check_fused_ops(rows, activations):
    """Each fused op of each weight kind against the weight-only linear of its step's torch reference."""
    x, r, nw = torch.randn(1, rows, 64) * 4, torch.randn(1, rows, 64), torch.rand(64) + 0.5
    gate_up = torch.randn(rows, 128)
    for fmt, lin, reference in _linears(activations, torch.randn(48)):
        op = lambda name: getattr(ops, f"{fmt}_{name}")  # noqa: E731
        close = dict(rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(op("rms_norm_linear")(x, nw, 1e-6, *lin), reference(ops.rms_norm(x, nw, 1e-6)),
                                   **close)
        out, summed = op("add_rms_norm_linear")(x, r, nw, 1e-6, *lin)
        torch.testing.assert_close(summed, x + r, rtol=0, atol=0)
        torch.testing.assert_close(out, reference(ops.rms_norm(x + r, nw, 1e-6)), **close)
        hidden = F.silu(gate_up[:, :64]) * gate_up[:, 64:]
        torch.testing.assert_close(op("swiglu_down")(gate_up, *lin, activation="silu"), reference(hidden), **close)


@pytest.mark.parametrize("folded", ["1", "0", "rms_norm,add_rms_norm", "fp8:all"])
def test_fused_ops_fold_their_step_into_the_gemv(gemv_steps, monkeypatch, folded):
    """At the "gemv" path (activations per token: the GEMV leaves them unquantized) each fused op is one launch
    with its step as the prologue; AUTODEPLOY_QUANT_GEMV_PROLOGUE puts the steps it leaves out before a plain
    GEMV again."""
    monkeypatch.setattr(ql, "QUANT_GEMV_PROLOGUE", ql._folded_from_env(folded))
    _check_fused_ops(1, "token")
    all_steps, none = ["RMS_NORM", "ADD_RMS_NORM", "GATED"], ["NONE"] * 3
    fp8, nvfp4 = {"1": (all_steps, all_steps), "0": (none, none), "fp8:all": (all_steps, none),
                  "rms_norm,add_rms_norm": (["RMS_NORM", "ADD_RMS_NORM", "NONE"],) * 2}[folded]
    assert gemv_steps == fp8 * 3 + nvfp4  # FP8 per tensor, channel, block; NVFP4


def test_fused_ops_past_the_folding_rows_keep_the_step_apart(gemv_steps, monkeypatch):
    monkeypatch.setattr(ql, "QUANT_GEMV_PROLOGUE_MAX_ROWS", 1)  # AUTODEPLOY_QUANT_GEMV_PROLOGUE_MAX_ROWS=1
    _check_fused_ops(2, "none")
    assert gemv_steps == ["NONE"] * 12  # 2 rows: the GEMV still, the step before it


def test_the_folded_steps_from_the_environment():
    every = {(f, s) for f in ql.FORMATS for s in ql.STEPS}
    assert ql._folded_from_env("1") == ql._folded_from_env("all") == every
    assert ql._folded_from_env(None) == set()  # unset: every step apart (DEFAULT_FOLDED: measured slower folded)
    assert ql._folded_from_env("0") == ql._folded_from_env("") == set()
    assert ql._folded_from_env(" gated , NVFP4:rms_norm") == {("fp8", "GATED"), ("nvfp4", "GATED"),
                                                               ("nvfp4", "RMS_NORM")}
    for bad in ("norm", "fp4:all", "fp8:"):
        with pytest.raises(ValueError, match="is none of 1, 0, STEP, FORMAT:STEP, FORMAT:all"):
            ql._folded_from_env(bad)


def test_fused_ops_past_the_gemv_rows_keep_the_step_before_the_gemm(kernels):
    """24 rows, weight-only: the tensor-core GEMMs (recording stand-ins) after the norm / activation op."""
    _check_fused_ops(24, "none")
    assert [name for name, *_ in kernels] == ["fp8_weight_only_gemm"] * 9 + ["nvfp4_gemm"] * 3
