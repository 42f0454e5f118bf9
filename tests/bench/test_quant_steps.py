"""``bench/probes/quant_kernels.py --steps`` without a GPU: every GEMV-with-its-step implementation against its
reference on small weights (the Triton interpreter, fp32), the shapes each runs at, the step summary."""

import sys
from pathlib import Path

import pytest
import torch

import autodeploy  # noqa: F401  (the real package first: the probes' kernels_only then leaves it alone)

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench" / "probes"))

import quant_kernels as qk  # noqa: E402
import quant_steps  # noqa: E402


@pytest.fixture(scope="module")
def impls():
    return quant_steps.implementations(qk.Impl)


def test_every_gemv_runs_its_step_folded_and_apart_as_its_reference(impls):
    torch.manual_seed(0)
    makers = qk.formats()
    k = 128  # one 128 x 128 FP8 scale block; eight NVFP4 blocks a row
    for impl in impls:
        make, dequantize = makers[impl.fmt]
        n = 128 if impl.fmt == "fp8_block" else 16
        weights = make(torch.randn(n, k) * 0.02)
        x = torch.randn(1, k)
        got = impl.call(x, weights)
        want = impl.reference(x, weights, lambda: dequantize(weights))
        assert got.shape == (1, n) and _rel_err(got, want) < 1e-4, impl.name


def _rel_err(got, want):
    return float((got.double() - want.double()).norm() / want.double().norm())


def test_each_step_runs_only_before_the_linears_it_precedes(impls):
    runs = {(shape, impl.name) for shape, _, impl in qk.cases(list(qk.SHAPES), [1, 8], [], impls)}
    assert ("qkv", "fp8_gemv channel add_norm +step") in runs and ("down", "nvfp4_gemv gated step apart") in runs
    assert not any(shape in ("o", "lm_head") for shape, _ in runs)
    assert not any("gated" in name for shape, name in runs if shape != "down")
    assert len(runs) == 3 * 2 * 3  # GEMVs x modes x (qkv, gate_up, down), at one row only (the GEMVs take <= 4)


def test_summary_sets_folded_against_apart_per_gemv():
    results = [qk.Result(shape, 1, 1, 1, f"fp8_gemv channel {step} {mode}", us=us)
               for step, shapes in quant_steps.STEPS.items() for shape in shapes
               for mode, us in (("+step", 10.0), ("step apart", 12.5))]
    lines = quant_steps.summary(results, layers=32)
    assert len(lines) == 1 and "fp8_gemv channel" in lines[0]
    assert "folded 0.960 ms, apart 1.200 ms (-0.240 ms a step)" in lines[0]
    assert quant_steps.summary(results[:-1], layers=32) == []  # down apart not measured: no line


def test_the_launch_sweep_covers_the_folded_fp8_gemv_at_its_shapes(impls, monkeypatch):
    """--steps --sweep: each folded FP8 GEMV (per channel) over FP8_GEMV_SWEEP, run with each launch."""
    measured = []
    monkeypatch.setattr(qk, "measure", lambda shape, m, impl, weights, call, name: measured.append((name, call)))
    qk.launch_sweep("down", [i for i in impls if i.name.startswith("fp8_gemv channel")], None)
    assert [name for name, _ in measured] == [f"fp8_gemv channel gated +step {'/'.join(map(str, c))}"
                                              for c in qk.FP8_GEMV_SWEEP]
    weights = qk.formats()["fp8_channel"][0](torch.randn(8, 64))
    x = torch.randn(1, 64)
    want = next(i for i in impls if i.name == "fp8_gemv channel gated +step").call(x, weights)
    torch.testing.assert_close(measured[-1][1](x, weights), want)  # 8 features x 1024 bytes, 8 warps, fold 4
