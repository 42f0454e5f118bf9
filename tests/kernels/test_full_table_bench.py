"""bench/full_table.py (issue 4's one-run table): its offline floor, its HF peers and its merged table, on the CPU."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import full_table  # noqa: E402
import hf_peers  # noqa: E402

TINY = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=128)


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
    flops = full_table.offline_floor_s(cfg, 8, 4, 3, flops_per_s=1.0, bytes_per_s=math.inf)
    assert flops == 2 * (layers * 3 * (8 + 4) + head * 3 * 4)
    kv_bytes = full_table.offline_floor_s(cfg, 8, 4, 3, flops_per_s=math.inf, bytes_per_s=1.0)
    per_token = cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * (64 // 4) * 2  # K and V, bf16
    assert kv_bytes == 3 * (8 + 9 + 10 + 11) * per_token


def test_offline_floor_of_the_8b_shape_puts_20k_tokens_per_s_near_its_roofline():
    """The anchors' rates: 128/128 x 512 cannot beat ~2.9 s (~23k tok/s); 1000/1000 is KV-bound."""
    from decode_bench import llama_config

    cfg = llama_config("llama8b")
    short = full_table.offline_floor_s(cfg, 128, 128, 512, 767e12, 4.18e12)
    long = full_table.offline_floor_s(cfg, 1000, 1000, 512, 767e12, 4.18e12)
    assert 2.7 < short < 3.0 and 512 * 128 / short < 24_500
    assert 40 < long < 46


@pytest.mark.parametrize("impl", hf_peers.IMPLS)
def test_hf_peers_generate_every_requested_token(impl):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(LlamaConfig(**TINY)).eval()
    seconds, ran = hf_peers.hf_offline(model, impl, input_len=6, output_len=5, num_requests=4, batch=2)
    assert ran == 4 and seconds > 0
    out = hf_peers.generate_batch(model, torch.ones(2, 3, dtype=torch.long), 7, impl, stop_after=2)
    assert out.shape == (2, 5)  # the warm-up's early stop
    with pytest.raises(ValueError, match="batches of 3"):
        hf_peers.hf_offline(model, impl, 6, 5, num_requests=4, batch=3)
    with pytest.raises(ValueError, match="unknown HF peer"):
        hf_peers.generate_batch(model, torch.ones(1, 3, dtype=torch.long), 2, "hf_turbo")


def test_cold_start_rejects_an_unknown_impl():
    import cold_start

    with pytest.raises(ValueError, match="unknown impl"):
        cold_start.cold_start("smollm2", "vllm")


def test_merged_table_prints_every_row_with_its_roofline_share(tmp_path, capsys, monkeypatch):
    header = {"date": "2026-12-05", "device": "NVIDIA H200", "torch": "2.11.0", "triton": "3.6.0",
              "transformers": "5.17.0", "sections": "decode", "bandwidth": 4.18e12, "gemm_flops": 767e12}
    parts = [
        [full_table.TableRow("decode", "llama8b batch 1", "autodeploy engine", 0.004, 250.0, 0.0036, "x")],
        [full_table.TableRow("offline", "llama8b 128/128 x 512", "hf_static", 20.0, 3276.8, 3.0),
         full_table.TableRow("coldstart", "llama8b cold start to first token", "autodeploy", 40.0)],
    ]
    paths = []
    for i, rows in enumerate(parts):
        paths.append(tmp_path / f"{i}.json")
        paths[-1].write_text(json.dumps({"header": header | {"sections": f"part {i}"},
                                         "rows": [r.__dict__ for r in rows]}))
    monkeypatch.setattr(sys, "argv", ["full_table.py", "--merge", *map(str, paths)])
    full_table.main()
    out = capsys.readouterr().out
    assert "sections part 0" in out and "sections part 1" in out and "4.18 TB/s" in out
    lines = {line.split()[1]: line for line in out.splitlines() if line.startswith("llama8b")}
    assert "4.000 ms" in lines["batch"] and "90%" in lines["batch"]
    assert "20.00 s" in lines["128/128"] and "15%" in lines["128/128"]
    assert "40.00 s" in lines["cold"] and lines["cold"].split()[-2:] == ["-", "-"]


