"""The per-shape cuBLAS / cuBLASLt choice: timing both once, the margin, buckets, captures, overrides."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from autodeploy.ops import blas_choice
from autodeploy.ops.blas_choice import CUBLAS, CUBLASLT, BlasChooser, GemmKey, rows_bucket


class FakeTimer:
    """ms per call by backend; counts the timings."""

    def __init__(self, cublas: float, lt: float):
        self.ms = {CUBLAS: cublas, CUBLASLT: lt}
        self.calls: list[str] = []

    def __call__(self, backend, run):
        self.calls.append(backend)
        run(0)
        return self.ms[backend]


def key(rows: int, n: int = 4096, k: int = 14336) -> GemmKey:
    return GemmKey(0, torch.bfloat16, rows_bucket(rows), n, k, False)


def test_rows_round_up_to_a_power_of_two():
    assert [rows_bucket(r) for r in (1, 2, 3, 4, 5, 33, 64, 65, 512)] == [1, 2, 4, 4, 8, 64, 64, 128, 512]


def test_the_faster_library_is_chosen_and_remembered():
    timer = FakeTimer(cublas=0.0365, lt=0.0321)  # the H200's 8B down projection at 64 rows
    chooser, runs = BlasChooser(timer, mode="auto"), []
    assert chooser.lookup(key(64), lambda: runs.append) == CUBLASLT
    assert timer.calls == [CUBLAS, CUBLASLT] * blas_choice.ROUNDS and runs == [0] * 2 * blas_choice.ROUNDS
    # 33 rows share the bucket of 64: no second timing
    assert chooser.lookup(key(33), lambda: runs.append) == CUBLASLT
    assert timer.calls == [CUBLAS, CUBLASLT] * blas_choice.ROUNDS


def test_each_library_keeps_its_fastest_round():
    """A clock ramping up after idle slows the first timing: alternating rounds take that out."""
    rounds = {CUBLAS: [1.30, 1.00], CUBLASLT: [1.02, 1.01]}  # cuBLAS's first round ran on a slow clock

    def timer(backend, run):
        return rounds[backend].pop(0)

    assert BlasChooser(timer, margin=0.03, mode="auto").lookup(key(64), lambda: int) == CUBLAS
    assert rounds == {CUBLAS: [], CUBLASLT: []}


def test_cublaslt_must_win_by_the_margin():
    def choice(cublas: float, lt: float) -> str:
        return BlasChooser(FakeTimer(cublas, lt), margin=0.03, mode="auto").lookup(key(64), lambda: int)

    assert choice(cublas=1.0, lt=0.98) == CUBLAS
    assert choice(cublas=1.0, lt=0.96) == CUBLASLT
    assert choice(cublas=0.9, lt=1.0) == CUBLAS


def test_a_shape_cublaslt_cannot_run_stays_on_cublas():
    def timer(backend, run):
        if backend == CUBLASLT:
            raise RuntimeError("CUBLAS_STATUS_NOT_SUPPORTED")
        return 1.0

    chooser = BlasChooser(timer, mode="auto")
    assert chooser.lookup(key(64), lambda: int) == CUBLAS and chooser.choices == {key(64): CUBLAS}


def test_nothing_is_timed_or_remembered_during_a_capture():
    timer = FakeTimer(cublas=2.0, lt=1.0)
    chooser = BlasChooser(timer, mode="auto")
    assert chooser.lookup(key(64), lambda: int, capturing=True) is None
    assert timer.calls == [] and chooser.choices == {}
    assert chooser.lookup(key(64), lambda: int) == CUBLASLT  # timed once the capture is over
    assert chooser.lookup(key(64), lambda: int, capturing=True) == CUBLASLT  # and then used inside captures


def test_cpu_and_prefill_sized_calls_are_left_to_torch():
    timer = FakeTimer(cublas=2.0, lt=1.0)
    chooser = BlasChooser(timer, mode="auto")
    w = torch.randn(8, 16)
    assert chooser.backend(torch.randn(4, 16), w, None) is None  # CPU
    assert chooser.backend(torch.randn(0, 16), w, None) is None
    assert timer.calls == []


def test_a_forced_library_skips_timing():
    timer = FakeTimer(cublas=1.0, lt=2.0)
    chooser = BlasChooser(timer, mode=CUBLASLT)
    assert chooser.mode == CUBLASLT and timer.calls == []


def test_a_bad_override_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("AUTODEPLOY_BLAS", "mkl")
    with pytest.raises(ValueError, match="AUTODEPLOY_BLAS must be auto, cublas or cublaslt, got 'mkl'"):
        BlasChooser()


def test_linear_is_f_linear_on_the_cpu():
    x, w, b = torch.randn(3, 5, 16), torch.randn(8, 16), torch.randn(8)
    torch.testing.assert_close(blas_choice.linear(x, w, b), F.linear(x, w, b), rtol=0, atol=0)
    torch.testing.assert_close(blas_choice.linear(x, w), F.linear(x, w), rtol=0, atol=0)


def test_preferred_blas_restores_the_previous_library():
    before = torch.backends.cuda.preferred_blas_library()
    with blas_choice.preferred_blas(None):
        assert torch.backends.cuda.preferred_blas_library() == before
    assert torch.backends.cuda.preferred_blas_library() == before


def test_preferred_blas_sets_and_restores_even_on_error(monkeypatch):
    state = {"lib": "cublas"}
    calls = []

    def preferred(backend=None):
        if backend is not None:
            calls.append(backend)
            state["lib"] = backend
        return state["lib"]

    monkeypatch.setattr(torch.backends.cuda, "preferred_blas_library", preferred)
    with pytest.raises(RuntimeError, match="inside"):
        with blas_choice.preferred_blas(CUBLASLT):
            assert state["lib"] == CUBLASLT
            raise RuntimeError("inside")
    assert calls == [CUBLASLT, "cublas"] and state["lib"] == "cublas"


def test_timing_streams_weights_past_l2(monkeypatch):
    """Weights under twice the L2 size are timed over copies, as a decode step streams them."""
    props = type("Props", (), {"L2_cache_size": 1000})()
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: props)
    x, w = torch.randn(2, 16), torch.randn(8, 16)  # 512 bytes: four copies exceed 2 x 1000
    seen = []
    real_linear = F.linear
    monkeypatch.setattr(blas_choice.F, "linear",
                        lambda x, weight, bias=None: seen.append(weight) or real_linear(x, weight))
    call = blas_choice._timed_call(x, w, None)
    for i in range(8):
        torch.testing.assert_close(call(i), real_linear(x, w), rtol=0, atol=0)
    assert len({id(t) for t in seen}) == 4 and seen[0] is w and seen[4] is w
