"""The one-row NVFP4 GEMV (``kernels/nvfp4_gemv.py``, behind ``nvfp4_gemv`` at one row) against the torch
reference (Triton interpreter, fp32 and fp16): every byte and scale exactly, ragged rows and features, the
launch switches, and the byte kernel it falls back to where the weight's rows do not start on a word."""

import itertools
import math

import pytest
import torch
from ptx_emulator import run_ptx

from autodeploy.kernels import quant_reference as ref
from autodeploy.kernels.gemv import GemvPrologue, Prologue
from autodeploy.kernels.nvfp4_gemv import words_of
from autodeploy.kernels.pdl import Trigger
from autodeploy.kernels.quant_gemv import QuantGemvLaunch, nvfp4_gemv, nvfp4_prologue_gemv
from autodeploy.ops.norm import rms_norm_reference

# two groups of 16 bytes a tile: several tiles a row, the last one ragged
TWO_GROUPS = QuantGemvLaunch(block_n=4, block_b=32)
LAUNCHES = {"preload": TWO_GROUPS, "no-preload": QuantGemvLaunch(4, 32, trigger=Trigger.START, preload=False),
            "wide": QuantGemvLaunch(2, 256, num_warps=2), "default": None}


pytestmark = pytest.mark.usefixtures("word_kernel_on")  # (conftest.py) whatever the environment says


