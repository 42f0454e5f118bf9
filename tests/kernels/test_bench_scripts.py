"""The GPU benchmark scripts import on a machine without a GPU, and their host-side inputs are right."""

import sys
from pathlib import Path

import torch

from autodeploy.ops.rope import rope_reference

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import kernels_gpu  # noqa: E402


def test_rotary_rows_are_the_rotation_of_each_tokens_position():
    """decode+rope rows: token i of a (context c, n new) sequence sits at position c + i."""
    cos, sin = kernels_gpu.rotary_rows([(5, 2), (0, 1)], device="cpu")
    assert cos.shape == sin.shape == (3, kernels_gpu.D) and cos.dtype == torch.bfloat16
    x = torch.randn(3, 1, kernels_gpu.D)
    rotated = rope_reference(x, cos.float()[:, None], sin.float()[:, None], False)
    assert torch.allclose(rotated[2], x[2])  # position 0: no rotation
    torch.testing.assert_close(rotated.norm(dim=-1), x.norm(dim=-1), atol=0.05, rtol=0.02)  # a rotation
    half = kernels_gpu.D // 2
    assert torch.equal(cos[:, :half], cos[:, half:]) and torch.equal(sin[:, :half], sin[:, half:])  # half-rotate
    want = torch.tensor([5.0, 6.0, 0.0])  # the first frequency is 1: column 0 is the angle of the position
    torch.testing.assert_close(cos[:, 0].float(), want.cos(), atol=1e-2, rtol=0)
    torch.testing.assert_close(sin[:, 0].float(), want.sin(), atol=1e-2, rtol=0)


def _tiny_linear_layers(count: int = 2):
    """gemv_gpu.Layer weights of a hidden-32 model (qkv 48, intermediate 32) for the chain benchmarks."""
    import gemv_gpu

    def w(n, k):
        return torch.randn(n, k) / k**0.5

    return [gemv_gpu.Layer(w(48, 32), w(32, 32), w(64, 32), w(32, 32), 1 + 0.1 * torch.randn(32),
                           1 + 0.1 * torch.randn(32)) for _ in range(count)]


def test_gemv_chain_variants_compute_the_same_step():
    """gemv_gpu's fused chain (fused GEMVs, o as a GEMV or not) equals its unfused cuBLAS chain."""
    import gemv_gpu

    layers = _tiny_linear_layers()
    x, res = torch.randn(2, 32), torch.randn(2, 32)
    want = gemv_gpu.step(layers, x, res, gemv_gpu.Variant("cublas", fused=False), None)
    for variant in gemv_gpu.VARIANTS[1:]:
        got = gemv_gpu.step(layers, x, res, variant, None)
        for g, t in zip(got, want):
            torch.testing.assert_close(g, t, atol=1e-4, rtol=1e-4)


def test_layer_chain_variants_compute_the_same_step():
    """layer_chain's attention variants (splits, first key block preloaded or not) give the same step,
    and the attention changes it (the chain without it is a different computation)."""
    import layer_chain

    shape = dict(hidden=32, heads=4, kv_heads=2, head_dim=8, inter=48, layers=2)
    torch.manual_seed(0)
    layers, step = layer_chain.make_layers(shape, context=21, device="cpu", dtype=torch.float32)
    x, res = torch.randn(1, 32), torch.randn(1, 32)
    # the GEMV variants: every linears-only one, and the attention with the tiles of all of them
    chosen = [v for v in layer_chain.variants(shape, device="cpu")
              if not v[2] or v[1] is None or v[0].endswith("all 2 x 1024")]
    outs = {name: layer_chain.decode_step(layers, step, shape, x, res, launch, gemvs)
            for name, launch, gemvs in chosen}
    assert len(outs) == len(chosen)
    without = outs.pop("linears only")
    torch.testing.assert_close(outs.pop("copy kernel"), without, atol=0, rtol=0)
    for name in [name for name in outs if name.startswith("linears only, ")]:
        torch.testing.assert_close(outs.pop(name), without, atol=1e-5, rtol=1e-5)
    first = next(iter(outs.values()))
    assert len(outs) >= 4 and not torch.allclose(without, first, atol=1e-3)
    for got in outs.values():
        torch.testing.assert_close(got, first, atol=1e-4, rtol=1e-4)
    for _, launch, _ in layer_chain.variants(shape, device="cpu")[2:5]:
        assert layer_chain.check_attention(layers[0], step, shape, launch) < 1e-5


