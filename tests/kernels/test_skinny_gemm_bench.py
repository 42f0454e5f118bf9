"""bench/skinny_gemm.py (an experiment the benchmark measures against cuBLAS) against F.linear
(Triton interpreter, fp32 and fp16): the numbers in docs/perf.md come from a correct kernel."""

import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import skinny_gemm as sg  # noqa: E402
from skinny_gemm import SkinnyLaunch, skinny_gemm  # noqa: E402

DTYPES = [torch.float32, torch.float16]
# several column tiles; K whole blocks or a masked tail; one split, several, more splits than blocks
LAUNCHES = [SkinnyLaunch(block_n=16, block_k=32, split_k=s, num_stages=2) for s in (1, 3, 8)]


def _rel_err(got, want):
    return ((got.double() - want.double()).norm() / want.double().norm()).item()


def _bound(dtype):
    return 1e-5 if dtype == torch.float32 else 3e-3


@pytest.mark.parametrize("launch", LAUNCHES, ids=lambda launch: f"split{launch.split_k}")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m,k,n", [(2, 128, 48), (5, 80, 40), (16, 96, 32), (33, 64, 24)])
def test_matches_linear(m, k, n, dtype, launch):
    x = torch.randn(m, k).to(dtype)
    w = (torch.randn(n, k) / k**0.5).to(dtype)
    bias = torch.randn(n).to(dtype)
    for b in (None, bias):
        got = skinny_gemm(x, w, b, launch=launch)
        want = F.linear(x.float(), w.float(), None if b is None else b.float())
        assert got.shape == (m, n) and got.dtype == dtype
        assert _rel_err(got, want) < _bound(dtype)


def test_split_counters_are_left_at_zero_and_reused():
    """The split that arrives last resets its tile's counter: a second call (same counters) is right."""
    x, w = torch.randn(4, 256), torch.randn(64, 256) / 16
    launch = SkinnyLaunch(block_n=16, block_k=32, split_k=4, num_stages=2)
    for _ in range(2):
        assert _rel_err(skinny_gemm(x, w, launch=launch), F.linear(x, w)) < 1e-5
    assert int(sg.pdl_counters(4, x.device)[:4].abs().sum()) == 0


def test_leading_dims_and_strided_rows():
    x = torch.randn(3, 2, 40)[:, :, :32]  # rows with a stride: made contiguous
    w = torch.randn(24, 32)
    got = skinny_gemm(x, w, launch=LAUNCHES[1])
    assert got.shape == (3, 2, 24) and _rel_err(got, F.linear(x, w)) < 1e-5


def test_too_many_rows_is_an_error():
    with pytest.raises(ValueError, match="at most"):
        skinny_gemm(torch.randn(sg.MAX_ROWS + 1, 16), torch.randn(8, 16))


def test_choose_splits_k_only_when_tiles_leave_sms_idle():
    assert SkinnyLaunch.choose(64, 28672, 4096, 132).split_k == 1  # gate/up: 224 tiles
    o_proj = SkinnyLaunch.choose(64, 4096, 4096, 132)  # 32 tiles
    assert o_proj.split_k == 4
    assert SkinnyLaunch.choose(64, 4096, 64, 132).split_k == 1  # one K block: nothing to split