def nvfp4_weight(n, k, seed=0):
    gen = torch.Generator().manual_seed(seed)
    packed = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=gen)
    scale = (torch.rand(n, k // 16, generator=gen) * 4 + 0.01).to(torch.float8_e4m3fn)
    return packed, scale, torch.tensor(0.03)


def rel_err(got, want):
    return ((got.double() - want.double()).norm() / want.double().norm()).item()


# 14 words a row: 3.5 groups (every launch, fp32); one block; 50 words: several wide tiles, the last ragged
CASES = ([(13, 112, name, torch.float32) for name in LAUNCHES] + [(13, 112, "preload", torch.float16)]
         + [(6, 16, "default", torch.float16), (9, 400, "wide", torch.float16), (9, 400, "default", torch.float32)])


@pytest.mark.parametrize("n,k,launch,dtype", CASES)
def test_one_row_matches_the_reference(n, k, launch, dtype):
    launch = LAUNCHES[launch]
    packed, scale, scale_2 = nvfp4_weight(n, k)
    x = torch.randn(1, k).to(dtype)
    bias = torch.randn(n).to(dtype)
    for b in (None, bias):
        got = nvfp4_gemv(x, packed, scale, scale_2, b, launch=launch)
        assert got.shape == (1, n) and got.dtype == dtype
        assert rel_err(got, ref.nvfp4_linear_reference(x, packed, scale, scale_2, b)) < (
            1e-5 if dtype == torch.float32 else 3e-3)


def test_the_sum_is_written_whole_by_fewer_programs_than_its_tiles():
    """add + RMSNorm in the word kernel: one program (8 features) and K of four 32-element tiles, x + residual by
    a grid-stride loop; by torch where the weight has no features (no program)."""
    packed, scale, scale_2 = nvfp4_weight(8, 128)
    x, residual, norm_w = torch.randn(1, 128), torch.randn(1, 128), torch.rand(128) + 0.5
    prologue = GemvPrologue(Prologue.ADD_RMS_NORM, residual, norm_w, 1e-6)
    out, summed = nvfp4_prologue_gemv(x, packed, scale, scale_2, prologue=prologue, launch=QuantGemvLaunch(8, 16, 1))
    torch.testing.assert_close(summed, x + residual, rtol=0, atol=0)
    want = ref.nvfp4_linear_reference(rms_norm_reference(x + residual, norm_w, 1e-6), packed, scale, scale_2)
    assert rel_err(out, want) < 1e-5
    out, summed = nvfp4_prologue_gemv(x, packed[:0], scale[:0], scale_2, prologue=prologue)
    assert out.shape == (1, 0) and torch.equal(summed, x + residual)  # no features, no program: the sum still


@pytest.mark.parametrize("m", [1, 3])  # the word kernel; the byte kernel
def test_a_global_scale_per_row_scales_each_feature(m):
    packed, scale, scale_2 = nvfp4_weight(13, 112)
    per_row = scale_2 * torch.linspace(0.5, 2, 13)  # fused parts with their own global scales
    x, bias = torch.randn(m, 112), torch.randn(13)
    got = nvfp4_gemv(x, packed, scale, per_row, bias, launch=TWO_GROUPS)
    assert rel_err(got, ref.nvfp4_linear_reference(x, packed, scale, per_row, bias)) < 1e-5
    with pytest.raises(ValueError, match=r"one float32 value or one per row \(13,\)"):
        nvfp4_gemv(x, packed, scale, per_row[:12])


def test_every_byte_and_scale_dequantizes_exactly_at_one_row():
    """All 256 bytes (both nibbles, each of the 8 positions of a word) against 256 e4m3 scales, one-hot rows."""
    packed = torch.zeros(256, 8, dtype=torch.uint8)
    for position in range(8):
        packed[:, position] = torch.arange(256, dtype=torch.uint8).roll(37 * position)
    finite = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float().abs().nan_to_num(1.0)
    scale = finite.to(torch.float8_e4m3fn)[torch.randperm(256, generator=torch.Generator().manual_seed(1))]
    scale, scale_2 = scale.reshape(256, 1), torch.tensor(0.75)
    want = ref.dequantize_nvfp4(packed, scale, scale_2)
    wide = QuantGemvLaunch(block_n=64, block_b=16)  # few programs: the interpreter's time
    for element in range(16):
        got = nvfp4_gemv(torch.eye(16)[element:element + 1], packed, scale, scale_2, launch=wide)
        torch.testing.assert_close(got[0], want[:, element], rtol=0, atol=0)


def test_rows_that_do_not_start_on_a_word_take_the_byte_kernel():
    wide = torch.randint(0, 256, (5, 13), dtype=torch.uint8)
    packed = wide[:, :8]  # a row stride of 13 bytes: no int32 view
    _, scale, scale_2 = nvfp4_weight(5, 16)
    assert words_of(packed) is None and words_of(packed.contiguous()) is not None
    x = torch.randn(1, 16)
    got = nvfp4_gemv(x, packed, scale, scale_2, launch=TWO_GROUPS)
    assert rel_err(got, ref.nvfp4_linear_reference(x, packed, scale, scale_2)) < 1e-5


def test_the_gpu_word_decode_emulated_matches_the_e2m1_table():
    """E2M1_WORD_ASM (the PTX the GPU runs instead of e2m1_to_fp16) on every code in every nibble of its
    word: $0-$7 the eight values in element order (nibble i = element i), fp32 times 2**-14."""
    from autodeploy.kernels.nvfp4_gemv import E2M1_WORD_ASM

    for code, other, position in itertools.product(range(16), range(16), range(8)):
        nibbles = [other] * 8
        nibbles[position] = code  # each code in every position, beside every other code
        regs = run_ptx(E2M1_WORD_ASM.value, {"$8": sum(c << 4 * i for i, c in enumerate(nibbles))})
        for i, c in enumerate(nibbles):
            got, want = regs[f"${i}"], ref.E2M1_VALUES[c] * 2.0**-14
            assert got == want and math.copysign(1, got) == math.copysign(1, want), (nibbles, i)


def test_the_switch_keeps_the_byte_kernel(monkeypatch):
    from autodeploy.kernels import nvfp4_gemv as words_module
    from autodeploy.kernels import quant_gemv

    packed, scale, scale_2 = nvfp4_weight(6, 32)
    x = torch.randn(1, 32)
    launched = []
    monkeypatch.setattr(words_module, "launch_one_row", lambda *a, **k: launched.append(1) or (torch.zeros(1, 6), None))
    nvfp4_gemv(x, packed, scale, scale_2)
    assert launched == [1]
    monkeypatch.setattr(quant_gemv, "NVFP4_WORD_GEMV", False)
    got = nvfp4_gemv(x, packed, scale, scale_2)
    assert launched == [1] and rel_err(got, ref.nvfp4_linear_reference(x, packed, scale, scale_2)) < 1e-5