def test_skinny_chain_equals_its_cublas_chain():
    """skinny_gpu's chain with the tensor-core GEMM (a few launch configs) computes the cuBLAS chain's step."""
    import skinny_gpu

    layers = _tiny_linear_layers()
    x, res = torch.randn(4, 32), torch.randn(4, 32)
    want = skinny_gpu.step(layers, x, res, None)
    for config in (skinny_gpu.Config(block_n=16, block_k=16, num_stages=2),
                   skinny_gpu.Config(block_n=16, block_k=16, num_stages=2, per_sm=4)):
        got = skinny_gpu.step(layers, x, res, config)
        for g, t in zip(got, want):
            torch.testing.assert_close(g, t, atol=1e-4, rtol=1e-4)


def test_blas_table_shapes_are_the_decode_bench_models_linears():
    """bench/blas_gpu.py times the (N, K) of every linear of the decode benchmark's model shapes."""
    import blas_gpu
    from decode_bench import llama_config

    for name, linears in blas_gpu.SHAPES.items():
        cfg = llama_config(name)
        h, inter, d = cfg.hidden_size, cfg.intermediate_size, cfg.hidden_size // cfg.num_attention_heads
        assert linears == {"qkv": ((cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * d, h),
                           "o": (h, cfg.num_attention_heads * d), "gate_up": (2 * inter, h),
                           "down": (h, inter), "lm_head": (cfg.vocab_size, h)}


def test_head_major_pools_keep_the_logical_shape_with_each_heads_page_contiguous():
    """--layout-sweep: the kernel reads the pool through its strides, so a head-major pool is a view."""
    token_major = kernels_gpu._cache(3, 2, 8, head_major=False, device="cpu")
    head_major = kernels_gpu._cache(3, 2, 8, head_major=True, device="cpu")
    assert token_major.shape == head_major.shape == (3, 2, kernels_gpu.PAGE, 2, 8)
    assert token_major.is_contiguous() and not head_major.is_contiguous()
    assert head_major.transpose(2, 3).is_contiguous()  # [page, k/v, head, token, dim] in memory
    assert head_major.stride(2) == 8 and head_major.stride(3) == kernels_gpu.PAGE * 8


def test_trace_stats_time_events_from_the_first_start_and_each_programs_intervals():
    """--trace-attention: quantiles over the programs that stored, in us."""
    from autodeploy.kernels import trace

    buf = trace.buffer(3, torch.device("cpu"))
    for row, start in enumerate((1_000, 2_000, 3_000)):  # ns; events 1, 2, 6, 3, 5 one us apart
        for offset, event in enumerate((1, 2, 6, 3, 5)):
            buf[row, event] = start + 1_000 * offset
    buf[2, 5] = trace.UNSET  # a program that never stored is left out
    import attention_sweeps

    stats = attention_sweeps._trace_stats(buf)
    assert stats["at start"] == [0.0, 0.1, 0.5, 0.9, 1.0]
    assert stats["at stored"][0] == 4.0 and stats["at stored"][-1] == 5.0
    assert stats["start -> stored"] == [4.0] * 5 and stats["q loaded -> attended"] == [1.0] * 5


def test_cublas_pdl_probe_structs_match_the_driver_api_and_it_tells_gemms_from_ours():
    """The probe edits captured graphs through ctypes: CUgraphEdgeData is 8 bytes, the v2 kernel node
    params 72 on 64-bit hosts; importing it loads no CUDA driver."""
    import ctypes

    import cublas_pdl_probe as probe

    assert ctypes.sizeof(probe.EdgeData) == 8 and ctypes.sizeof(probe.KernelParams) == 72
    assert probe.is_gemm("nvjet_sm90_tst_64x64_64x13_4x1_v_bz_TNT")
    assert not probe.is_gemm("_rms_norm_kernel") and not probe.is_gemm("<node type 2>")
    assert probe._CUDA == []


def test_offline_timeline_attributes_idle_gaps_to_the_step_call_running_on_the_host():
    import offline_timeline

    kernels = [(0, 10), (5, 12), (12.5, 20), (60, 70), (70, 80), (200, 210), (300, 301)]  # µs; overlaps count once
    steps = [(0, 50, 0), (50, 150, 1)]  # the host's step calls: 0 prefilled, 1 only decoded
    span, busy, gaps, per_phase, per_step = offline_timeline.device_idle(kernels, steps, [(2, 64), (2, 2)], 20.0)
    assert (span, busy) == (301, 12 + 7.5 + 20 + 10 + 1)
    assert gaps == [(20, 60), (80, 200), (210, 300)]  # the 0.5 µs gap is short
    assert per_phase == {"prefill steps": 40, "decode-only steps": 120, "between step calls": 90}
    assert per_step == {0: 40, 1: 120}
    assert offline_timeline.device_idle([(0, 5), (30, 40)], [], [], 50.0)[2] == []  # no gap over the bound


def test_offline_timeline_runs_every_request_to_its_end(tmp_path):
    """The probe's engine (warm-up request, then all requests queued) on a tiny CPU model."""
    import random

    import offline_timeline

    from autodeploy.compiler import compile as compile_model
    from autodeploy.tiny import make_tiny_checkpoint

    model = compile_model(str(make_tiny_checkpoint("llama", tmp_path / "m")), weights="random", dtype="float32",
                          device="cpu", max_batch_size=8, max_num_tokens=64, max_seq_len=64)
    rng = random.Random(0)
    prompts = [[rng.randrange(model.vocab_size) for _ in range(16)] for _ in range(12)]
    with torch.inference_mode():
        engine = offline_timeline.new_engine(model, prompts, 8)
        shapes = []
        while engine.has_unfinished_requests():
            engine.step()
            shapes.append((len(engine.last_schedule.chunks), engine.last_schedule.num_tokens))
    assert shapes[0] == (4, 64)  # four 16-token prompts fill the 64-token budget
    assert max(seqs for seqs, _ in shapes) == 8 and all(tokens <= 64 for _, tokens in shapes)
    assert sum(tokens for _, tokens in shapes) == 12 * (16 + 8 - 1)  # every prompt token, then 7 decode steps each


def test_offline_timeline_lists_runtime_calls_that_held_the_host(capsys):
    import offline_timeline

    events = [{"cat": "cuda_runtime", "name": "cudaMalloc", "ts": 10, "dur": 5000},
              {"cat": "cuda_runtime", "name": "cudaMalloc", "ts": 120, "dur": 3000},
              {"cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": 20, "dur": 5},  # short: left out
              {"cat": "kernel", "name": "gemm", "ts": 30, "dur": 9000}]  # not a host call
    offline_timeline.print_slow_runtime_calls(events, [(0, 100, 0), (100, 200, 1)])
    lines = capsys.readouterr().out.splitlines()
    assert lines[1:] == ["    cudaMalloc: 2 calls, 8.0 ms, in step calls [0, 1]"]


def test_offline_timeline_kernel_families():
    import offline_timeline

    assert offline_timeline.kernel_family("nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_TNT") == "GEMM"
    assert offline_timeline.kernel_family("_paged_attention_kernel") == "attention"
    assert offline_timeline.kernel_family("_fused_add_rms_norm_kernel") == "RMSNorm"
    assert offline_timeline.kernel_family("Memset (Device)") == "other"
