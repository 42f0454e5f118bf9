"""The CPU-side parts of bench/probes/quant_kernels.py: choosing implementations, the decode-step summary."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench" / "probes"))

import quant_kernels as qk  # noqa: E402


def test_impls_select_by_name_and_the_byte_kernel_makes_a_decode_step():
    impls = qk.implementations()
    names = [i.name for i in qk.selected(impls, "nvfp4_gemv, bf16 GEMV")]
    assert names == ["bf16 GEMV", "nvfp4_gemv", "nvfp4_gemv bytes"]
    assert qk.selected(impls, "") == impls
    results = [qk.Result(shape, *qk.SHAPES[shape], 1, impl, us=10.0, weight_bytes=1e6)
               for shape in qk.SHAPES for impl in names]
    labels = [label for label, _, _ in qk.decode_steps(results, 1e12)]
    assert labels == ["bf16", "nvfp4 gemv", "nvfp4 gemv bytes"]
    assert qk.parse(["--rows", "1", "--impls", "nvfp4_gemv"]).impls == "nvfp4_gemv"


def test_the_byte_kernel_call_switches_the_word_kernel_off_for_the_call_only(monkeypatch):
    import torch

    from autodeploy.kernels import nvfp4_gemv as words_module
    from autodeploy.kernels import quant_gemv
    from autodeploy.kernels import quant_reference as ref

    monkeypatch.setattr(words_module, "launch_one_row", lambda *a, **k: 1 / 0)  # the word kernel must not run
    packed = torch.randint(0, 256, (6, 16), dtype=torch.uint8)
    t = dict(weight_packed=packed, weight_scale=torch.rand(6, 2).to(torch.float8_e4m3fn),
             weight_scale_2=torch.tensor(0.5))
    x = torch.randn(1, 32)
    before = quant_gemv.NVFP4_WORD_GEMV
    torch.testing.assert_close(qk.nvfp4_byte_kernel(x, t), ref.nvfp4_linear_reference(x, *t.values()))
    assert quant_gemv.NVFP4_WORD_GEMV == before


def test_impls_select_the_steps_too():
    """--steps with --impls: the folded / apart pairs of the chosen GEMV only (the NVFP4 fold's A/B)."""
    import quant_steps

    impls = qk.implementations() + quant_steps.implementations(qk.Impl)
    names = {i.name for i in qk.selected(impls, "nvfp4_gemv")}
    assert {f"nvfp4_gemv {step} {mode}" for step in quant_steps.STEPS for mode in quant_steps.MODES} < names
    assert not any(name.startswith("fp8") for name in names)
    args = qk.parse(["--rows", "1", "--gemm-rows", "", "--steps", "--impls", "nvfp4_gemv"])
    assert args.steps and args.impls == "nvfp4_gemv"
