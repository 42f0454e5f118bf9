"""vLLM's flags and routes: every spelling in --help, each flag doing what it does in vLLM (or a clear
error), nonsensical values refused, ``/v1/models/{id}``, ``--seed``, ``--max_logprobs``."""

from __future__ import annotations

import re

import httpx
import pytest
import yaml
from conftest import COMPILE_OPTIONS, serving

from autodeploy import SamplingParams
from autodeploy.cli import build_parser, main
from autodeploy.config import CompileConfig
from autodeploy.serve.limits import RequestLimits

VLLM_SPELLINGS = ["--max-num-seqs", "--max-model-len", "--max-num-batched-tokens", "--tensor-parallel-size", "-tp",
                  "--gpu-memory-utilization", "--kv-cache-dtype", "--enforce-eager", "--seed", "--generation-config",
                  "--override-generation-config", "--max-logprobs", "--revision", "--quantization", "-q",
                  "--served-model-name", "--block-size", "--trust-remote-code", "--dtype", "--enable-prefix-caching"]


def print_config(capsys, *argv) -> dict:
    assert main(["serve", "ckpt", "--print_config", *argv]) == 0, capsys.readouterr().err
    return yaml.safe_load(capsys.readouterr().out)


def test_help_lists_the_vllm_spellings():
    serve = build_parser()._subparsers._group_actions[0].choices["serve"].format_help()
    missing = [s for s in VLLM_SPELLINGS if not re.search(rf"(^|[\s,]){re.escape(s)}([\s,]|$)", serve, re.M)]
    assert not missing, missing


def test_vllm_flags_reach_their_settings(capsys):
    config = print_config(capsys, "--gpu-memory-utilization", "0.5", "--enforce-eager", "--seed", "7",
                          "--max-logprobs", "5", "--revision", "v1", "-q", "fp8", "--kv-cache-dtype", "auto",
                          "--served-model-name", "org/model", "short", "--generation-config", "vllm",
                          "--override-generation-config", '{"temperature": 0.5}', "--metrics-prefix", "vllm")
    assert (config["gpu_memory_utilization"], config["enforce_eager"], config["seed"]) == (0.5, True, 7)
    assert (config["limits"]["max_logprobs"], config["revision"], config["quantization"]) == (5, "v1", "fp8")
    assert config["served_model_name"] == ["org/model", "short"] and config["generation_config"] == "vllm"
    assert config["override_generation_config"] == {"temperature": 0.5} and config["metrics_prefix"] == "vllm"


@pytest.mark.parametrize("argv, message", [
    (["--max_seq_len", "0"], "max_seq_len"),
    (["--max-model-len", "-3"], "max_seq_len"),
    (["--gpu-memory-utilization", "1.5"], "gpu_memory_utilization"),
    (["--gpu-memory-utilization", "0.5", "--kv_cache_free_gpu_memory_fraction", "0.5"], "not both"),
    (["--max-logprobs", "21"], "max_logprobs"),
    (["--seed", "-1"], "seed"),
    (["--generation-config", "/no/such/dir"], "generation_config"),
    (["--metrics-prefix", "prom"], "metrics_prefix"),
    (["-q", "awq"], "quantization"),
])
def test_nonsensical_values_are_refused(capsys, argv, message):
    assert main(["serve", "ckpt", "--print_config", *argv]) == 2
    assert message in capsys.readouterr().err


def test_kv_cache_dtype_reaches_the_compile_config(capsys):
    assert print_config(capsys, "--kv-cache-dtype", "fp8")["kv_cache_dtype"] == "fp8"
    assert main(["serve", "ckpt", "--print_config", "--kv-cache-dtype", "int8"]) == 2


def test_models_route_answers_for_each_served_name(compiled, tokenizer):
    with serving(compiled, tokenizer, model_aliases=("org/tiny-model",)) as server:
        listed = httpx.get(server.url + "/v1/models").json()["data"]
        assert [m["id"] for m in listed] == ["tiny", "org/tiny-model"]
        for name in ("tiny", "org/tiny-model"):
            card = httpx.get(f"{server.url}/v1/models/{name}").json()
            assert card["id"] == name and card["object"] == "model"
        missing = httpx.get(server.url + "/v1/models/other")
        assert missing.status_code == 404
        assert missing.json()["error"] == {"message": "The model `other` does not exist.", "type": "NotFoundError",
                                           "param": "model", "code": 404}
        body = {"model": "org/tiny-model", "prompt": "Hello", "max_tokens": 2}
        reply = httpx.post(server.url + "/v1/completions", json=body, timeout=60).json()
        assert reply["model"] == "tiny"  # (vLLM answers with the first name)


