"""The quantized-linear kernels compiled for the GPU, in bf16, against their references (no timing:
bench/probes/quant_kernels.py times them). Skipped without CUDA; conftest turns the interpreter on, so run

    TRITON_INTERPRET=0 python -m pytest -q -m gpu tests/kernels/test_quant_gpu.py
"""

import os

import pytest
import torch

from autodeploy.kernels import quant_reference as ref
from autodeploy.kernels.fp8_small_m import fp8_small_m_gemm
from autodeploy.kernels.quant_gemm import fp8_gemm, fp8_quantize, nvfp4_gemm
from autodeploy.kernels.quant_gemv import QuantGemvLaunch, fp8_gemv, nvfp4_gemv

from test_quant_gemv import fp8_scale, fp8_weight, nvfp4_weight, rel_err

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1",
                       reason="needs a CUDA device and TRITON_INTERPRET=0"),
]
BF16 = 1e-2
SHAPES = [(4096 + 48, 4096), (1000, 4000)]  # N ragged; K not a multiple of 16 bytes (unaligned rows)


def cuda(*tensors):
    return [t.cuda() if isinstance(t, torch.Tensor) else t for t in tensors]


@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("kind", ["tensor", "channel", "block"])
@pytest.mark.parametrize("m", [1, 4])
def test_fp8_gemv(n, k, kind, m):
    scale, block = fp8_scale(kind, n, k, block=(128, 128))
    weight, scale, x, bias = cuda(fp8_weight(n, k), scale, torch.randn(m, k, dtype=torch.bfloat16),
                                  torch.randn(n, dtype=torch.bfloat16))
    got = fp8_gemv(x, weight, scale, block, bias)
    assert rel_err(got, ref.fp8_weight_only_reference(x, weight, scale, block, bias)) < BF16


@pytest.mark.parametrize("m", [1, 4])
def test_nvfp4_gemv(m):
    packed, scale, scale_2, x = cuda(*nvfp4_weight(4096 + 48, 4096),
                                     torch.randn(m, 4096, dtype=torch.bfloat16))
    got = nvfp4_gemv(x, packed, scale, scale_2)
    assert rel_err(got, ref.nvfp4_linear_reference(x, packed, scale, scale_2)) < BF16


@pytest.mark.parametrize("n,k", [(4096 + 48, 4096), (1000, 4000), (96, 14336)])  # ragged N; 3.9 tiles; 7 tiles
@pytest.mark.parametrize("launch", [None, QuantGemvLaunch(8, 512, 1), QuantGemvLaunch(2, 2048, 2)],
                         ids=["default", "8x512", "2x2048"])
@pytest.mark.usefixtures("word_kernel_on")
def test_nvfp4_one_row_word_kernel(n, k, launch):
    """The one-row kernel of nvfp4_gemv.py (E2M1_WORD_ASM, bf16 pairs widened by PTX) on activations spanning
    1e-3..1e4 (outliers an fp16 sum would not hold), with a bias."""
    x = torch.randn(1, k) * torch.logspace(-3, 4, k)[torch.randperm(k)]
    packed, scale, scale_2, x, bias = cuda(*nvfp4_weight(n, k), x.bfloat16(), torch.randn(n, dtype=torch.bfloat16))
    got = nvfp4_gemv(x, packed, scale, scale_2, bias, launch=launch)
    assert rel_err(got, ref.nvfp4_linear_reference(x, packed, scale, scale_2, bias)) < BF16


@pytest.mark.usefixtures("word_kernel_on")
def test_nvfp4_one_row_activations_off_a_word_boundary():
    """bf16 activations 2 bytes past a 4-byte boundary: read one at a time, not as pairs."""
    packed, scale, scale_2 = cuda(*nvfp4_weight(512, 4096))
    x = torch.randn(1, 4097, device="cuda", dtype=torch.bfloat16)[:, 1:]
    assert x.data_ptr() % 4 == 2
    got = nvfp4_gemv(x, packed, scale, scale_2)
    assert rel_err(got, ref.nvfp4_linear_reference(x, packed, scale, scale_2)) < BF16


