"""The FP8 / NVFP4 decode GEMVs against their references (Triton interpreter, fp32 and fp16).

The interpreter reads float8 tensors as bytes and widens e4m3 exactly (all 256 codes: the first
test), so FP8 weights are passed as they are; its fp32 -> e4m3 rounding is wrong (a carry out of
the mantissa is lost), which only the activation quantizer would meet: ``test_quant_gemm.py``.
"""

import pytest
import torch
from ptx_emulator import run_ptx

from autodeploy.kernels import quant_reference as ref
from autodeploy.kernels.gemv import GemvPrologue, Prologue
from autodeploy.kernels.pdl import Trigger
from autodeploy.kernels.quant_gemv import (QuantGemvLaunch, WeightFormat, fp8_gemv, fp8_prologue_gemv, nvfp4_gemv,
                                           nvfp4_prologue_gemv)
from autodeploy.ops.mlp import ACTIVATIONS
from autodeploy.ops.norm import rms_norm_reference

DTYPES = [torch.float32, torch.float16]
# several programs and byte tiles, a ragged last tile; the first tile before the (GPU-only) PDL wait or not
SMALL = QuantGemvLaunch(block_n=8, block_b=32)
UNLOADED = QuantGemvLaunch(block_n=8, block_b=32, trigger=Trigger.START, preload=False)
FOLDED = QuantGemvLaunch(block_n=2, block_b=64, fold=16)  # FP8 at one row: 16 products summed per lane first
LAUNCHES = pytest.mark.parametrize("launch", [SMALL, UNLOADED], ids=["preload", "no-preload"])


def rel_err(got, want):
    return ((got.double() - want.double()).norm() / want.double().norm()).item()


def bound(dtype):
    return 1e-5 if dtype == torch.float32 else 3e-3


def check_with_and_without_bias(run, reference, x, n):
    """``run(bias)`` against ``reference(bias)`` without a bias and with one: shape, dtype, error."""
    bias = torch.randn(n).to(x.dtype)
    for b in (None, bias):
        got = run(b)
        assert got.shape == (*x.shape[:-1], n) and got.dtype == x.dtype
        assert rel_err(got, reference(b)) < bound(x.dtype)


def fp8_weight(n, k):
    return (torch.randn(n, k) * 40).clamp(-448, 448).to(torch.float8_e4m3fn)


