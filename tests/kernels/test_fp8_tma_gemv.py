"""The one-row FP8 GEMV on TMA (``kernels/fp8_tma_gemv.py``) against its reference (Triton interpreter, fp32
and fp16: the interpreter reads a tensor descriptor's boxes as masked loads, zeros past N and K as TMA fills).

Its sm_90 code (TMA boxes, pipeline, registers, shared memory) is ``compile_sm90.py --only fp8_tma_gemv``; its
speed ``bench/probes/quant_kernels.py`` (``fp8_gemv tma channel``)."""

import os

import pytest
import torch

from autodeploy.kernels import fp8_tma_gemv as tma
from autodeploy.kernels import quant_reference as ref
from autodeploy.kernels.fp8_tma_gemv import TmaGemvLaunch, fp8_tma_gemv

DTYPES = [torch.float32, torch.float16]
# several programs, a ragged last one (N = 40), several K boxes and a ragged last one (K = 208), 2-3 stages
LAUNCHES = {"16x64 s3": TmaGemvLaunch(16, 64, 4, 3), "8x32 s2 w2": TmaGemvLaunch(8, 32, 2, 2),
            "64x256 s4": TmaGemvLaunch(64, 256, 4, 4)}  # one box overhanging N and K: TMA's zeros only


def rel_err(got, want):
    return ((got.double() - want.double()).norm() / want.double().norm()).item()


def bound(dtype):
    return 1e-5 if dtype == torch.float32 else 3e-3


def fp8_weight(n, k):
    return (torch.randn(n, k) * 40).clamp(-448, 448).to(torch.float8_e4m3fn)


def fp8_scale(kind, n):
    return {"tensor": torch.tensor(0.01), "channel": torch.rand(n) * 0.02 + 1e-3,
            "channel [N, 1]": torch.rand(n, 1) * 0.02 + 1e-3}[kind]


