"""The suite's GPU-only sections on a machine without a GPU: the kernels section's inputs and rows, the
serving section against a real ``autodeploy serve`` on the CPU."""

import kernel_bench
import pytest
import serving_bench
import table
import torch
from gpu_harness import Report, Row

from autodeploy.ops.rope import rope_reference

HEADER = table.Header(date="2026-12-05 05:07", device="NVIDIA H200", torch="2.11.0", triton="3.6.0",
                      transformers="5.17.0", commit="abc1234", sections="kernels", bandwidth=4e12, gemm_flops=800e12)


def test_rotary_rows_are_the_rotation_of_each_tokens_position():
    """decode+rope rows: token i of a (context c, n new) sequence sits at position c + i."""
    cos, sin = kernel_bench.rotary_rows([(5, 2), (0, 1)], device="cpu")
    assert cos.shape == sin.shape == (3, kernel_bench.D) and cos.dtype == torch.bfloat16
    x = torch.randn(3, 1, kernel_bench.D)
    rotated = rope_reference(x, cos.float()[:, None], sin.float()[:, None], False)
    assert torch.allclose(rotated[2], x[2])  # position 0: no rotation
    torch.testing.assert_close(rotated.norm(dim=-1), x.norm(dim=-1), atol=0.05, rtol=0.02)  # a rotation
    half = kernel_bench.D // 2
    assert torch.equal(cos[:, :half], cos[:, half:]) and torch.equal(sin[:, :half], sin[:, half:])  # half-rotate
    want = torch.tensor([5.0, 6.0, 0.0])  # the first frequency is 1: column 0 is the angle of the position
    torch.testing.assert_close(cos[:, 0].float(), want.cos(), atol=1e-2, rtol=0)
    torch.testing.assert_close(sin[:, 0].float(), want.sin(), atol=1e-2, rtol=0)


def test_head_major_pools_keep_the_logical_shape_with_each_heads_page_contiguous():
    """The kernel reads the pool through its strides, so a head-major pool is a view."""
    seqs = [(20, 1), (3, 2)]  # 2 + 1 pages, one spare
    token_major, head_major = (kernel_bench.paged_batch(seqs, 4, 2, 8, head_major=layout, device="cpu").cache
                               for layout in (False, True))
    assert token_major.shape == head_major.shape == (4, 2, kernel_bench.PAGE, 2, 8)
    assert token_major.is_contiguous() and not head_major.is_contiguous()
    assert head_major.transpose(2, 3).is_contiguous()  # [page, k/v, head, token, dim] in memory
    assert head_major.stride(2) == 8 and head_major.stride(3) == kernel_bench.PAGE * 8


def test_kernel_rows_carry_the_check_and_the_longer_of_the_byte_and_flop_floors(monkeypatch):
    report = Report([Row("rms_norm T=1", 1e-3, graph_us=2.0, eager_us=5.0, torch_us=3.0, bytes=4e6),
                     Row("prefill 4x1024", 2e-3, graph_us=400.0, bytes=4e6, flops=160e9, note="tile 64x64"),
                     Row("check mixed", 0.5, note="mixed step")])
    monkeypatch.setattr(kernel_bench, "run_all", lambda flashinfer: report)
    norm, prefill, check = kernel_bench.table_rows(type("Args", (), {"flashinfer": False})(), HEADER)
    assert norm.seconds == 2e-6 and norm.floor_s == 1e-6 and norm.roofline_share == 0.5 and norm.passed
    assert norm.note == "rel err 1.0e-03; torch 3.0 us; eager 5.0 us"
    assert prefill.floor_s == 200e-6 and prefill.note.endswith("tile 64x64")  # 160 GFLOP at 800 TFLOP/s
    assert check.seconds is None and check.floor_s is None and check.passed is False


def test_the_fp8_pool_holds_each_half_at_its_own_scale():
    """K and V quantized as a calibrated checkpoint's scales quantize them (amax / 448): read back within e4m3's
    precision."""
    pool = torch.randn(3, 2, kernel_bench.PAGE, 2, 8)
    pool[:, 1] *= 10
    fp8, scales = kernel_bench.fp8_pool(pool)
    assert fp8.dtype == torch.float8_e4m3fn and scales[1] / scales[0] > 5
    for i, scale in enumerate(scales):
        assert scale == pool[:, i].abs().max().item() / 448
        torch.testing.assert_close(fp8[:, i].float() * scale, pool[:, i], rtol=0.07, atol=scale * 2**-6)


@pytest.mark.slow
def test_serving_section_measures_a_real_server(tmp_path):
    """The section's history server on the CPU (tiny random model with the section's tokenizer): every load of
    the plan (token-id and text prompts, Poisson, the long mix), the guidellm hook, the rows, the verdicts and
    the issue's table in the rows' notes; the server stopped afterwards."""
    import argparse

    import httpx

    from autodeploy.tiny import make_tiny_checkpoint

    model_dir = str(make_tiny_checkpoint("llama", tmp_path / "m", vocab_size=2048))
    serving_bench.save_tokenizer(model_dir)
    args = argparse.Namespace(concurrency="1,2", serving_len="8/4", long_len="40/4", serving_quick=True, per_slot=0)
    plan = serving_bench.Plan.from_args(args)
    assert plan == serving_bench.Plan([1, 2], (8, 4), (40, 4), per_slot=2, fresh_server=False)
    options = serving_bench.server_options(2, 44, {"dtype": "float32"}) + ["--device", "cpu"]
    hook = "echo {url} > {out}/url; echo '{\"output_tok_s\": 12.5}'"
    runs, hooks = serving_bench.serve_all(hook, plan, model_dir, options, tmp_path / "out", 2048)
    assert [r.name for r in runs] == ["c1 #1", "c2 #1", "c2 #2", runs[3].name, "40/4 c2"]
    assert runs[3].name.startswith("poisson 80% (") and runs[3].concurrency is None
    assert all(r.result.failed == 0 and r.compiles_after_ready == 0 for r in runs)
    assert [r.result.completed for r in runs] == [2, 4, 4, 4, 2]
    assert runs[4].text_prompts and 36 <= runs[4].result.mean_prompt_tokens <= 41  # the server adds <s>
    assert hooks[0].passed and hooks[0].tokens_per_s == 12.5
    assert (tmp_path / "out" / "timeline_history.jsonl").stat().st_size > 0
    assert "listening on" in (tmp_path / "out" / "timeline_history.log").read_text()
    result = runs[1].result
    row = serving_bench.serving_row("tiny c2", runs[1], floor=1e-3, weights="fp32",
                                    engine=(2, 2 * result.output_throughput))
    assert row.seconds == result.itl.p50_ms / 1e3 and row.tokens_per_s == result.output_throughput
    assert row.passed is None and row.metrics["TTFT"]["p99"] == result.ttft.p99_ms
    assert row.note.startswith("50% of engine b2; TTFT p50/p90/p99 ") and "token-id prompts of" in row.note
    # a batch-1 step no server can match, a batch-2 step no server can be slower than
    steps = {1: (1e-6, 1e-6), 2: (1e9, 1e9)}
    checks = {r.impl: r.passed for r in serving_bench.check_rows(runs, steps, plan.concurrencies, "tiny")}
    assert checks["check: >= 85% of engine b2 tok/s"] and checks["check: compiles after ready"]
    assert checks["check: TPOT p50 ms within 5% of the bare step"] is False
    assert hooks[0].note.endswith("output_tok_s 12.5")
    url = (tmp_path / "out" / "url").read_text().strip()
    with pytest.raises(httpx.HTTPError):  # the server is gone
        httpx.get(f"{url}/health", timeout=2)