def fp8_scale(kind, n, k, block=(16, 32)):
    """(weight_scale, block_size) of one scale kind."""
    if kind == "tensor":
        return torch.tensor(0.01), None
    if kind == "channel":
        return torch.rand(n) * 0.02 + 1e-3, None
    return torch.rand(-(-n // block[0]), -(-k // block[1])) * 0.02 + 1e-3, block


def nvfp4_weight(n, k):
    packed = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8)
    scale = (torch.rand(n, k // 16) * 4 + 0.01).to(torch.float8_e4m3fn)
    return packed, scale, torch.tensor(0.03)


def test_every_e4m3_code_dequantizes_exactly():
    codes = torch.arange(256, dtype=torch.uint8)
    codes = codes[~codes.view(torch.float8_e4m3fn).float().isnan()]
    weight = codes.view(torch.float8_e4m3fn).reshape(-1, 2)  # [127, 2]: all 254 finite codes
    one_hot = torch.eye(2)
    for scale in (torch.tensor(1.0), torch.rand(weight.shape[0]) + 0.5):
        got = fp8_gemv(one_hot, weight, scale, launch=SMALL)
        torch.testing.assert_close(got, ref.dequantize_fp8(weight, scale).t(), rtol=0, atol=0)


@pytest.mark.parametrize("kind,launch",
                         [("tensor", SMALL), ("channel", SMALL), ("block", SMALL), ("block", UNLOADED)],
                         ids=["tensor", "channel", "block", "block-no-preload"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m", [1, 3])  # 3: rows padded to 4
def test_fp8_gemv_matches_the_reference(kind, dtype, m, launch):
    n, k = 40, 80  # neither a multiple of the tiles; blocks of 16 x 32: the last ones partial
    weight = fp8_weight(n, k)
    scale, block = fp8_scale(kind, n, k)
    x = torch.randn(m, k).to(dtype)
    check_with_and_without_bias(lambda b: fp8_gemv(x, weight, scale, block, b, launch=launch),
                                lambda b: ref.fp8_weight_only_reference(x, weight, scale, block, b), x, n)


@pytest.mark.parametrize("kind", ["tensor", "channel", "block"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_fp8_gemv_with_folded_lanes_matches_the_reference(kind, dtype):
    n, k = 40, 200  # rows of 200 bytes: three whole tiles of 64 and a ragged one, two features per program
    weight = fp8_weight(n, k)
    scale, block = fp8_scale(kind, n, k, block=(2, 32))
    x = torch.randn(1, k).to(dtype)
    check_with_and_without_bias(lambda b: fp8_gemv(x, weight, scale, block, b, launch=FOLDED),
                                lambda b: ref.fp8_weight_only_reference(x, weight, scale, block, b), x, n)


def test_a_tile_from_the_environment_replaces_fp8s_one_row_tile(monkeypatch):
    from autodeploy.kernels import quant_gemv

    monkeypatch.setattr(quant_gemv, "FP8_GEMV_TILE", quant_gemv.tile_from_env("AUTODEPLOY_FP8_GEMV_TILE", "block_n,block_b,num_warps,fold", "1,4096,4,16"))
    assert QuantGemvLaunch.choose(WeightFormat.FP8, 4096) == QuantGemvLaunch(1, 4096, 4, fold=16)
    assert QuantGemvLaunch.choose(WeightFormat.FP8, 40) == QuantGemvLaunch(1, 64, 4, fold=16)  # a short row
    assert QuantGemvLaunch.choose(WeightFormat.FP8, 4096, rows=4) == QuantGemvLaunch(16, 128)  # one row only
    assert QuantGemvLaunch.choose(WeightFormat.NVFP4, 2048) == QuantGemvLaunch(4, 1024, 2)
    for bad in ("4,1024", "4,1024,4,1,6", "a,b,c,d"):
        with pytest.raises(ValueError, match="expected block_n,block_b,num_warps,fold"):
            quant_gemv.tile_from_env("AUTODEPLOY_FP8_GEMV_TILE", "block_n,block_b,num_warps,fold", bad)


@LAUNCHES
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m", [1, 4])
def test_nvfp4_gemv_matches_the_reference(dtype, m, launch):
    n, k = 40, 112  # 56 bytes per row: one whole tile of 32 and a ragged one
    packed, scale, scale_2 = nvfp4_weight(n, k)
    x = torch.randn(m, k).to(dtype)
    check_with_and_without_bias(lambda b: nvfp4_gemv(x, packed, scale, scale_2, b, launch=launch),
                                lambda b: ref.nvfp4_linear_reference(x, packed, scale, scale_2, b), x, n)


def test_nvfp4_gemv_with_a_global_scale_per_row():
    """Fused parts (q/k/v, gate/up) keep their own global scales: one per row, applied with the sums."""
    packed, scale, scale_2 = nvfp4_weight(40, 112)
    per_row = scale_2 * torch.linspace(0.5, 2, 40)
    x = torch.randn(2, 112)
    check_with_and_without_bias(lambda b: nvfp4_gemv(x, packed, scale, per_row, b, launch=SMALL),
                                lambda b: ref.nvfp4_linear_reference(x, packed, scale, per_row, b), x, 40)
    want = ref.dequantize_nvfp4(packed, scale, scale_2) * torch.linspace(0.5, 2, 40)[:, None]
    torch.testing.assert_close(ref.dequantize_nvfp4(packed, scale, per_row), want)


def test_nvfp4_packing_is_low_nibble_first():
    """Byte 0x21 holds element 0 = code 1 (0.5) and element 1 = code 2 (1.0); byte 0xF8: -0 and -6."""
    packed = torch.zeros(1, 8, dtype=torch.uint8)
    packed[0, :2] = torch.tensor([0x21, 0xF8], dtype=torch.uint8)
    scale, scale_2 = torch.tensor([[1.0]]).to(torch.float8_e4m3fn), torch.tensor(1.0)
    want = torch.tensor([0.5, 1.0, -0.0, -6.0])
    torch.testing.assert_close(ref.dequantize_nvfp4(packed, scale, scale_2)[0, :4], want)
    got = nvfp4_gemv(torch.eye(16)[:4], packed, scale, scale_2, launch=SMALL)
    torch.testing.assert_close(got[:, 0], want, rtol=0, atol=0)


def test_every_nvfp4_byte_and_scale_dequantizes_exactly():
    """All 256 bytes (both nibbles) against 256 e4m3 block scales spanning subnormals to 448."""
    packed = torch.zeros(256, 8, dtype=torch.uint8)
    packed[:, 0] = torch.arange(256, dtype=torch.uint8)
    finite = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float().abs().nan_to_num(1.0)
    scale = finite.to(torch.float8_e4m3fn)[torch.randperm(256)].reshape(256, 1)
    scale_2 = torch.tensor(0.75)
    got = nvfp4_gemv(torch.eye(16)[:2], packed, scale, scale_2, launch=SMALL)
    want = ref.dequantize_nvfp4(packed, scale, scale_2)[:, :2].t()
    torch.testing.assert_close(got, want, rtol=0, atol=0)


# The norm / activation folded into the operand loads, against the composition the ops define: the step's
# torch reference (rounded to x's dtype), then the weight-only reference. Per weight kind: (rows, launch, K).
PROLOGUE_WEIGHTS = {
    "fp8-tensor": (1, FOLDED, 136), "fp8-channel": (3, SMALL, 80), "fp8-block": (1, FOLDED, 80),
    "nvfp4": (3, SMALL, 112), "nvfp4-word": (1, QuantGemvLaunch(8, 32, 1), 112),  # nvfp4_gemv.py's load_operand
}


def prologue_weights(kind, n, k):
    """(the prologue GEMV on x, its bias and prologue; the weight-only reference on the operand, bias)."""
    if kind.startswith("nvfp4"):
        packed, scale, scale_2 = nvfp4_weight(n, k)
        scale_2 = scale_2 * torch.linspace(0.5, 2, n) if kind == "nvfp4-word" else scale_2  # fused parts' scales
        return (lambda x, b, p, launch: nvfp4_prologue_gemv(x, packed, scale, scale_2, b, prologue=p, launch=launch),
                lambda a, b: ref.nvfp4_linear_reference(a, packed, scale, scale_2, b))
    weight = fp8_weight(n, k)
    scale, block = fp8_scale(kind.removeprefix("fp8-"), n, k, block=(2, 32))
    return (lambda x, b, p, launch: fp8_prologue_gemv(x, weight, scale, block, b, prologue=p, launch=launch),
            lambda a, b: ref.fp8_weight_only_reference(a, weight, scale, block, b))


@pytest.mark.parametrize("kind", sorted(PROLOGUE_WEIGHTS))
@pytest.mark.parametrize("dtype", DTYPES)  # fp16: the norm's 1/rms in a first pass (gemv.two_pass)
@pytest.mark.parametrize("step", [Prologue.RMS_NORM, Prologue.ADD_RMS_NORM, Prologue.GATED], ids=lambda p: p.name)
def test_prologue_gemv_is_the_step_then_the_weight_only_linear(kind, dtype, step):
    m, launch, k = PROLOGUE_WEIGHTS[kind]
    n = 36  # features: a ragged last program of 8 (SMALL), and 18 programs of 2 (FOLDED)
    run, reference = prologue_weights(kind, n, k)
    x = (torch.randn(1, m, 2 * k if step == Prologue.GATED else k) * 3).to(dtype)  # rows far from unit RMS
    residual, norm_w = torch.randn(1, m, k).to(dtype), (1 + 0.1 * torch.randn(k)).to(dtype)
    if step == Prologue.GATED:
        gate, up = x.float().chunk(2, dim=-1)
        operand, want_sum = (ACTIVATIONS["gelu_tanh"](gate) * up).to(dtype), None  # act_mul rounds once
        prologue = GemvPrologue(step, activation="gelu_tanh")
    else:
        want_sum = x + residual if step == Prologue.ADD_RMS_NORM else None
        operand = rms_norm_reference(x if want_sum is None else want_sum, norm_w, 1e-5)
        prologue = GemvPrologue(step, residual if want_sum is not None else None, norm_w, 1e-5)
    bias = torch.randn(n).to(dtype)  # (without one: the plain GEMV's tests; the epilogue is the same)
    out, summed = run(x, bias, prologue, launch)
    assert out.shape == (1, m, n) and out.dtype == dtype
    assert rel_err(out, reference(operand, bias)) < bound(dtype)
    if want_sum is None:
        assert summed is None
    else:  # x + residual rounded once, written whole
        torch.testing.assert_close(summed, want_sum, rtol=0, atol=0)


def test_the_sum_is_written_whole_by_fewer_programs_than_its_tiles():
    """One program (8 features) and K of four 32-element tiles: x + residual by a grid-stride loop; by torch
    where the weight has no features (no program)."""
    weight, scale = fp8_weight(8, 128), torch.tensor(0.02)
    x, residual, norm_w = torch.randn(2, 128), torch.randn(2, 128), torch.rand(128) + 0.5
    out, summed = fp8_prologue_gemv(x, weight, scale, prologue=GemvPrologue(Prologue.ADD_RMS_NORM, residual, norm_w,
                                                                             1e-6), launch=SMALL)
    torch.testing.assert_close(summed, x + residual, rtol=0, atol=0)
    want = ref.fp8_weight_only_reference(rms_norm_reference(x + residual, norm_w, 1e-6), weight, scale)
    assert rel_err(out, want) < 1e-5
    out, summed = fp8_prologue_gemv(x, weight[:0], scale, prologue=GemvPrologue(Prologue.ADD_RMS_NORM, residual,
                                                                                 norm_w, 1e-6))
    assert out.shape == (2, 0) and torch.equal(summed, x + residual)  # no features, no program: the sum still


BAD_PROLOGUES = [
    (GemvPrologue(Prologue.RMS_NORM), "RMS_NORM needs a norm weight of 32 elements, got None"),
    (GemvPrologue(Prologue.RMS_NORM, norm_weight=torch.ones(16)), r"of 32 elements, got \(16,\)"),
    (GemvPrologue(Prologue.ADD_RMS_NORM, norm_weight=torch.ones(32)), "needs a residual shaped and typed as x"),
    (GemvPrologue(Prologue.ADD_RMS_NORM, torch.ones(1, 32, dtype=torch.float16), torch.ones(32)), "typed as x"),
    (GemvPrologue(Prologue.GATED), "expects 64 input features"),  # gate and up: 2K columns
]


@pytest.mark.parametrize("prologue,message", BAD_PROLOGUES)
def test_prologue_gemv_refuses_inputs_that_do_not_fit(prologue, message):
    packed, scale, scale_2 = nvfp4_weight(8, 32)
    for run in (lambda: fp8_prologue_gemv(torch.randn(1, 32), fp8_weight(8, 32), torch.tensor(1.0), prologue=prologue),
                lambda: nvfp4_prologue_gemv(torch.randn(1, 32), packed, scale, scale_2, prologue=prologue)):
        with pytest.raises(ValueError, match=message):
            run()
    with pytest.raises(ValueError, match="unknown activation 'relu'"):
        GemvPrologue(Prologue.GATED, activation="relu")


def test_leading_dimensions_strided_rows_and_no_rows():
    weight = fp8_weight(24, 64)
    scale = torch.tensor(0.02)
    x = torch.randn(2, 1, 80)[..., :64]  # a row stride of 80: made contiguous
    got = fp8_gemv(x, weight, scale, launch=SMALL)
    assert got.shape == (2, 1, 24)
    assert rel_err(got, ref.fp8_weight_only_reference(x, weight, scale)) < 1e-5
    assert fp8_gemv(torch.randn(0, 64), weight, scale).shape == (0, 24)


def test_default_launches_fit_the_shapes():
    assert QuantGemvLaunch.choose(WeightFormat.FP8, 4096) == QuantGemvLaunch(4, 1024, fold=4)
    assert QuantGemvLaunch.choose(WeightFormat.NVFP4, 2048) == QuantGemvLaunch(4, 1024, 2)
    assert QuantGemvLaunch.choose(WeightFormat.FP8, 4096, rows=4) == QuantGemvLaunch(16, 128)
    assert QuantGemvLaunch.choose(WeightFormat.FP8, 40) == QuantGemvLaunch(4, 64, fold=4)  # a short row: one tile
    assert QuantGemvLaunch.choose(WeightFormat.FP8, 4096, rows=4, block_rows=12).block_n == 4  # divides 12


def test_a_block_n_that_does_not_divide_the_scale_block_is_refused():
    weight = fp8_weight(40, 64)
    scale, block = fp8_scale("block", 40, 64, block=(12, 32))
    with pytest.raises(ValueError, match="block_n 8 must divide the scale block's 12 rows"):
        fp8_gemv(torch.randn(1, 64), weight, scale, block, launch=SMALL)
    got = fp8_gemv(torch.randn(1, 64), weight, scale, block)  # the default launch fits
    assert got.shape == (1, 40)


BAD_FP8 = [
    (dict(weight=torch.randn(8, 32)), "2-D float8_e4m3fn"),
    (dict(scale=torch.ones(8, dtype=torch.float16)), "weight_scale must be float32"),
    (dict(scale=torch.ones(3)), "neither per tensor, per channel"),
    (dict(scale=torch.ones(2, 2), block=(4, 32)), r"needs a weight_scale of shape \(2, 1\)"),
    (dict(scale=torch.ones(1, 1), block=(0, 32)), "two positive integers"),
    (dict(x=torch.randn(1, 16)), "expects 32 input features"),
    (dict(x=torch.ones(1, 32, dtype=torch.int32)), "bfloat16, float16 or float32"),
    (dict(x=torch.randn(5, 32)), "at most 4 rows"),
    (dict(bias=torch.randn(7)), r"expected \(8,\)"),
    (dict(launch=QuantGemvLaunch(4, 32, fold=3)), "fold 3 must be a power of two dividing block_b 32"),
    (dict(x=torch.randn(2, 32), launch=QuantGemvLaunch(4, 32, fold=4)), "fold 4 is for one row, got 2"),
]


@pytest.mark.parametrize("bad,message", BAD_FP8)
def test_fp8_gemv_refuses_bad_inputs(bad, message):
    args = dict(x=torch.randn(1, 32), weight=fp8_weight(8, 32), scale=torch.tensor(1.0), block=None,
                bias=None, launch=None)
    args.update(bad)
    with pytest.raises(ValueError, match=message):
        fp8_gemv(args["x"], args["weight"], args["scale"], args["block"], args["bias"], launch=args["launch"])


BAD_NVFP4 = [
    (dict(packed=torch.zeros(8, 16, dtype=torch.int8)), "2-D uint8"),
    (dict(packed=torch.zeros(8, 12, dtype=torch.uint8)), "K = 24 is not a multiple"),
    (dict(scale=torch.ones(8, 2)), "float8_e4m3fn of shape"),
    (dict(scale=torch.ones(8, 1).to(torch.float8_e4m3fn)), r"of shape \(8, 2\)"),
    (dict(scale_2=torch.ones(2)), r"one float32 value or one per row \(8,\)"),
    (dict(x=torch.randn(1, 16)), "expects 32 input features"),
    (dict(launch=QuantGemvLaunch(4, 8)), "block_b must be at least 16 bytes"),
    (dict(launch=QuantGemvLaunch(4, 32, fold=4)), "fold is FP8's"),
]


@pytest.mark.parametrize("bad,message", BAD_NVFP4)
def test_nvfp4_gemv_refuses_bad_inputs(bad, message):
    packed, scale, scale_2 = nvfp4_weight(8, 32)
    args = dict(x=torch.randn(1, 32), packed=packed, scale=scale, scale_2=scale_2, launch=None)
    args.update(bad)
    with pytest.raises(ValueError, match=message):
        nvfp4_gemv(args["x"], args["packed"], args["scale"], args["scale_2"], launch=args["launch"])


def test_the_gpu_e2m1_decode_emulated_matches_the_e2m1_table():
    """E2M1_ASM (the PTX the GPU runs instead of e2m1_to_fp16) on every byte in every position of its
    32-bit word: low nibbles of bytes 0-3 in $0-$1, high nibbles in $2-$3, fp16 times 2**-14."""
    from autodeploy.kernels.e2m1 import E2M1_ASM

    def fp16(bits):
        return torch.tensor([bits], dtype=torch.int32).to(torch.int16).view(torch.float16).double()

    for byte in range(256):
        word_bytes = [byte, (byte * 7 + 3) & 255, (byte * 13 + 5) & 255, 255 - byte]
        regs = run_ptx(E2M1_ASM.value, {"$4": sum(b << 8 * i for i, b in enumerate(word_bytes))})
        out = [regs[f"${i}"] for i in range(4)]
        halves = [fp16((out[r] >> 16 * h) & 0xFFFF) for r in range(4) for h in range(2)]
        for i, b in enumerate(word_bytes):
            for got, code in ((halves[i], b & 15), (halves[4 + i], b >> 4)):
                want = torch.tensor([ref.E2M1_VALUES[code] * 2.0**-14], dtype=torch.float64)
                assert torch.equal(got, want) and got.signbit() == want.signbit(), (byte, i, code)
