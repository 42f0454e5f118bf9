"""The quantized linears through their real CUDA dispatch (``ops/quant_linear.py``: GEMV at <= 4 rows, GEMM
above) against their torch references at the 8B hidden size, each captured in a CUDA graph whose replay gives
the eager result (the engine captures every decode step), then every producer fixture through the canary on
CUDA. The kernels alone: ``tests/kernels/test_quant_gpu.py``."""

from pathlib import Path

import pytest
import torch
from cuda_only import ON_CUDA

from autodeploy.check import run_check
from autodeploy.ops import quant_linear as ql
from autodeploy.quantization import numerics as nm

pytestmark = ON_CUDA
FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "quant"
N = K = 4096
ROWS = (1, 4, 5, 64, 300)
FP8_CASES = {  # the weight's quantizer, the input scale, the block, the activations' quantization
    "fp8 tensor static": (nm.quantize_fp8_per_tensor, 0.05, None, "static"),
    "fp8 channel token": (nm.quantize_fp8_per_channel, None, None, "token"),
    "fp8 channel weight-only": (nm.quantize_fp8_per_channel, None, None, "none"),
    "fp8 block group": (lambda w: nm.quantize_fp8_blocks(w, (128, 128)), None, [128, 128], "group"),
}


def max_rel(got: torch.Tensor, want: torch.Tensor) -> float:
    """Largest difference over the output's largest magnitude (2% passes: bf16 inputs)."""
    assert torch.isfinite(got).all()
    return (got.float() - want.float()).abs().max().item() / max(want.float().abs().max().item(), 1e-6)


def replayed(call) -> torch.Tensor:
    """``call`` (already run eagerly) captured in a CUDA graph, replayed once: its output."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = call()
    graph.replay()
    torch.cuda.synchronize()
    return out


def check(call, want: torch.Tensor) -> None:
    got = call()
    assert max_rel(got, want) <= 0.02
    assert torch.equal(replayed(call), got)


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("name", FP8_CASES)
def test_fp8_linear(name, rows):
    quantize, input_scale, block, acts = FP8_CASES[name]
    weight, scale = quantize(torch.randn(N, K, device="cuda") * 0.02)
    input_scale = None if input_scale is None else torch.tensor(input_scale, device="cuda")
    x = torch.randn(rows, K, device="cuda", dtype=torch.bfloat16)
    unrounded = ql.quant_kernel(rows, True, "fp8", acts, bool(block)) in ("gemv", "weight_only")  # x stays bf16
    want = ql.fp8_linear_reference(x, weight, scale, input_scale, None, block, "none" if unrounded else acts)
    check(lambda: ql._fp8(x, weight, scale, input_scale, None, block, acts), want)


@pytest.mark.parametrize("rows", (1, 4, 16))
@pytest.mark.parametrize("name", ["fp8 tensor static", "fp8 channel token"])
def test_fp8_ops_on_the_small_m_kernel(monkeypatch, name, rows):
    """``AUTODEPLOY_FP8_SMALL_M_MAX_ROWS=16``: the plain op (quantizer + swap-AB GEMM) and the fused ones
    (norm_quantize + swap-AB GEMM) against their references, and replayed in a CUDA graph."""
    monkeypatch.setattr(ql, "FP8_SMALL_M_MAX_ROWS", 16)
    quantize, input_scale, _, acts = FP8_CASES[name]
    weight, scale = quantize(torch.randn(N, K, device="cuda") * 0.02)
    lin = (weight, scale, None if input_scale is None else torch.tensor(input_scale, device="cuda"), None, None, acts)
    x, residual = (torch.randn(rows, K, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    norm_weight = torch.rand(K, device="cuda", dtype=torch.bfloat16) + 0.5
    assert ql.quant_kernel(rows, True, "fp8", acts) == "small_m"
    check(lambda: ql._fp8(x, *lin), ql.fp8_linear_reference(x, *lin))
    normed = ql.rms_norm(x + residual, norm_weight, 1e-6)
    check(lambda: ql.fp8_add_rms_norm_linear(x, residual, norm_weight, 1e-6, *lin)[0],
          ql.fp8_linear_reference(normed, *lin))


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("per_row_scale_2", (False, True))
def test_nvfp4_linear(per_row_scale_2, rows):
    packed, scale, scale_2 = nm.quantize_nvfp4(torch.randn(N, K, device="cuda") * 0.02)
    scale_2 = scale_2.expand(N).clone() if per_row_scale_2 else scale_2
    x = torch.randn(rows, K, device="cuda", dtype=torch.bfloat16)
    want = ql.nvfp4_linear_reference(x, packed, scale, scale_2, None)
    check(lambda: ql._nvfp4(x, packed, scale, scale_2, None), want)


@pytest.mark.slow  # a model compile each
@pytest.mark.parametrize("fixture", sorted(p.name for p in FIXTURES.iterdir() if p.is_dir()))
def test_producer_fixture_canary(fixture):
    result = run_check(FIXTURES / fixture, device="cuda", dtype="bfloat16", steps=16, rel_tol=0.05)
    assert result.max_rel_err <= 0.05 and result.token_agreement >= 0.9, result.summary()
