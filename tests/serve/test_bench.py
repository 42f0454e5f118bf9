"""The offline benchmark and the serving benchmark client, on the tiny model."""

import asyncio
import json
import re

import pytest

from autodeploy.cli import main
from autodeploy.serve.bench import engine_decode_step_ms, run_offline
from autodeploy.serve.bench_serving import Shard, default_processes, run_benchmark
from autodeploy.serve.bench_stats import percentile


def test_percentile_interpolates():
    assert percentile([1, 2, 3, 4], 50) == 2.5
    assert percentile([5], 99) == 5
    assert percentile([1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], 90) == pytest.approx(10)


def test_offline_benchmark(compiled):
    result = run_offline(compiled, input_len=8, output_len=4, num_requests=6, concurrency=3)
    assert result.ttft.count == 6 and result.tpot.count == 6 and result.itl.count == 6 * 3
    assert result.output_throughput == pytest.approx(result.request_throughput * 4)
    assert 1 <= result.mean_batch_size <= 3 and result.model_decode_step_ms > 0
    assert "TPOT" in result.summary() and "bare model decode step" in result.summary()
    steps = result.steps
    # 6 prompts of 8 tokens prefill in some steps; every request then decodes 3 more tokens
    assert steps.prefill_steps >= 2 and steps.decode_steps >= 3
    assert steps.prefill_tokens > steps.decode_seqs >= 1
    assert steps.max_step_ms * (steps.decode_steps + steps.prefill_steps) >= steps.decode_ms + steps.prefill_ms
    assert "decode-only" in result.summary()
    # the per-step log: one row per engine step, its wall time at least what it waited for the device
    assert len(result.step_log) >= steps.decode_steps + steps.prefill_steps
    assert all(ms >= waited >= 0 for _, _, ms, waited in result.step_log)
    assert result.allocator is None and "allocator" not in result.summary()  # CPU: no CUDA allocator


@pytest.mark.parametrize("overlap", [False, True])
def test_offline_step_log_counts_each_step_once_and_launch_only_calls_apart(compiled, overlap):
    """With overlap the warm-up request left a step in flight, which the timed loop's first call resolved:
    its wall time (the launch of the first prefill) was logged as a one-sequence decode step. The warm-up
    now resolves it; a call that resolves no step is logged without sequences, apart from the stats."""
    result = run_offline(compiled, input_len=8, output_len=4, num_requests=6, concurrency=3, overlap=overlap)
    shapes = [(seqs, tokens) for seqs, tokens, _, _ in result.step_log]
    assert sum(tokens for _, tokens in shapes) == 6 * (8 + 4 - 1)  # each step logged once
    assert [s for s in shapes if s[0]] == [(3, 24), (3, 3), (3, 3), (3, 3)] * 2
    launch_only = shapes.count((0, 0))
    assert launch_only == (2 if overlap else 0)  # the first call, and the first after cohort 1 finished
    assert result.steps.launch_only_calls == launch_only and result.steps.prefill_steps == 2
    assert ("only launched" in result.summary()) == overlap


def test_offline_benchmark_with_per_step_reports(compiled):
    """DELTA reports (as the server) arrive every step; latencies come from the final ones only."""
    from autodeploy.sampling_params import RequestOutputKind

    result = run_offline(compiled, input_len=8, output_len=4, num_requests=4, output_kind=RequestOutputKind.DELTA)
    assert result.ttft.count == 4 and result.tpot.count == 4 and result.itl.count == 4 * 3


def test_allocator_line_flags_retries():
    from autodeploy.serve.bench import _allocator_line

    calm = _allocator_line({"device_mallocs": 2, "device_frees": 0, "retries": 0})
    assert "2 cudaMalloc" in calm and "memory is tight" not in calm
    assert "memory is tight" in _allocator_line({"device_mallocs": 9, "device_frees": 9, "retries": 3})


@pytest.mark.parametrize("overlap", [False, True])
def test_engine_decode_step(compiled, monkeypatch, overlap):
    from autodeploy.compiled import CompiledModel

    steps, call = [], CompiledModel.__call__
    monkeypatch.setattr(CompiledModel, "__call__", lambda self, chunks, *a: steps.append(len(chunks)) or call(self, chunks, *a))
    timing = engine_decode_step_ms(compiled, batch_size=3, context_len=9, steps=4, warmup=1, overlap=overlap)
    assert 0 <= timing.waited_ms < timing.ms
    assert steps[-5:] == [3] * 5  # warm-up and timed steps decode all three sequences