@pytest.mark.usefixtures("word_kernel_on")
def test_nvfp4_one_row_every_byte_and_scale_exactly():
    packed = torch.stack([torch.arange(256, dtype=torch.uint8).roll(37 * p) for p in range(8)], 1)
    finite = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float().abs().nan_to_num(1.0)
    scale = finite.to(torch.float8_e4m3fn)[torch.randperm(256)].reshape(256, 1)
    packed, scale, scale_2 = cuda(packed, scale, torch.tensor(0.75))
    want = ref.dequantize_nvfp4(packed, scale, scale_2)
    for element in range(16):
        x = torch.zeros(1, 16, device="cuda", dtype=torch.bfloat16)
        x[0, element] = 1.0
        got = nvfp4_gemv(x.float(), packed, scale, scale_2)  # fp32 out: the exact dequantized value
        torch.testing.assert_close(got[0], want[:, element], rtol=0, atol=0)


@pytest.mark.usefixtures("word_kernel_on")
@pytest.mark.parametrize("step", ["RMS_NORM", "ADD_RMS_NORM", "GATED"])
@pytest.mark.parametrize("kind", ["channel", "block", "nvfp4"])
@pytest.mark.parametrize("m", [1, 4])
def test_gemv_with_its_step_folded_in(step, kind, m):
    """The quantized GEMVs with a prologue, in bf16, against the step's reference then the weight-only linear;
    NVFP4 with a global scale per row (fused parts')."""
    from autodeploy.kernels.gemv import GemvPrologue, Prologue
    from autodeploy.kernels.quant_gemv import fp8_prologue_gemv, nvfp4_prologue_gemv
    from autodeploy.ops.norm import rms_norm_reference

    n, k = 4096 + 48, 4096
    cols = 2 * k if step == "GATED" else k
    x, residual, norm_w = cuda(torch.randn(m, cols, dtype=torch.bfloat16) * 3, torch.randn(m, k, dtype=torch.bfloat16),
                               torch.rand(k, dtype=torch.bfloat16) + 0.5)
    if step == "GATED":
        gate, up = x.float().chunk(2, dim=-1)
        operand, prologue = (torch.nn.functional.silu(gate) * up).bfloat16(), GemvPrologue(Prologue.GATED)
    else:
        summed = x + residual if step == "ADD_RMS_NORM" else x
        operand = rms_norm_reference(summed, norm_w, 1e-5)
        prologue = GemvPrologue(Prologue[step], residual if step == "ADD_RMS_NORM" else None, norm_w, 1e-5)
    if kind == "nvfp4":
        packed, scale, scale_2 = cuda(*nvfp4_weight(n, k))
        scale_2 = scale_2 * torch.linspace(0.5, 2, n, device="cuda")
        got, got_sum = nvfp4_prologue_gemv(x, packed, scale, scale_2, prologue=prologue)
        want = ref.nvfp4_linear_reference(operand, packed, scale, scale_2)
    else:
        scale, block = fp8_scale(kind, n, k, block=(128, 128))
        weight, scale = cuda(fp8_weight(n, k), scale)
        got, got_sum = fp8_prologue_gemv(x, weight, scale, block, prologue=prologue)
        want = ref.fp8_weight_only_reference(operand, weight, scale, block)
    assert rel_err(got, want) < BF16
    assert (got_sum is None) == (step != "ADD_RMS_NORM")
    if got_sum is not None:
        assert torch.equal(got_sum, x + residual)


@pytest.mark.parametrize("kwargs", [{"scale": 0.05}, {}, {"group_size": 128}],
                         ids=["static", "token", "group"])
def test_fp8_quantize_is_bit_exact(kwargs):
    x = (torch.randn(300, 4096, device="cuda") * torch.logspace(-3, 3, 4096, device="cuda")).bfloat16()
    kwargs = {k: torch.tensor(v, device="cuda") if k == "scale" else v for k, v in kwargs.items()}
    got, scale = fp8_quantize(x, **kwargs)
    want, want_scale = ref.fp8_quantize_reference(x, **kwargs)
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)) and torch.equal(scale, want_scale)


@pytest.mark.parametrize("backend", ["auto", "triton"])
@pytest.mark.parametrize("kind,static", [("tensor", True), ("channel", False), ("tensor", False)])
@pytest.mark.parametrize("m", [1, 64, 300])
def test_fp8_gemm_per_tensor_and_channel(backend, kind, static, m):
    n, k = 4096 + 48, 4096
    scale, _ = fp8_scale(kind, n, k)
    weight, scale, x, bias = cuda(fp8_weight(n, k), scale, torch.randn(m, k, dtype=torch.bfloat16),
                                  torch.randn(n, dtype=torch.bfloat16))
    input_scale = torch.tensor(0.02, device="cuda") if static else None
    got = fp8_gemm(x, weight, scale, input_scale, bias=bias, backend=backend)
    assert rel_err(got, ref.fp8_linear_reference(x, weight, scale, input_scale, bias=bias)) < BF16


