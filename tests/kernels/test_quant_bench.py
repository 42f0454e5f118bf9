"""bench/quant_kernels.py on the CPU: what it runs, its table, its decode-step summary and its JSON,
with the GPU measurements stubbed; its weight formats built at a small shape."""

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import quant_kernels as qk  # noqa: E402

from autodeploy.kernels import quant_reference as ref  # noqa: E402


def test_cases_run_the_gemvs_at_one_row_and_only_the_gemms_at_8192():
    impls = qk.implementations()
    found = list(qk.cases(["qkv", "down"], [1, 8], [8192], impls))
    names = lambda shape, m: [i.name for s, r, i in found if s == shape and r == m]  # noqa: E731
    assert "fp8_gemv channel" in names("qkv", 1) and "nvfp4_gemv" in names("qkv", 1)
    assert "fp8_gemm triton rowwise" not in names("qkv", 1) and "fp8_gemm triton rowwise" in names("qkv", 8)
    assert not any("gemv" in n.lower() for n in names("down", 8) + names("down", 8192))
    assert names("down", 8192) == [i.name for i in impls if i.max_rows is None]
    shapes = [s for s, _, _ in found]
    assert shapes[0] == "qkv" and shapes[-1] == "down" and shapes == sorted(shapes, key=["qkv", "down"].index)
    everything = list(qk.cases(list(qk.SHAPES), [1, 8, 64, 512], [8192], impls))
    assert len(everything) == 5 * (12 + 3 * 9 + 7)  # 12 at one row, 9 up to 512 rows, the 7 GEMMs at 8192


def _result(shape, impl, us, rows=1, err=1e-3, note=""):
    n, k = qk.SHAPES[shape]
    fmt, per_weight = {"bf16 GEMV": ("bf16", 2.0), "fp8_gemv channel": ("fp8_channel", 1.0),
                       "nvfp4_gemv": ("nvfp4", 0.5625)}[impl]
    return qk.Result(shape, n, k, rows, impl, fmt, us=us, err=err, weight_bytes=per_weight * n * k, note=note)


def test_decode_summary_adds_32_layers_and_the_bf16_lm_head():
    results = [_result(s, impl, 10.0) for s in qk.SHAPES for impl in ("bf16 GEMV", "fp8_gemv channel")]
    lines = qk.decode_summary(results, copy_bytes_per_s=1e12)
    labels = [line.split(",")[2].strip()[:8] for line in lines]
    assert labels == ["bf16    ", "fp8 gemv"]  # no line for the formats without rows
    layer_bytes = sum(n * k for name, (n, k) in qk.SHAPES.items() if name != "lm_head")
    head_bytes = 2 * 128256 * 4096
    fp8 = lines[1]
    assert f"{(4 * 32 + 1) * 10 / 1e3:7.3f} ms" in fp8
    assert f"floor {(32 * layer_bytes + head_bytes) / 1e12 * 1e3:.3f} ms" in fp8


def test_table_shows_rates_failures_and_refusals():
    rows = [_result("o", "fp8_gemv channel", 8.0),
            _result("o", "nvfp4_gemv", 4.0, err=0.5),
            qk.Result("o", 4096, 4096, 8, "fp8_gemm block scaled_mm", note="unsupported: no blockwise")]
    text = qk.table(rows, copy_bytes_per_s=3e12)
    lines = text.splitlines()
    assert "ok" in lines[2] and f"{4096 * 4096 / 8e-6 / 1e9:.0f}" in lines[2]  # GB/s of the fp8 weight
    assert f"{100 * 4096 * 4096 / 8e-6 / 3e12:.0f}" == lines[2].split()[-2]  # %copy
    assert "FAIL" in lines[3] and not rows[1].ok
    assert lines[4].rstrip().endswith("unsupported: no blockwise") and " - " in lines[4]


