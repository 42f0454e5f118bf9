"""The two-pass argmax of greedy sampling against torch.argmax (interpreter): ties, NaN, -inf, shapes."""

import pytest
import torch

from autodeploy.kernels.argmax import CHUNK, argmax_rows


def _check(x):
    got = argmax_rows(x)
    assert got.dtype == torch.int64
    torch.testing.assert_close(got, x.argmax(dim=-1), atol=0, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("cols", [7, CHUNK, CHUNK + 1, 2 * CHUNK + 300])
def test_random_rows(dtype, cols):
    _check(torch.randn(3, cols).to(dtype))


def test_ties_take_the_first_index_across_chunks():
    x = torch.zeros(4, 3 * CHUNK)
    x[0, [5, CHUNK + 1, 2 * CHUNK]] = 9.0  # first in chunk 0
    x[1, [CHUNK + 7, 2 * CHUNK + 3]] = 9.0  # first in a later chunk
    x[2, [2 * CHUNK - 1, 2 * CHUNK]] = 9.0  # both sides of a chunk boundary
    _check(x)  # row 3: all equal -> 0
    _check(torch.full((2, CHUNK + 5), float("-inf")))  # nothing but -inf -> 0
    _check(torch.tensor([[1.0, float("inf"), float("inf"), 0.0]]))


def test_nan_wins_like_in_torch():
    x = torch.randn(3, 2 * CHUNK + 9)
    x[0, CHUNK + 4] = float("nan")
    x[1, [3, 2 * CHUNK + 1]] = float("nan")  # the first NaN, in another chunk than the second
    x[2, 100] = float("inf")
    x[2, 2 * CHUNK + 8] = float("nan")  # NaN beats +inf
    _check(x)


def test_strided_rows_and_empty_batch():
    wide = torch.randn(3, 2 * CHUNK + 10)
    _check(wide[:, 5:CHUNK + 40])  # rows of a wider buffer (row stride > columns)
    _check(torch.randn(CHUNK + 3, 2).t())  # column stride > 1: made contiguous
    assert argmax_rows(torch.empty(0, 11)).shape == (0,)


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match="2-D float"):
        argmax_rows(torch.randn(5))
    with pytest.raises(ValueError, match="2-D float"):
        argmax_rows(torch.ones(2, 3, dtype=torch.int64))
    with pytest.raises(ValueError, match="empty row"):
        argmax_rows(torch.empty(2, 0))
