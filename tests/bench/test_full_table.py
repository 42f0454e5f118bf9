"""bench/full_table.py (the suite's entry point) and its table: options, dry run, rows saved as they come,
merged tables, exit status; the decode, offline and cold-start sections' CPU-side parts."""

import importlib
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import cold_start
import decode_bench
import full_table
import offline_bench
import pytest
import table
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

TINY = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=128)
HEADER = table.Header(date="2026-12-05 05:07", device="NVIDIA H200", torch="2.11.0", triton="3.6.0",
                      transformers="5.17.0", commit="abc1234", sections="decode", bandwidth=4.18e12,
                      gemm_flops=767e12)


def _main(monkeypatch, *argv) -> int:
    monkeypatch.setattr(sys, "argv", ["full_table.py", *argv])
    return full_table.main()


def _linear_weights(cfg) -> tuple[int, int]:
    """(weights of the decoder layers' linears, weights of the LM head) of the real HF model."""
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    layers = sum(m.weight.numel() for name, m in model.named_modules()
                 if isinstance(m, torch.nn.Linear) and name != "lm_head")
    return layers, model.lm_head.weight.numel()


def test_offline_floor_counts_every_linear_flop_and_the_decodes_kv_reads():
    cfg = LlamaConfig(**TINY)
    layers, head = _linear_weights(cfg)
    flops = offline_bench.offline_floor_s(cfg, 8, 4, 3, flops_per_s=1.0, bytes_per_s=math.inf)
    assert flops == 2 * (layers * 3 * (8 + 4) + head * 3 * 4)
    kv_bytes = offline_bench.offline_floor_s(cfg, 8, 4, 3, flops_per_s=math.inf, bytes_per_s=1.0)
    per_token = cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * (64 // 4) * 2  # K and V, bf16
    assert kv_bytes == 3 * (8 + 9 + 10 + 11) * per_token


def test_offline_floor_of_the_8b_shape_puts_20k_tokens_per_s_near_its_roofline():
    """The anchors' rates: 128/128 x 512 cannot beat ~2.9 s (~23k tok/s); 1000/1000 is KV-bound."""
    cfg = decode_bench.llama_config("llama8b")
    short = offline_bench.offline_floor_s(cfg, 128, 128, 512, 767e12, 4.18e12)
    long = offline_bench.offline_floor_s(cfg, 1000, 1000, 512, 767e12, 4.18e12)
    assert 2.7 < short < 3.0 and 512 * 128 / short < 24_500
    assert 40 < long < 46


def test_decode_floor_streams_the_weights_at_their_formats_bytes():
    cfg = LlamaConfig(**TINY)
    layers, head = _linear_weights(cfg)
    kv = decode_bench.streamed_bytes(cfg, 3, 10, bytes_per_weight=0, head_bytes=0)
    assert kv == 3 * 10 * cfg.num_hidden_layers * 2 * 32 * 2  # K and V of 2 heads x 16, bf16
    assert decode_bench.streamed_bytes(cfg, 3, 10) == kv + 2 * (layers + head)
    assert decode_bench.streamed_bytes(cfg, 3, 10, bytes_per_weight=1, head_bytes=1) == kv + layers + head
    # online FP8 leaves the LM head bf16; NVFP4 adds one e4m3 scale per 16 weights
    fp8, nvfp4 = table.WEIGHT_FORMATS["fp8"], table.WEIGHT_FORMATS["nvfp4"]
    assert decode_bench.streamed_bytes(cfg, 3, 10, fp8.bytes_per_weight, fp8.head_bytes_per_weight) == (
        kv + layers + 2 * head)
    assert nvfp4.bytes_per_weight == 0.5625 and nvfp4.settings["quantization"] == "nvfp4"


def test_a_hybrid_decode_floor_adds_each_sequences_state_and_a_failed_peer_is_a_row_that_says_why():
    cfg = decode_bench.llama_config("bamba2b")
    assert type(cfg).__name__ == "BambaConfig" and cfg.num_hidden_layers == 24
    one, two = (decode_bench.streamed_bytes(cfg, b, 0) for b in (1, 2))
    conv = (2 * 2048 + 2 * 128) * 3 * 2  # bf16 channels x (taps - 1)
    assert two - one == 2 * 20 * (64 * 64 * 128 * 4 + conv)  # read + written, 20 Mamba layers
    assert 2.0e9 < (one - (two - one)) / 2 < 2.1e9  # 2.3B weights less the embedding (0.26B), bf16

    def fails(*_):
        raise RuntimeError("cache not compilable")

    args = type("Args", (), {"prefill_batch": 4, "context": 8, "steps": 1})
    row = decode_bench._prefill_row("bamba2b", "hf_static", args, fails)
    assert row.workload == "bamba2b prefill 4 x 8" and row.seconds is None and "cache not compilable" in row.note
    row = decode_bench._prefill_row("bamba2b", "autodeploy", args, lambda *_: 16.0)
    assert row.seconds == 0.016 and row.tokens_per_s == 2000


@pytest.mark.parametrize("impl", offline_bench.PEERS)
def test_hf_peers_generate_every_requested_token(impl):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(LlamaConfig(**TINY)).eval()
    seconds, ran = offline_bench.hf_offline(model, impl, input_len=6, output_len=5, num_requests=4, batch=2)
    assert ran == 4 and seconds > 0
    out = offline_bench.generate_batch(model, torch.ones(2, 3, dtype=torch.long), 7, impl, stop_after=2)
    assert out.shape == (2, 5)  # the warm-up's early stop
    with pytest.raises(ValueError, match="batches of 3"):
        offline_bench.hf_offline(model, impl, 6, 5, num_requests=4, batch=3)
    with pytest.raises(ValueError, match="unknown HF peer"):
        offline_bench.generate_batch(model, torch.ones(1, 3, dtype=torch.long), 2, "hf_turbo")


def test_hf_offline_row_halves_the_batch_until_it_fits(monkeypatch):
    tried = []

    def fake_offline(model, impl, input_len, output_len, requests, batch):
        tried.append(batch)
        if batch > 32:
            raise torch.OutOfMemoryError("CUDA out of memory")
        return 10.0, requests

    monkeypatch.setattr(offline_bench, "hf_offline", fake_offline)
    monkeypatch.setattr(offline_bench, "free_memory", lambda: None)
    row = offline_bench.hf_offline_row(None, "hf_eager", 1000, 1000, 512, "w", floor=5.0)
    assert tried == [128, 64, 32]
    assert row.note.startswith("batches of 128 ran out of memory; batches of 64 ran out of memory; batches of 32")
    assert row.seconds == 40.0 and row.tokens_per_s == 512 * 1000 / 40.0  # 128 of 512 requests run: scaled


def test_merged_table_prints_every_row_with_its_roofline_share(tmp_path, capsys, monkeypatch):
    parts = [
        [table.TableRow("decode", "llama8b batch 1", "autodeploy engine", 0.004, 250.0, 0.0036, "x")],
        [table.TableRow("offline", "llama8b 128/128 x 512", "hf_static", 20.0, 3276.8, 3.0),
         table.TableRow("coldstart", "llama8b cold start to first token", "autodeploy", 40.0),
         table.TableRow("kernels", "check mixed gqa4", "triton", None, note="rel err 1e-1", passed=False)],
    ]
    paths = [str(tmp_path / f"{i}.json") for i in range(2)]
    for i, (path, rows) in enumerate(zip(paths, parts)):
        table.save(path, rows, [table.Header(**{**HEADER.__dict__, "sections": f"part {i}"})])
    assert _main(monkeypatch, "--merge", *paths, "--json", str(tmp_path / "all.json")) == 1  # a check failed
    out = capsys.readouterr().out
    assert "sections part 0" in out and "sections part 1" in out and "4.18 TB/s" in out and "abc1234" in out
    lines = {line.split()[1]: line for line in out.splitlines() if line.startswith(("llama8b", "check"))}
    assert "4.000 ms" in lines["batch"] and "90%" in lines["batch"] and " bf16 " in lines["batch"]
    assert "20.00 s" in lines["128/128"] and "15%" in lines["128/128"]
    assert "40.00 s" in lines["cold"] and lines["cold"].split()[-2:] == ["-", "-"]
    assert "FAILED: rel err 1e-1" in lines["mixed"]
    rows, headers = table.load(str(tmp_path / "all.json"))
    assert rows == parts[0] + parts[1] and len(headers) == 2


def test_a_run_saves_its_rows_after_each_one_and_every_section_gets_the_header(tmp_path, monkeypatch, capsys):
    seen = []

    def section_rows(name):
        def rows(args, header):
            seen.append((name, header))
            yield table.TableRow(name, f"{name} workload", "autodeploy", 1.0)
            saved = json.loads((tmp_path / "run.json").read_text())
            assert [r["workload"] for r in saved["rows"]][-1] == f"{name} workload"  # saved before the next
            yield table.TableRow(name, f"{name} check", "autodeploy", None, passed=True)
        return rows

    monkeypatch.setattr(full_table, "measure_header", lambda sections: HEADER)
    for name in ("decode", "kernels"):
        monkeypatch.setattr(importlib.import_module(full_table.SECTIONS[name]), "table_rows", section_rows(name))
    assert _main(monkeypatch, "--sections", "decode,kernels", "--json", str(tmp_path / "run.json")) == 0
    assert seen == [("decode", HEADER), ("kernels", HEADER)]
    rows, headers = table.load(str(tmp_path / "run.json"))
    assert [r.workload for r in rows] == ["decode workload", "decode check", "kernels workload", "kernels check"]
    assert headers == [HEADER] and "kernels check" in capsys.readouterr().out


def test_the_header_names_the_commit_or_bench_commit_where_there_is_no_git(monkeypatch):
    assert full_table.commit().split("+")[0] == subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()

    def no_git(*args, **kwargs):
        raise OSError("git: not found")

    monkeypatch.setattr(full_table.subprocess, "run", no_git)
    assert full_table.commit() == "unknown"
    monkeypatch.setenv("BENCH_COMMIT", "abc1234")
    assert full_table.commit() == "abc1234"


@pytest.mark.parametrize("option,value", [("--impls", "autodeploy,vllm"), ("--sections", "decode,speed"),
                                          ("--weights", "bf16,int3")])
def test_unknown_names_are_refused_before_anything_runs(monkeypatch, capsys, option, value):
    monkeypatch.setattr(full_table, "measure_header", lambda sections: pytest.fail("measured"))
    with pytest.raises(SystemExit):
        _main(monkeypatch, option, value)
    assert f"unknown {option} ['{value.split(',')[1]}']" in capsys.readouterr().err


def test_dry_run_prints_every_sections_options_without_measuring(monkeypatch, capsys):
    monkeypatch.setattr(full_table, "measure_header", lambda sections: pytest.fail("measured"))
    assert _main(monkeypatch, "--dry-run", "--concurrency", "1,4", "--weights", "bf16") == 0
    out = capsys.readouterr().out
    for name, module in full_table.SECTIONS.items():
        assert f"{name} ({module}.py): " in out
    assert "concurrency=1,4" in out and "shapes=llama8b,smollm2" in out and "weights bf16" in out


def test_decode_rows_come_one_by_one_with_their_floor(monkeypatch):
    """decode_bench.table_rows yields each row as it is measured (the timed parts stubbed: they need CUDA)."""
    measured = []

    def timed(value):
        def bench(*args):
            measured.append(value)
            return value
        return bench

    def bench_hf(model, batch, context, steps, static):
        if static and batch > 1:
            raise RuntimeError("cache not compilable")
        return timed((8.0, 30.0) if static else (50.0, 0.1))()

    monkeypatch.setattr(decode_bench, "hf_model", lambda cfg: object())
    monkeypatch.setattr(decode_bench, "free_memory", lambda: None)
    monkeypatch.setattr(decode_bench, "bench_hf", bench_hf)
    pool = type("Pool", (), {"caches": [torch.empty(1, dtype=torch.bfloat16)]})()
    model = type("Model", (), {"report": type("Report", (), {"pass_table": lambda self: ""})(), "pool": pool})()
    monkeypatch.setattr(decode_bench, "compile_autodeploy", lambda *args: (model, 40.0))
    monkeypatch.setattr(decode_bench, "bench_autodeploy", timed(4.2))
    monkeypatch.setattr(decode_bench, "bench_engine", timed((4.0, 3.5)))
    args = full_table.argparse.Namespace(shapes="llama8b", batches="1,64", context=512, steps=5, set=[],
                                         impls=("autodeploy", "hf_eager", "hf_static"), prefill_batch=0,
                                         weights=[table.WEIGHT_FORMATS["bf16"]])
    rows = decode_bench.table_rows(args, HEADER)
    first = next(rows)
    assert measured == [(50.0, 0.1)] and first.impl == "hf_eager" and first.workload == "llama8b batch 1"
    rows = [first, *rows]
    assert [(r.workload.split()[-1], r.impl) for r in rows] == [
        ("1", "hf_eager"), ("1", "hf_static"), ("64", "hf_eager"), ("64", "hf_static"),
        ("1", "autodeploy bare step"), ("1", "autodeploy engine"),
        ("64", "autodeploy bare step"), ("64", "autodeploy engine")]
    assert rows[1].note == "first calls 30 s" and rows[3].seconds is None and "cache not compilable" in rows[3].note
    floor_1 = decode_bench.streamed_bytes(decode_bench.llama_config("llama8b"), 1, 512) / HEADER.bandwidth
    assert rows[5].seconds == 0.004 and math.isclose(rows[5].floor_s, floor_1) and rows[5].tokens_per_s == 250.0
    assert 3.3e-3 < floor_1 < 4.2e-3  # ~16 GB of weights at 4 TB/s
    assert {r.weights for r in rows} == {"bf16"}


def test_cold_start_rows_run_each_impl_in_a_fresh_process(monkeypatch):
    calls = []

    def fake_cold_start(shape, impl, options=None, config_dir=None):
        calls.append((shape, impl, options))
        return 12.5, "STAGES interpreter start 1.0; import 3.0 s; first token 0.4 s"

    monkeypatch.setattr(cold_start, "cold_start", fake_cold_start)
    args = full_table.argparse.Namespace(coldstart_shape="smollm2", impls=("hf_static", "autodeploy"),
                                         weights=[table.WEIGHT_FORMATS["bf16"]])
    rows = list(cold_start.table_rows(args, HEADER))
    assert calls == [("smollm2", "autodeploy", {"dtype": "bfloat16"}), ("smollm2", "hf_static", None)]
    assert [r.impl for r in rows] == ["autodeploy", "hf_static"] and rows[0].seconds == 12.5
    assert rows[0].note == "import 3.0 s; first token 0.4 s"


def test_cold_start_rejects_an_unknown_impl():
    with pytest.raises(ValueError, match="unknown impl"):
        cold_start.cold_start("smollm2", "vllm")


@pytest.mark.slow
def test_hf_static_cold_start_child_generates_its_tokens_in_a_fresh_process():
    seconds, stages = cold_start.cold_start("smollm2", "hf_static")
    assert seconds > 0 and "model built" in stages and "(2 tokens)" in stages  # the second from its decode forward


@pytest.mark.slow
def test_cold_start_from_a_relative_config_dir_imports_no_torch_in_the_parent(tmp_path, monkeypatch):
    """--config: the parent only spawns, so on a fresh machine the child is the first to import torch."""
    decode_bench.llama_config("smollm2").save_pretrained(tmp_path / "cfg")
    monkeypatch.chdir(tmp_path)  # relative to here, while the child runs inside the directory
    script = ("import sys, cold_start; seconds, stages = cold_start.cold_start('unused', 'hf_eager', None, 'cfg'); "
              "assert 'torch' not in sys.modules and 'transformers' not in sys.modules, 'parent imported them'; "
              "print(seconds, stages)")
    bench_dir = Path(cold_start.__file__).parent
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(bench_dir)})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "(1 tokens)" in proc.stdout