@pytest.mark.parametrize("backend", ["triton", "scaled_mm"])
@pytest.mark.parametrize("m", [1, 64, 300])
def test_fp8_gemm_block_scaled(backend, m):
    n, k = 4096 + 64, 4096  # a partial last row block
    scale, block = fp8_scale("block", n, k, block=(128, 128))
    weight, scale, x = cuda(fp8_weight(n, k), scale, torch.randn(m, k, dtype=torch.bfloat16))
    try:
        got = fp8_gemm(x, weight, scale, block_size=block, backend=backend)
    except RuntimeError as exc:  # torch._scaled_mm without blockwise scaling here (cuBLAS < 12.9, not sm_90)
        pytest.skip(f"torch refuses blockwise _scaled_mm: {str(exc).splitlines()[0]}")
    assert rel_err(got, ref.fp8_linear_reference(x, weight, scale, block_size=block)) < BF16


@pytest.mark.parametrize("m", [1, 64, 300])
def test_nvfp4_gemm(m):
    packed, scale, scale_2, x, bias = cuda(*nvfp4_weight(4096 + 48, 4096),
                                           torch.randn(m, 4096, dtype=torch.bfloat16),
                                           torch.randn(4096 + 48, dtype=torch.bfloat16))
    got = nvfp4_gemm(x, packed, scale, scale_2, bias)
    assert rel_err(got, ref.nvfp4_linear_reference(x, packed, scale, scale_2, bias)) < BF16


@pytest.mark.parametrize("n,k", [(4096 + 48, 4096), (1000, 4000), (4096, 14336)])  # ragged; K split 8 ways
@pytest.mark.parametrize("kind,static", [("tensor", True), ("channel", False)])
@pytest.mark.parametrize("m", [1, 3, 16, 64])
def test_fp8_small_m_gemm(n, k, kind, static, m):
    scale, _ = fp8_scale(kind, n, k)
    weight, scale, x, bias = cuda(fp8_weight(n, k), scale, torch.randn(m, k, dtype=torch.bfloat16),
                                  torch.randn(n, dtype=torch.bfloat16))
    input_scale = torch.tensor(0.02, device="cuda") if static else None
    x_fp8, x_scale = fp8_quantize(x, input_scale)
    got = fp8_small_m_gemm(x_fp8, x_scale, weight, scale, bias, out_dtype=torch.bfloat16)
    assert rel_err(got, ref.fp8_linear_reference(x, weight, scale, input_scale, bias=bias)) < BF16


def test_fp8_small_m_gemm_replays_in_a_cuda_graph():
    """Split K merged in-kernel (arrival counters reset by the last split): replay after replay computes
    what the eager call does, with new activations."""
    weight, scale = cuda(fp8_weight(4096, 14336), torch.rand(4096) * 0.01)
    x = torch.randn(2, 14336, device="cuda", dtype=torch.bfloat16)

    def call():
        return fp8_small_m_gemm(*fp8_quantize(x), weight, scale, out_dtype=torch.bfloat16)

    call()  # compiled outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = call()
    for _ in range(3):
        x.copy_(torch.randn_like(x))
        graph.replay()
        assert torch.equal(captured, call())


def test_gemvs_replay_in_a_cuda_graph():
    """Launched with PDL on sm_90 (kernels/pdl.py): a captured replay computes what the eager call did."""
    weight, scale = cuda(fp8_weight(4096, 4096), torch.rand(4096) * 0.01)
    packed, nv_scale, scale_2 = cuda(*nvfp4_weight(4096, 4096))
    x = torch.randn(1, 4096, device="cuda", dtype=torch.bfloat16)
    calls = [lambda: fp8_gemv(x, weight, scale), lambda: nvfp4_gemv(x, packed, nv_scale, scale_2)]
    for call in calls:  # compiled outside the capture
        call()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = [call() for call in calls]
    x.copy_(torch.randn_like(x))
    graph.replay()
    eager = [call() for call in calls]
    for got, want in zip(captured, eager):
        assert torch.equal(got, want)