def test_max_logprobs_limits_what_a_request_may_ask(compiled, tokenizer):
    with serving(compiled, tokenizer, limits=RequestLimits(max_logprobs=2)) as server:
        def completion(logprobs):
            body = {"model": "tiny", "prompt": "Hello", "max_tokens": 2, "logprobs": logprobs}
            return httpx.post(server.url + "/v1/completions", json=body, timeout=60)

        assert completion(2).status_code == 200
        refused = completion(3)
        assert refused.status_code == 400 and "--max_logprobs" in refused.json()["error"]["message"]


def test_seed_at_start_up(tiny_dir, compiled, monkeypatch):
    """--seed seeds the generator of requests without a seed (the session's model stands in for the compile)."""
    import torch

    import autodeploy.compiler
    from autodeploy.serve.startup import ServeSettings, load_model

    monkeypatch.setattr(autodeploy.compiler, "compile", lambda *_a, **_k: compiled)
    loaded = load_model(str(tiny_dir), ServeSettings(seed=7), COMPILE_OPTIONS, "url")
    engine = loaded.engine.engine
    try:
        def sample(request_id):
            engine.add_request(request_id, [1, 5, 9], SamplingParams(max_tokens=12, temperature=1.5, ignore_eos=True))
            tokens = []
            while engine.scheduler.has_work:
                tokens += [t for out in engine.step() for choice in out.outputs for t in choice.token_ids]
            return tokens

        first = sample("a")
        torch.manual_seed(7)
        assert sample("b") == first  # the engine's draws started from seed 7
        torch.manual_seed(8)
        assert sample("c") != first
    finally:
        loaded.engine.shutdown()


def test_enforce_eager_skips_the_cuda_graphs_pass():
    """Named first: on a GPU (where the other reasons do not hold) it is what leaves the graphs out."""
    from types import SimpleNamespace

    from autodeploy.passes.compile_cuda_graphs import CompileCudaGraphs
    from autodeploy.pipeline.base import PassConfig

    context = SimpleNamespace(config=CompileConfig(enforce_eager=True), device=SimpleNamespace(type="cuda"))
    assert CompileCudaGraphs(PassConfig()).apply(context).detail == "skipped: enforce_eager"


def test_gpu_memory_utilization_is_a_share_of_the_total():
    """vLLM's meaning (a share of the device's total memory for everything this process holds) next to
    TensorRT-LLM's kv_cache_free_gpu_memory_fraction (a share of what is free after the weights)."""
    from autodeploy.passes.allocate_kv_cache import kv_budget

    gib = 2**30
    memory = {"free": 60 * gib, "total": 80 * gib, "held": 16 * gib, "activations": 2 * gib}  # others hold 4 GiB
    assert kv_budget(CompileConfig(), **memory) == int(58 * gib * 0.9)
    assert kv_budget(CompileConfig(gpu_memory_utilization=0.5), **memory) == 40 * gib - 16 * gib - 2 * gib
    assert kv_budget(CompileConfig(gpu_memory_utilization=0.95), **memory) == 58 * gib  # never more than is free
    assert kv_budget(CompileConfig(gpu_memory_utilization=0.1), **memory) == 0  # the weights alone exceed it


@pytest.mark.gpu
def test_gpu_memory_utilization_bounds_the_process_on_a_gpu(tiny_dir):
    """On a GPU: with --gpu_memory_utilization 0.3 (and no CUDA graphs) this process holds at most 30% of
    the device's memory, most of it the KV pool; --enforce_eager leaves the graphs out."""
    import torch

    import autodeploy

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    total = torch.cuda.mem_get_info()[1]
    model = autodeploy.compile(tiny_dir, device="cuda", dtype="bfloat16", max_seq_len=256,
                               gpu_memory_utilization=0.3, enforce_eager=True)
    held = torch.cuda.memory_reserved()
    print(f"gpu_memory_utilization 0.3 of {total / 2**30:.1f} GiB: this process holds {held / 2**30:.2f} GiB, "
          f"{model.capacity.num_blocks} KV blocks")
    assert 0.25 * total <= held <= 0.305 * total  # (slack: the warm-up's blocks are rounded up by the allocator)
    assert model.cuda_graphs is None


@pytest.mark.parametrize("name, expected", [("half", "float16"), ("float", "float32"), ("bfloat16", "bfloat16"),
                                            ("fp16", "float16"), ("auto", "bfloat16")])
def test_dtype_takes_vllms_names(name, expected):
    import torch
    from transformers import LlamaConfig

    from autodeploy.model_loading import resolve_dtype

    assert resolve_dtype(LlamaConfig(dtype="bfloat16"), name) == getattr(torch, expected)


@pytest.mark.parametrize("name", ["int8", "nn", "float64", "fp8"])
def test_a_dtype_the_model_cannot_run_in_is_refused(name):
    from transformers import LlamaConfig

    from autodeploy.errors import ModelLoadError
    from autodeploy.model_loading import resolve_dtype

    with pytest.raises(ModelLoadError, match=f"unknown dtype '{name}'; known: auto"):
        resolve_dtype(LlamaConfig(), name)