def test_hf_offline_row_halves_the_batch_until_it_fits(monkeypatch):
    tried = []

    def fake_offline(model, impl, input_len, output_len, requests, batch):
        tried.append(batch)
        if batch > 32:
            raise torch.OutOfMemoryError("CUDA out of memory")
        return 10.0, requests

    monkeypatch.setattr(hf_peers, "hf_offline", fake_offline)
    monkeypatch.setattr(full_table, "_free", lambda: None)
    args = full_table.argparse.Namespace(hf_batch_short=512, hf_batch_long=128, hf_requests_long=128, requests=512)
    row = full_table._hf_offline(None, "hf_eager", 1000, 1000, args, "w", floor=5.0)
    assert tried == [128, 64, 32]
    assert row.note.startswith("batches of 128 ran out of memory; batches of 64 ran out of memory; batches of 32")
    assert row.seconds == 40.0 and row.tokens_per_s == 512 * 1000 / 40.0  # 128 of 512 requests run: scaled


def test_unknown_impl_is_refused_before_anything_runs(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["full_table.py", "--impls", "autodeploy,vllm"])
    with pytest.raises(SystemExit):
        full_table.main()
    assert "unknown --impls ['vllm']" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.parametrize("impl", ["hf_eager", "hf_static"])
def test_hf_cold_start_child_generates_its_tokens_in_a_fresh_process(impl):
    import cold_start

    seconds, stages = cold_start.cold_start("smollm2", impl)
    tokens = 2 if impl == "hf_static" else 1  # the static peer's second token comes from its decode forward
    assert seconds > 0 and "model built" in stages and f"({tokens} tokens)" in stages


@pytest.mark.slow
def test_cold_start_from_a_relative_config_dir_imports_no_torch_in_the_parent(tmp_path, monkeypatch):
    """--config: the parent only spawns, so on a fresh machine the child is the first to import torch."""
    import cold_start
    import decode_bench

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


def test_decode_rows_come_one_by_one_with_their_floor(monkeypatch):
    """decode_bench.run_shape yields each row as it is measured (the timed parts stubbed: they need CUDA)."""
    import decode_bench

    measured = []

    def timed(value):
        def bench(*args):
            measured.append(value)
            return value
        return bench

    monkeypatch.setattr(decode_bench, "hf_model", lambda cfg: object())
    monkeypatch.setattr(decode_bench, "bench_hf_eager", timed(50.0))
    monkeypatch.setattr(decode_bench, "bench_hf_static", timed((8.0, 30.0)))
    model = type("Model", (), {"report": type("Report", (), {"pass_table": lambda self: ""})()})()
    monkeypatch.setattr(decode_bench, "compile_autodeploy", lambda *args: (model, 40.0))
    monkeypatch.setattr(decode_bench, "bench_autodeploy", timed(4.2))
    monkeypatch.setattr(decode_bench, "bench_engine", timed((4.0, 3.5)))
    args = full_table.argparse.Namespace(shapes="llama8b", batches="1,64", static_batches="1", context=512, steps=5)
    rows = full_table.decode_rows(args, bandwidth=4e12)
    first = next(rows)
    assert measured == [50.0] and first.impl == "hf_eager" and first.workload == "llama8b batch 1"
    rows = [first, *rows]
    assert [(r.workload.split()[-1], r.impl) for r in rows] == [
        ("1", "hf_eager"), ("1", "hf_static_compile"), ("64", "hf_eager"),
        ("1", "autodeploy bare step"), ("1", "autodeploy engine"),
        ("64", "autodeploy bare step"), ("64", "autodeploy engine")]
    floor_1 = decode_bench.streamed_bytes(decode_bench.llama_config("llama8b"), 1, 512) / 4e12
    assert rows[4].seconds == 0.004 and math.isclose(rows[4].floor_s, floor_1) and rows[4].tokens_per_s == 250.0
    assert 3.3e-3 < floor_1 < 4.2e-3  # ~16 GB of weights at 4 TB/s
