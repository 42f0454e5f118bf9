"""The FP8 activation quantizer and the FP8 / NVFP4 GEMMs against their references (Triton
interpreter, fp32 and fp16; torch._scaled_mm is a CUDA path: ``test_quant_gpu.py``).

The quantizer rounds to the e4m3 grid in fp32 before its cast, so its bytes equal torch's
``.to(float8_e4m3fn)`` here too, where the interpreter's own fp32 -> e4m3 cast would lose the carry
of a rounding that overflows the mantissa (e.g. 15.9 -> 8 instead of 16).
"""

import pytest
import torch

from autodeploy.kernels import quant_reference as ref
from autodeploy.kernels.quant_gemm import GemmLaunch, fp8_gemm, fp8_quantize, fp8_weight_only_gemm, nvfp4_gemm

from test_quant_gemv import DTYPES, check_with_and_without_bias, fp8_scale, fp8_weight, nvfp4_weight, rel_err

SMALL = GemmLaunch(block_m=16, block_n=16, block_k=32, num_stages=1, group_m=2)


def same_bytes(a, b):
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def test_quantizer_rounds_every_e4m3_value_and_midpoint_as_torch_does():
    codes = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    values = codes[~codes.isnan()].sort().values.unique()
    midpoints = (values[1:] + values[:-1]) / 2  # ties: to the even neighbour
    beyond = torch.tensor([449.0, 465.0, 1e6, -1e6, 2.0**-10, 2.0**-11, -(2.0**-10)])  # saturate, underflow
    x = torch.cat([values, midpoints, midpoints.nextafter(torch.tensor(1e9)), beyond]).reshape(1, -1)
    one = torch.tensor(1.0)
    got, scale = fp8_quantize(x, one)
    assert scale is one and same_bytes(got, ref.fp8_quantize_reference(x, one)[0])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mode", ["static", "token", "group"])
def test_quantizer_matches_the_reference_bit_for_bit(dtype, mode):
    x = (torch.randn(5, 2, 96) * torch.logspace(-4, 3, 96)).to(dtype)  # subnormal to saturating, per row
    x[1, 0] = 0.0  # an all-zero row and group: a finite scale, zeros
    kwargs = dict(static={"scale": torch.tensor(0.05)}, token={}, group={"group_size": 32})[mode]
    got, scale = fp8_quantize(x, **kwargs)
    want, want_scale = ref.fp8_quantize_reference(x, **kwargs)
    assert got.shape == x.shape and got.dtype == torch.float8_e4m3fn and same_bytes(got, want)
    assert torch.equal(scale, want_scale)
    if mode == "group":  # [..., K // g], column-major in memory as cuBLASLt's blockwise scaling reads it
        assert scale.shape == (5, 2, 3) and scale.reshape(10, 3).stride() == (1, 10)


@pytest.mark.parametrize("kwargs", [{}, {"group_size": 48}], ids=["token", "ragged-groups"])
def test_quantizer_takes_long_rows_and_a_short_last_group(kwargs):
    x = torch.randn(3, 5000) * 7  # per token: rows in several blocks; 5000 = 104 groups of 48 + 8
    got, scale = fp8_quantize(x, **kwargs)
    want, want_scale = ref.fp8_quantize_reference(x, **kwargs)
    assert same_bytes(got, want) and torch.equal(scale, want_scale)


@pytest.mark.parametrize("bad,message", [
    (dict(scale=torch.ones(2)), "one float32 value"),
    (dict(scale=torch.tensor(1.0, dtype=torch.float64)), "one float32 value"),
    (dict(group_size=0), "group_size must be 1 to 8192 columns"),
    (dict(group_size=32, scale=torch.tensor(1.0)), "and scale None"),
    (dict(x=torch.ones(2, 64, dtype=torch.int8)), "bfloat16, float16 or float32"),
])
def test_quantizer_refuses_bad_inputs(bad, message):
    args = dict(x=torch.randn(2, 64))
    args.update(bad)
    with pytest.raises(ValueError, match=message):
        fp8_quantize(**args)


