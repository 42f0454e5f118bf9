"""``autodeploy serve``: settings precedence, aliases, and one real start-up in a subprocess."""

import os
import signal
import subprocess
import sys
import time

import httpx
import pytest
import yaml

from autodeploy.cli import main
from conftest import wait_for_url


def print_config(capsys, *argv) -> dict:
    assert main(["serve", "ckpt", "--print_config", *argv]) == 0
    return yaml.safe_load(capsys.readouterr().out)


def test_defaults(capsys, monkeypatch):
    monkeypatch.delenv("AUTODEPLOY_API_KEY", raising=False)
    config = print_config(capsys)
    assert config["host"] == "127.0.0.1" and config["port"] == 8000 and config["served_model_name"] == ["ckpt"]
    assert config["enable_prefix_caching"] is True and config["api_key"] is None
    assert config["max_batch_size"] == 64  # CompileConfig's default


def test_precedence_defaults_env_yaml_flags_set(capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("AUTODEPLOY_API_KEY", "from-env")
    path = tmp_path / "serve.yaml"
    path.write_text(yaml.safe_dump({"max_batch_size": 8, "port": 9000, "max_num_tokens": 100, "api_key": "from-yaml",
                                    "enable_prefix_caching": False}))
    config = print_config(capsys, "--config", str(path))
    assert (config["max_batch_size"], config["port"], config["api_key"]) == (8, 9000, ["***"])
    config = print_config(capsys, "--config", str(path), "--max_batch_size", "16", "--port", "9001",
                          "--set", "max_batch_size=32", "--enable-prefix-caching")
    assert (config["max_batch_size"], config["port"], config["max_num_tokens"]) == (32, 9001, 100)
    assert config["enable_prefix_caching"] is True


def test_vllm_and_trtllm_spellings(capsys):
    config = print_config(capsys, "--max-num-seqs", "5", "--max-model-len", "77", "--max-num-batched-tokens", "99",
                          "--free_gpu_memory_fraction", "0.5", "--no-enable-prefix-caching",
                          "--served-model-name", "tiny")
    assert (config["max_batch_size"], config["max_seq_len"], config["max_num_tokens"]) == (5, 77, 99)
    assert config["kv_cache_free_gpu_memory_fraction"] == 0.5
    assert config["enable_prefix_caching"] is False and config["served_model_name"] == ["tiny"]


@pytest.mark.parametrize("argv, message", [
    (["--set", "no_such_setting=1"], "no_such_setting"),
    (["--set", "port=-5"], "port"),
    (["--tp_size", "0"], "tp_size"),
])
def test_bad_settings_are_reported(capsys, argv, message):
    assert main(["serve", "ckpt", "--print_config", *argv]) == 2
    assert message in capsys.readouterr().err


def test_serve_starts_reports_and_answers(tiny_dir):
    argv = [sys.executable, "-m", "autodeploy.cli", "serve", str(tiny_dir), "--port", "0", "--device", "cpu",
            "--dtype", "float32", "--max_seq_len", "128", "--num_kv_blocks", "64", "--served_model_name", "tiny"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        url = wait_for_url(proc)
        statuses = set()
        deadline = time.monotonic() + 150
        while time.monotonic() < deadline:
            statuses.add(status := httpx.get(url + "/health").status_code)
            if status == 200:
                break
            time.sleep(0.2)
        assert statuses >= {503, 200}  # unavailable while compiling, then ready
        body = httpx.post(url + "/v1/completions", json={"prompt": "Hello", "max_tokens": 3, "ignore_eos": True}).json()
        assert body["usage"]["completion_tokens"] == 3
    finally:
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    for line in ("model ", "compile ", "KV cache     64 blocks", "CUDA graphs  none (not on CUDA",
                 f"serving      tiny at {url}/v1"):
        assert line in out
    assert "compiling" in err and "loading weights" in err  # the progress bars


def test_report_names_the_captured_cuda_graphs():
    from types import SimpleNamespace

    from autodeploy.serve.startup import cuda_graph_line

    runner = SimpleNamespace(batch_sizes=[1, 2, 4, 64], capture_seconds=4.71)
    assert cuda_graph_line(runner) == "decode batch sizes 1, 2, 4, 64 (captured in 4.7 s)"
    assert cuda_graph_line(None).startswith("none")
    whole = SimpleNamespace(num_captures=42, token_sizes=[2, 4, 2048], capture_seconds=3.04, memory_bytes=96 * 2**20)
    assert cuda_graph_line(runner, whole_steps=whole) == (
        "decode batch sizes 1, 2, 4, 64 (captured in 4.7 s); whole steps: 42 shapes over 3 token buckets (2-2048) "
        "(captured in 3.0 s, 96 MiB)")