@pytest.mark.parametrize("launch", list(LAUNCHES.values()) + [None], ids=list(LAUNCHES) + ["default"])
@pytest.mark.parametrize("kind", ["tensor", "channel", "channel [N, 1]"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_fp8_tma_gemv_matches_the_reference(kind, dtype, launch):
    n, k = 40, 208  # neither a multiple of the tiles; K a multiple of 16 (TMA's row stride)
    weight, scale = fp8_weight(n, k), fp8_scale(kind, n)
    x = torch.randn(1, k).to(dtype)
    for bias in (None, torch.randn(n).to(dtype)):
        got = fp8_tma_gemv(x, weight, scale, bias, launch=launch)
        assert got.shape == (1, n) and got.dtype == dtype
        assert rel_err(got, ref.fp8_weight_only_reference(x, weight, scale, None, bias)) < bound(dtype)


def test_every_e4m3_code_dequantizes_exactly():
    """All 254 finite codes (and two zeros for the NaN codes) in a [16, 16] weight, one column at a time."""
    codes = torch.arange(256, dtype=torch.uint8)
    codes[codes.view(torch.float8_e4m3fn).float().isnan()] = 0
    weight = codes.view(torch.float8_e4m3fn).reshape(16, 16)
    scale = torch.rand(16) + 0.5
    want = ref.dequantize_fp8(weight, scale)
    for j in range(16):
        got = fp8_tma_gemv(torch.eye(16)[j], weight, scale, launch=TmaGemvLaunch(8, 16, 1, 2))
        torch.testing.assert_close(got, want[:, j], rtol=0, atol=0)


def test_leading_dimensions_a_padded_row_stride_and_no_features():
    weight = fp8_weight(24, 48)[:, :40]  # K = 40 on rows of 48 bytes: TMA needs the stride, not K, in 16s
    scale = torch.tensor(0.02)
    x = torch.randn(1, 1, 80)[..., :40]  # a strided row: made contiguous
    got = fp8_tma_gemv(x, weight, scale, launch=LAUNCHES["16x64 s3"])
    assert got.shape == (1, 1, 24)
    assert rel_err(got, ref.fp8_weight_only_reference(x, weight, scale)) < 1e-5
    assert fp8_tma_gemv(torch.randn(32), weight[:0, :32], scale).shape == (0,)  # no features, no program


def test_default_launches_are_the_h100_sweeps_best_tiles():
    assert TmaGemvLaunch.choose(28672, 4096) == TmaGemvLaunch(8, 256, 4, 4)  # gate_up
    assert TmaGemvLaunch.choose(6144, 4096) == TmaGemvLaunch(16, 256, 4, 4)  # qkv
    assert TmaGemvLaunch.choose(40, 208) == TmaGemvLaunch(16, 256, 4, 2)  # one K box: one in flight
    assert TmaGemvLaunch.choose(5, 4096).block_n == 8
    assert tma.prefetch_bytes(TmaGemvLaunch(16, 256, 4, 8)) == 1024  # 7 boxes of 256: rounded down to 4
    assert tma.prefetch_bytes(TmaGemvLaunch(8, 32, 4, 2)) == 128  # at least a line


def test_a_tile_from_the_environment_replaces_the_default(monkeypatch):
    monkeypatch.setattr(tma, "TMA_TILE", tma.tile_from_env("T", "block_n,block_k,num_warps,num_stages", "32,128,8,6"))
    assert TmaGemvLaunch.choose(4096, 4096) == TmaGemvLaunch(32, 128, 8, 6)
    for bad in ("16,256,4", "16,256,4,4,1", "a,b,c,d"):
        with pytest.raises(ValueError, match="expected block_n,block_k,num_warps,num_stages"):
            tma.tile_from_env("T", "block_n,block_k,num_warps,num_stages", bad)


def _misaligned_weight(n=8, k=32):
    flat = fp8_weight(1, n * k + 8).reshape(-1)
    weight = flat[8:].view(n, k) if flat.data_ptr() % 16 == 0 else flat[:-8].view(n, k)
    assert weight.data_ptr() % 16
    return weight


BAD = [
    (dict(x=torch.randn(2, 32)), "fp8_tma_gemv takes exactly one row, got 2"),
    (dict(x=torch.randn(1, 16)), "expects 32 input features"),
    (dict(x=torch.ones(1, 32, dtype=torch.int32)), "bfloat16, float16 or float32"),
    (dict(weight=torch.randn(8, 32)), "2-D float8_e4m3fn"),
    (dict(scale=torch.ones(8, dtype=torch.float16)), "weight_scale must be float32"),
    (dict(scale=torch.ones(2, 2)), r"block scales \(weight_scale of shape \(2, 2\)\) are not supported"),
    (dict(scale=torch.ones(3)), "neither per tensor, per channel"),
    (dict(weight=fp8_weight(8, 24), x=torch.randn(1, 24)), r"row stride \(in bytes\) is a multiple of 16"),
    (dict(weight=fp8_weight(32, 8).t()), r"row stride \(in bytes\) is a multiple of 16"),  # column-major
    (dict(weight=_misaligned_weight()), "address 16-byte aligned"),
    (dict(bias=torch.randn(7)), r"expected \(8,\)"),
    (dict(launch=TmaGemvLaunch(16, 512)), "at most 256 \\(a TMA box\\)"),
    (dict(launch=TmaGemvLaunch(16, 8)), "block_k at least 16 bytes"),
    (dict(launch=TmaGemvLaunch(12, 64)), "powers of two"),
    (dict(launch=TmaGemvLaunch(16, 64, 3)), "num_warps must be a power of two"),
]


@pytest.mark.parametrize("bad,message", BAD, ids=[m.split(" (")[0][:40] for _, m in BAD])
def test_fp8_tma_gemv_refuses_bad_inputs_naming_itself(bad, message):
    args = dict(x=torch.randn(1, 32), weight=fp8_weight(8, 32), scale=torch.tensor(1.0), bias=None, launch=None)
    args.update(bad)
    with pytest.raises(ValueError, match=message) as raised:
        fp8_tma_gemv(args["x"], args["weight"], args["scale"], args["bias"], launch=args["launch"])
    assert "fp8_tma_gemv" in str(raised.value)


@pytest.fixture
def tma_dispatch(monkeypatch):
    """``AUTODEPLOY_FP8_TMA_GEMV=1`` with the feature threshold lowered to the tests' sizes; records the calls."""
    from autodeploy.kernels import quant_gemv

    calls = []
    original = tma.fp8_tma_gemv
    monkeypatch.setattr(quant_gemv, "FP8_TMA_GEMV", True)
    monkeypatch.setattr(tma, "MIN_FEATURES", 32)
    monkeypatch.setattr(tma, "fp8_tma_gemv", lambda *a, **k: calls.append(a[1].shape) or original(*a, **k))
    return calls


@pytest.mark.parametrize("kind", ["tensor", "channel"])
def test_the_gemv_sends_one_row_of_a_wide_weight_here_where_asked(tma_dispatch, kind):
    from autodeploy.kernels.quant_gemv import fp8_gemv

    weight, scale, x, bias = fp8_weight(40, 208), fp8_scale(kind, 40), torch.randn(1, 208), torch.randn(40)
    got = fp8_gemv(x, weight, scale, bias=bias)
    assert tma_dispatch == [(40, 208)]
    assert rel_err(got, ref.fp8_weight_only_reference(x, weight, scale, bias=bias)) < 1e-5


def test_the_gemv_keeps_what_the_tma_kernel_does_not_take(tma_dispatch):
    from autodeploy.kernels.gemv import GemvPrologue, Prologue
    from autodeploy.kernels.quant_gemv import fp8_gemv, fp8_prologue_gemv

    weight, scale = fp8_weight(40, 208), fp8_scale("channel", 40)
    fp8_gemv(torch.randn(2, 208), weight, scale)  # two rows
    fp8_gemv(torch.randn(1, 208), fp8_weight(24, 208), fp8_scale("channel", 24))  # narrower than MIN_FEATURES
    fp8_gemv(torch.randn(1, 208), weight, torch.rand(5, 2) + 0.01, block_size=(8, 128))  # block scales
    fp8_gemv(torch.randn(1, 200), fp8_weight(40, 216)[:, :200], scale)  # a row stride TMA cannot take (200 B)
    norm = GemvPrologue(Prologue.RMS_NORM, norm_weight=torch.rand(208) + 0.5, eps=1e-6)
    fp8_prologue_gemv(torch.randn(1, 208), weight, scale, prologue=norm)  # a folded prologue
    assert tma_dispatch == []


def test_off_by_default():
    from autodeploy.kernels import quant_gemv

    assert quant_gemv.FP8_TMA_GEMV is (os.environ.get("AUTODEPLOY_FP8_TMA_GEMV") == "1")