@pytest.mark.parametrize("kind,static", [("tensor", True), ("tensor", False), ("channel", True),
                                         ("channel", False), ("block", False)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_fp8_gemm_matches_the_reference(kind, static, dtype):
    m, n, k = 20, 40, 80  # ragged in every dimension; blocks of 16 x 32: the last ones partial
    weight = fp8_weight(n, k)
    scale, block = fp8_scale(kind, n, k)
    x = torch.randn(m, k).to(dtype)
    input_scale = torch.tensor(0.02) if static else None
    check_with_and_without_bias(lambda b: fp8_gemm(x, weight, scale, input_scale, block, b, launch=SMALL),
                                lambda b: ref.fp8_linear_reference(x, weight, scale, input_scale, block, b),
                                x, n)


def test_fp8_gemm_takes_leading_dimensions_and_no_rows():
    weight, (scale, block) = fp8_weight(24, 64), fp8_scale("block", 24, 64)
    x = torch.randn(2, 3, 64)
    got = fp8_gemm(x, weight, scale, block_size=block, launch=SMALL)
    assert got.shape == (2, 3, 24)
    assert rel_err(got, ref.fp8_linear_reference(x, weight, scale, block_size=block)) < 1e-5
    assert fp8_gemm(torch.randn(0, 64), weight, scale, block_size=block).shape == (0, 24)


@pytest.mark.parametrize("bad,message", [
    (dict(input_scale=torch.tensor(1.0), block=(16, 32)), "input_scale must be None"),
    (dict(backend="cublas"), "backend must be one of"),
    (dict(block=(16, 24), scale=torch.ones(2, 3)), "not a multiple of 16"),
    (dict(launch=GemmLaunch(16, 16, 64)), "block_k 64 must divide the scale block's 32 columns"),
    (dict(bias=torch.randn(3)), r"expected \(24,\)"),
])
def test_fp8_gemm_refuses_bad_inputs(bad, message):
    args = dict(input_scale=None, block=(16, 32), scale=torch.ones(2, 2), backend="auto", launch=None,
                bias=None)
    args.update(bad)
    with pytest.raises(ValueError, match=message):
        fp8_gemm(torch.randn(4, 64), fp8_weight(24, 64), args["scale"], args["input_scale"], args["block"],
                 args["bias"], backend=args["backend"], launch=args["launch"])


@pytest.mark.parametrize("kind", ["tensor", "channel", "block"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_fp8_weight_only_gemm_matches_the_gemvs_reference(kind, dtype):
    m, n, k = 20, 40, 80
    weight = fp8_weight(n, k)
    scale, block = fp8_scale(kind, n, k)
    x = torch.randn(m, k).to(dtype)
    check_with_and_without_bias(lambda b: fp8_weight_only_gemm(x, weight, scale, block, b, launch=SMALL),
                                lambda b: ref.fp8_weight_only_reference(x, weight, scale, block, b), x, n)


def test_fp8_weight_only_gemm_refuses_what_the_gemv_refuses():
    with pytest.raises(ValueError, match="neither per tensor, per channel"):
        fp8_weight_only_gemm(torch.randn(2, 64), fp8_weight(24, 64), torch.ones(3))
    with pytest.raises(ValueError, match="block_k 64 must divide"):
        fp8_weight_only_gemm(torch.randn(2, 64), fp8_weight(24, 64), torch.ones(2, 2), (16, 32),
                             launch=GemmLaunch(16, 16, 64))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m", [3, 20])
def test_nvfp4_gemm_matches_the_reference(dtype, m):
    n, k = 40, 80  # K = 2.5 tiles of 32
    packed, scale, scale_2 = nvfp4_weight(n, k)
    x = torch.randn(m, k).to(dtype)
    check_with_and_without_bias(lambda b: nvfp4_gemm(x, packed, scale, scale_2, b, launch=SMALL),
                                lambda b: ref.nvfp4_linear_reference(x, packed, scale, scale_2, b), x, n)


def test_nvfp4_gemm_with_a_global_scale_per_row():
    packed, scale, scale_2 = nvfp4_weight(40, 112)
    per_row = scale_2 * torch.linspace(0.5, 2, 40)  # fused parts' own global scales
    x = torch.randn(5, 112)
    check_with_and_without_bias(lambda b: nvfp4_gemm(x, packed, scale, per_row, b, launch=SMALL),
                                lambda b: ref.nvfp4_linear_reference(x, packed, scale, per_row, b), x, 40)


def test_nvfp4_gemm_dequantizes_every_byte_exactly():
    packed, scale, _ = nvfp4_weight(32, 32)
    packed.view(-1)[:256] = torch.arange(256, dtype=torch.uint8)
    scale_2 = torch.tensor(0.75)  # the global scale multiplies last: exact products only with few bits
    got = nvfp4_gemm(torch.eye(32), packed, scale, scale_2, launch=SMALL)  # row k: column k of W
    torch.testing.assert_close(got, ref.dequantize_nvfp4(packed, scale, scale_2).t(), rtol=0, atol=0)


def test_nvfp4_gemm_refuses_bad_inputs():
    packed, scale, scale_2 = nvfp4_weight(8, 32)
    with pytest.raises(ValueError, match="block_k must be a multiple of 16"):
        nvfp4_gemm(torch.randn(2, 32), packed, scale, scale_2, launch=GemmLaunch(16, 16, 24))
    with pytest.raises(ValueError, match="expects 32 input features"):
        nvfp4_gemm(torch.randn(2, 16), packed, scale, scale_2)
    with pytest.raises(ValueError, match="one float32 value"):
        nvfp4_gemm(torch.randn(2, 32), packed, scale, torch.ones(1, dtype=torch.float16))


SPLIT = GemmLaunch(block_m=16, block_n=16, block_k=32, num_stages=1, group_m=2, split_k=3)


@pytest.mark.parametrize("kind", ["tensor", "channel", "block"])
def test_split_k_gemms_match_their_references(kind):
    """K = 80 in three splits of one 32-column tile each, the last one partial: every kind of scale, the
    bias added once (in the reduction), the quantized and the weight-only GEMM."""
    m, n, k = 20, 40, 80
    weight = fp8_weight(n, k)
    scale, block = fp8_scale(kind, n, k)
    x = torch.randn(m, k, dtype=torch.float16)
    check_with_and_without_bias(lambda b: fp8_gemm(x, weight, scale, None, block, b, launch=SPLIT),
                                lambda b: ref.fp8_linear_reference(x, weight, scale, None, block, b), x, n)
    check_with_and_without_bias(lambda b: fp8_weight_only_gemm(x, weight, scale, block, b, launch=SPLIT),
                                lambda b: ref.fp8_weight_only_reference(x, weight, scale, block, b), x, n)


def test_split_k_nvfp4_gemm_and_more_splits_than_k_tiles():
    n, k = 40, 64  # two K tiles of 32 over three splits: the last split has no work and writes zeros
    packed, scale, scale_2 = nvfp4_weight(n, k)
    x = torch.randn(5, k, dtype=torch.float16)
    check_with_and_without_bias(lambda b: nvfp4_gemm(x, packed, scale, scale_2, b, launch=SPLIT),
                                lambda b: ref.nvfp4_linear_reference(x, packed, scale, scale_2, b), x, n)


def test_launches_by_rows():
    assert GemmLaunch.choose(1).block_m == 16 and GemmLaunch.choose(64).block_m == 64
    assert GemmLaunch.choose(1, 4096).block_n == 32 and GemmLaunch.choose(1, 28672).block_n == 64
    assert (GemmLaunch.choose(4096).block_m, GemmLaunch.choose(4096).block_n) == (128, 128)
    assert (GemmLaunch.choose(4096, block_scaled=True).block_m, GemmLaunch.choose(4096).num_warps) == (64, 8)


def test_split_k_where_the_tiles_leave_the_gpu_idle():
    splits = {(m, n, k): GemmLaunch.choose(m, n, k=k).split_k
              for m, n, k in [(64, 4096, 14336), (64, 28672, 4096), (64, 6144, 4096), (16, 6144, 4096), (16, 4096, 512),
                              (128, 4096, 4096)]}
    assert splits == {(64, 4096, 14336): 4, (64, 28672, 4096): 1, (64, 6144, 4096): 4, (16, 6144, 4096): 2,
                      (16, 4096, 512): 1, (128, 4096, 4096): 1}
