"""The swap-AB FP8 x FP8 GEMM of decode batches (``kernels/fp8_small_m.py``) against the op's torch
reference, activations quantized per token or with a static scale (Triton interpreter, fp32 and fp16;
on the GPU: ``test_quant_gpu.py`` and ``tests/gpu/test_quant_dispatch_gpu.py``, CUDA graphs included)."""

import pytest
import torch

from autodeploy.kernels import quant_reference as ref
from autodeploy.kernels.fp8_quantize import fp8_quantize
from autodeploy.kernels.fp8_small_m import SmallMLaunch, fp8_small_m_gemm
from autodeploy.kernels.paged_attention import split_counters

from test_quant_gemv import check_with_and_without_bias, fp8_scale, fp8_weight

N, K = 40, 80  # ragged: 16-feature tiles and 32-byte K tiles, the last ones partial
# one K split; three (one tile each, the last partial); four (more splits than K tiles: one empty)
LAUNCHES = {f"split{s}": SmallMLaunch(block_n=16, block_k=32, block_m=16, split_k=s, num_stages=1)
            for s in (1, 3, 4)}


def small_m(x, weight, scale, input_scale, bias, launch):
    """The kernel on x quantized as the op quantizes it (per token, or with the static scale)."""
    x_fp8, x_scale = fp8_quantize(x, input_scale)
    return fp8_small_m_gemm(x_fp8, x_scale, weight, scale, bias, out_dtype=x.dtype, launch=launch)


F32, F16 = torch.float32, torch.float16
CASES = [  # rows, launch, dtype, weight scale, static input scale: each launch, dtype and kind of scale
    (1, "split4", F32, "tensor", True), (1, "split1", F16, "channel", False), (3, "split3", F16, "tensor", False),
    (3, "split1", F32, "channel", True), (16, "split3", F32, "channel", False), (16, "split4", F16, "tensor", True),
]


@pytest.mark.parametrize("m,launch,dtype,kind,static", CASES)
def test_matches_the_ops_reference(m, launch, dtype, kind, static):
    weight, (scale, _) = fp8_weight(N, K), fp8_scale(kind, N, K)
    x = torch.randn(m, K).to(dtype)
    input_scale = torch.tensor(0.02) if static else None
    check_with_and_without_bias(lambda b: small_m(x, weight, scale, input_scale, b, LAUNCHES[launch]),
                                lambda b: ref.fp8_linear_reference(x, weight, scale, input_scale, None, b), x, N)


def test_row_tiles_and_k_in_whole_tiles():
    """20 rows in two row tiles of 16 (the second with 4 rows), K = 96 in three whole 32-byte tiles (the
    loop without masks), split three ways."""
    weight, (scale, _) = fp8_weight(N, 96), fp8_scale("channel", N, 96)
    x = torch.randn(20, 96, dtype=torch.float16)
    launch = SmallMLaunch(block_n=16, block_k=32, block_m=16, split_k=3, num_stages=1)
    check_with_and_without_bias(lambda b: small_m(x, weight, scale, None, b, launch),
                                lambda b: ref.fp8_linear_reference(x, weight, scale, None, None, b), x, N)


def test_split_counters_are_zero_again_after_each_launch():
    """A CUDA graph replays the launch as captured: the last split of each tile resets its counter, so
    the same call gives the same result again and leaves every counter at zero."""
    weight, (scale, _), x = fp8_weight(N, K), fp8_scale("channel", N, K), torch.randn(3, K)
    first = small_m(x, weight, scale, None, None, LAUNCHES["split3"])
    again = small_m(x, weight, scale, None, None, LAUNCHES["split3"])
    assert torch.equal(first, again)
    assert not split_counters(1, x.device, owner="fp8_small_m").any()


def test_default_launch_splits_k_where_the_feature_tiles_leave_sms_idle():
    assert SmallMLaunch.choose(1, 4096, 4096) == SmallMLaunch(64, 128, 16, 8, prefetch=4)  # o: 64 x 32 K tiles
    assert SmallMLaunch.choose(16, 4096, 14336).split_k == 8  # down
    assert SmallMLaunch.choose(4, 6144, 4096).split_k == 4  # qkv: 96 tiles
    assert SmallMLaunch.choose(8, 28672, 4096).split_k == 1  # gate_up: 448 tiles fill the GPU alone
    assert SmallMLaunch.choose(3, 4096, 256).split_k == 1  # two K tiles: nothing to split
    assert SmallMLaunch.choose(17, 64, 64).block_m == 32 and SmallMLaunch.choose(300, 64, 64).block_m == 64
    weight, (scale, _), x = fp8_weight(64, 512), fp8_scale("tensor", 64, 512), torch.randn(2, 512)
    got = small_m(x, weight, scale, None, None, None)  # the default tiles, in the interpreter
    assert ref.fp8_linear_reference(x, weight, scale).sub(got).norm() < 1e-5 * got.norm()


@pytest.mark.parametrize("bad,message", [
    (dict(scale=torch.ones(3, 3)), "neither per tensor, per channel"),
    (dict(x_fp8=torch.zeros(2, 64)), "x_fp8 must be float8_e4m3fn"),
    (dict(x_fp8=torch.zeros(2, 32, dtype=torch.float8_e4m3fn)), r"x_fp8 must be float8_e4m3fn \[M, 64\]"),
    (dict(x_scale=torch.ones(3, 1)), "one value or one per row"),
    (dict(x_scale=torch.ones(2, 1, dtype=torch.float16)), "x_scale must be fp32"),
    (dict(bias=torch.randn(3)), r"expected \(24,\)"),
    (dict(launch=SmallMLaunch(block_m=8)), "block_m must be 16, 32 or 64"),
    (dict(launch=SmallMLaunch(block_k=64, prefetch=4)), "prefetch must be 0, 1, 2, 4 or 8 K tiles"),
])
def test_refuses_bad_inputs(bad, message):
    args = dict(x_fp8=torch.zeros(2, 64, dtype=torch.float8_e4m3fn), x_scale=torch.ones(2, 1),
                scale=torch.tensor(1.0), bias=None, launch=None)
    args.update(bad)
    with pytest.raises(ValueError, match=message):
        fp8_small_m_gemm(args["x_fp8"], args["x_scale"], fp8_weight(24, 64), args["scale"], args["bias"],
                         out_dtype=torch.float32, launch=args["launch"])