def test_main_prints_the_table_writes_json_and_fails_on_a_failed_check(monkeypatch, tmp_path, capsys):
    found = [_result("o", "fp8_gemv channel", 8.0), _result("o", "nvfp4_gemv", 4.0, err=0.5)]
    monkeypatch.setattr(qk.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(qk.torch.cuda, "get_device_name", lambda: "NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(qk, "copy_bandwidth", lambda: 3.0e12)
    monkeypatch.setattr(qk, "measure_all", lambda args, impls: found)
    out_json = tmp_path / "quant.json"
    assert qk.main(["--shapes", "o", "--json", str(out_json)]) == 1
    out = capsys.readouterr().out
    assert "copy 3.00 TB/s" in out and "fp8_gemv channel" in out and "FAIL" in out
    saved = json.loads(out_json.read_text())
    assert saved["header"]["copy_bytes_per_s"] == 3.0e12 and len(saved["rows"]) == 2
    assert saved["rows"][0]["gbps"] == pytest.approx(4096 * 4096 / 8e-6 / 1e9)


def test_unknown_shape_is_refused(capsys):
    with pytest.raises(SystemExit):
        qk.parse(["--shapes", "qkv,mlp"])
    assert "unknown --shapes ['mlp']" in capsys.readouterr().err


def test_weight_formats_quantize_what_they_are_given():
    w = torch.randn(256, 384) * 0.02
    makers = qk.formats()
    for fmt in ("fp8_tensor", "fp8_channel", "fp8_block"):
        made = makers[fmt][0](w)
        deq = makers[fmt][1](made)
        assert deq.shape == w.shape and ((deq - w).norm() / w.norm()) < 0.05, fmt
    nvfp4 = makers["nvfp4"][0](w)
    assert ref.check_nvfp4(**nvfp4) == (256, 384)
    assert qk.weight_bytes(nvfp4) == 256 * 192 + 256 * 24 + 4


@pytest.mark.slow
def test_every_default_launch_compiles_for_hopper_without_spills():
    """GPU-only compile errors and register spills, caught without a GPU (bench/compile_sm90.py's tool)."""
    import os
    import subprocess

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, str(Path(qk.__file__)), "--compile-sm90"], capture_output=True,
                         text=True, env=env, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr
    rows = {line.split("  ")[0].strip(): line for line in run.stdout.splitlines()}
    assert "wgmma" in rows["fp8_gemm 4096 rows block"] and "wgmma" in rows["nvfp4 weight-only 4096 rows"]
    assert "ld.v4" in rows["fp8_gemv 1 row(s)"] and "ld.v4" in rows["nvfp4_gemv 1 row(s)"]  # 16-byte loads


def test_launch_sweep_runs_every_config_of_the_weight_only_kernels(monkeypatch):
    """Each swept call computes its kernel's reference (small CPU weights, the interpreter)."""
    makers = qk.formats()
    weights = {fmt: makers[fmt][0](torch.randn(64, 256) * 0.02) for fmt in ("fp8_channel", "nvfp4")}
    seen = []

    def fake_measure(shape, m, impl, _, call, name):
        x = torch.randn(1, 256)
        t = weights[impl.fmt]
        want = impl.reference(x, t, lambda: makers[impl.fmt][1](t))
        assert ((call(x, t).float() - want).norm() / want.norm()) < 1e-5, name
        seen.append(name)
        return qk.Result(shape, 64, 256, m, name)

    monkeypatch.setattr(qk, "measure", fake_measure)
    found = qk.launch_sweep("o", qk.implementations(), weights=None)
    assert len(found) == 2 * len(qk.GEMV_SWEEP) + 2 * len(qk.TC_SWEEP)
    assert "fp8_gemv channel 4/1024/4" in seen and "nvfp4_gemm 32/256/3" in seen


def test_every_implementation_computes_its_reference_on_small_weights():
    """The bench's calls and references agree (CPU, the interpreter; torch._scaled_mm is CUDA-only)."""
    makers = qk.formats()
    for impl in qk.implementations():
        if "scaled_mm" in impl.name:
            continue
        t = makers[impl.fmt][0](torch.randn(128, 256) * 0.02)
        x = torch.randn(2, 256)
        want = impl.reference(x, t, lambda: makers[impl.fmt][1](t))
        assert ((impl.call(x, t).float() - want).norm() / want.norm()) < 1e-5, impl.name


def test_as_a_section_of_full_table_it_yields_the_suites_rows(monkeypatch):
    """``table_rows`` with the suite's header and row type (``bench/table.py`` on main: stood in for here)."""
    import argparse
    import dataclasses
    import types

    @dataclasses.dataclass(frozen=True)
    class TableRow:  # the fields bench/table.py's TableRow has
        section: str
        workload: str
        impl: str
        seconds: float | None
        tokens_per_s: float | None = None
        floor_s: float | None = None
        note: str = ""
        weights: str = "bf16"
        passed: bool | None = None
        metrics: dict = dataclasses.field(default_factory=dict)

    monkeypatch.setitem(sys.modules, "table", types.SimpleNamespace(TableRow=TableRow))
    found = [_result(s, impl, 10.0) for s in qk.SHAPES for impl in ("bf16 GEMV", "fp8_gemv channel")]
    found[1] = qk.Result("o", 4096, 4096, 1, "fp8_gemv channel", "fp8_channel", us=None, note="unsupported: x")
    monkeypatch.setattr(qk, "measure_all", lambda options, impls: found)
    group = argparse.ArgumentParser()
    qk.add_options(group)
    args = group.parse_args(["--quant-shapes", "o,qkv"])
    header = types.SimpleNamespace(bandwidth=2e12, gemm_flops=1e15)
    rows = list(qk.table_rows(args, header))
    assert len(rows) == len(found) + 1  # the bf16 decode step; fp8's lacks the o projection
    first = rows[0]
    assert (first.section, first.workload, first.impl) == ("quant_kernels", "qkv 6144x4096 M=1", "bf16 GEMV")
    assert first.seconds == pytest.approx(10e-6) and first.floor_s == pytest.approx(2 * 6144 * 4096 / 2e12)
    assert first.passed is True and "rel err 1.0e-03" in first.note
    assert rows[1].seconds is None and rows[1].note == "unsupported: x" and rows[1].weights == "fp8-ch"
    assert rows[-1].workload == "llama8b linears, batch 1" and rows[-1].impl == "bf16"
    with pytest.raises(SystemExit):
        qk.table_rows(group.parse_args(["--quant-shapes", "mlp"]), header).__next__()
