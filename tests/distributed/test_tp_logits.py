"""Tensor parallelism on the CPU (gloo, spawned processes): the sharded model's logits and greedy
tokens equal the single-process compiled model's, step by step (chunked prefills mixed with decodes,
16 greedy tokens per sequence)."""

import pytest
import torch
from tp_programs import max_diff, references, run_tp

from autodeploy.distributed_steps import EAGER, WHOLE_STEP
from autodeploy.tiny import make_tiny_checkpoint

STEPS = 16


def _check(results: dict, runs: dict) -> None:
    for name, (want_rows, want_tokens) in references(runs, STEPS).items():
        rows, tokens = results[name]
        assert tokens == want_tokens, name
        assert max_diff(rows, want_rows) < 1e-4, name


def _checkpoints(tmp_path, *model_types):
    return {m: str(make_tiny_checkpoint(m, tmp_path / m)) for m in model_types}


def test_llama_over_two_ranks_equals_one_process(tmp_path):
    """Also with an FP8 KV cache (each rank's pool holds its heads, quantized with the same scales), its
    steps through whole-step graphs (the CPU stand-in: the other ranks replay the shape rank 0 names)."""
    path = _checkpoints(tmp_path, "llama")["llama"]
    whole_steps = {"compile_cuda_graphs": {"mixed_graphs": True, "mixed_graphs_on_cpu": True, "piecewise_sizes": [8, 32]}}
    runs = {"llama": (path, {}), "llama fp8 kv": (path, {"kv_cache_dtype": "fp8", "passes": whole_steps})}
    results, worker_collectives = run_tp(2, runs, STEPS)
    ranks = [results["collectives"], worker_collectives]
    inputs = [torch.tensor(r["input"]) for r in ranks]
    for r in ranks:
        torch.testing.assert_close(torch.tensor(r["all_reduce"]), inputs[0] + inputs[1])
        torch.testing.assert_close(torch.tensor(r["all_gather"]), torch.cat(inputs, dim=-1))
    _check(results, runs)
    assert results["llama: steps by kind"].keys() == {EAGER}
    assert results["llama fp8 kv: steps by kind"][WHOLE_STEP] >= STEPS  # the decodes at least (no decode graphs on the CPU)


@pytest.mark.slow
def test_qwen3_gpt_neox_moe_and_fused_checkpoints_over_two_ranks(tmp_path):
    """Also: MoE split by expert; phi3 (q/k/v and gate/up stored fused: sharded per part); random
    weights (seeded by name: every rank slices the same model)."""
    paths = _checkpoints(tmp_path, "qwen3", "gpt_neox", "qwen3_moe", "phi3")
    runs = {name: (path, {}) for name, path in paths.items()}
    runs["qwen3_moe by expert"] = (paths["qwen3_moe"], {"passes": {"shard": {"moe": "expert"}}})
    runs["qwen3 random weights"] = (paths["qwen3"], {"weights": "random"})
    results = run_tp(2, runs, STEPS)[0]
    _check(results, runs)


@pytest.mark.slow
def test_llama_over_four_ranks_replicates_kv_heads(tmp_path):
    runs = {"llama": (_checkpoints(tmp_path, "llama")["llama"], {"passes": {"shard": {"lm_head": False}}})}
    results = run_tp(4, runs, STEPS)[0]
    _check(results, runs)