def test_engine_decode_step_keeps_the_whole_batch_when_prefill_takes_several_steps(compiled, monkeypatch):
    """8 prompts of 100 tokens take 4 steps of 256 tokens: the first prompts decode meanwhile, and
    must still be running in every timed step."""
    import autodeploy.serve.bench as bench
    from autodeploy.compiled import CompiledModel

    steps, call = [], CompiledModel.__call__
    monkeypatch.setattr(CompiledModel, "__call__", lambda self, chunks, *a: steps.append(len(chunks)) or call(self, chunks, *a))
    engine_decode_step_ms(compiled, batch_size=8, context_len=100, steps=4, warmup=1)
    assert steps[-5:] == [8] * 5
    # with the old budget (warm-up + steps + 2 tokens) the batch shrinks: a clear error, not a number
    monkeypatch.setattr(bench, "decode_tokens_needed", lambda model, b, c, n: n + 2)
    with pytest.raises(RuntimeError, match="requests finished during the measurement"):
        engine_decode_step_ms(compiled, batch_size=8, context_len=100, steps=4, warmup=1)


def test_offline_benchmark_command(compiled, monkeypatch, capsys, tmp_path):
    import autodeploy.compiler

    monkeypatch.setattr(autodeploy.compiler, "compile", lambda model_dir, **options: compiled)
    out = tmp_path / "result.json"
    assert main(["bench", "offline", "unused", "--input_len", "4", "--output_len", "3", "--num_requests", "2",
                 "--output_json", str(out)]) == 0
    assert "throughput" in capsys.readouterr().out
    assert json.loads(out.read_text())["num_requests"] == 2


@pytest.mark.parametrize("endpoint, mode", [("completions", {"concurrency": 4}), ("chat", {"request_rate": 50.0})])
def test_serving_benchmark(live, compiled, endpoint, mode):
    result = asyncio.run(run_benchmark(live.url, endpoint=endpoint, input_len=8, output_len=4, num_requests=8,
                                       vocab_size=compiled.vocab_size, **mode))
    assert (result.completed, result.failed) == (8, 0), result.first_error
    assert result.ttft.count == 8 and result.tpot.count == 8 and result.e2e.count == 8
    assert result.itl.count >= 8 * 3  # chat streams one extra (role) chunk per request
    assert result.ttft.p50_ms <= result.e2e.p50_ms


def test_serving_benchmark_in_several_client_processes(live, compiled):
    result = asyncio.run(run_benchmark(live.url, input_len=8, output_len=4, num_requests=7, concurrency=3,
                                       vocab_size=compiled.vocab_size, processes=2))
    assert (result.completed, result.failed) == (7, 0), result.first_error
    assert result.ttft.count == 7 and result.itl.count == 7 * 3
    # first send to last end: never longer than every request one after another (the processes take seconds to start)
    assert 0 < result.seconds <= result.e2e.mean_ms * result.e2e.count / 1e3 + 0.05


def test_shards_share_requests_concurrency_and_rate():
    shard = Shard("u", {}, [{"n": i} for i in range(10)], 5, None, 7, 60.0)
    parts = shard.split(3)
    assert [p.concurrency for p in parts] == [2, 2, 1] and [p.seed for p in parts] == [7, 8, 9]
    assert sorted(x["n"] for p in parts for x in p.payloads) == list(range(10))
    assert len(shard.split(8)) == 5  # never more processes than requests in flight
    assert [default_processes(c) for c in (None, 1, 16, 17, 64)] == [1, 1, 1, 2, 4]
    poisson = Shard("u", {}, [{}] * 4, None, 8.0, 0, 60.0).split(4)
    assert [p.request_rate for p in poisson] == [2.0] * 4 and all(p.concurrency is None for p in poisson)


def test_serving_benchmark_command(live, compiled, capsys):
    assert main(["bench", "serve", "--base_url", live.url, "--input_len", "4", "--output_len", "2",
                 "--num_requests", "3", "--max-concurrency", "2", "--vocab_size", str(compiled.vocab_size)]) == 0
    out = capsys.readouterr().out
    assert "completed 3, failed 0" in out and "TTFT" in out and "ITL" in out


def test_serving_benchmark_with_text_prompts_of_about_the_input_length(live, tiny_dir, capsys):
    assert main(["bench", "serve", "--base_url", live.url, "--input_len", "40", "--output_len", "3",
                 "--num_requests", "4", "--concurrency", "2", "--tokenizer", str(tiny_dir)]) == 0
    out = capsys.readouterr().out
    assert "completed 4, failed 0" in out
    prompt_tokens = int(re.search(r"(\d+) prompt tokens per request", out).group(1))
    assert 36 <= prompt_tokens <= 41  # the server tokenized the text back to about --input_len tokens (+ BOS)


def test_a_client_process_that_died_is_an_error_not_a_wait():
    import queue
    from types import SimpleNamespace

    from autodeploy.serve.bench_clients import _receive

    workers = [SimpleNamespace(exitcode=None), SimpleNamespace(exitcode=1)]
    with pytest.raises(RuntimeError, match=r"process\(es\) \[1\] stopped"):
        _receive(queue.Queue(), 2, workers, timeout=60.0)
