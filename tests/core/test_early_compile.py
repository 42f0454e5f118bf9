"""Attention kernels guessed from the HF config and handed to the compile workers before the export."""

import json
import os
import subprocess
import sys
from concurrent.futures import Future
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from transformers import PretrainedConfig
from triton.backends.compiler import GPUTarget

import autodeploy.compiler as compiler
from autodeploy.compiler import compile_config
from autodeploy.config import CompileConfig
from autodeploy.early_compile import AttentionKind, guess_attention_kinds, guess_compiled_kinds
from autodeploy.kernels.compile_workers import CompileWorkers
from autodeploy.tiny import tiny_config
from passes.warm_up import _rotary

ROOT = Path(__file__).resolve().parents[2]
CPU_TRITON = {"device": "cpu", "weights": "random", "attention_backend": "triton", "max_seq_len": 64}


def graph_attention_kinds(gm) -> set[AttentionKind]:
    """The kinds of the compiled graph's Triton attention nodes, read as the warm-up pass reads them."""
    kinds = set()
    for node in gm.graph.find_nodes(op="call_function", target=torch.ops.autodeploy.paged_attention_triton.default):
        q, k = node.args[0].meta["val"], node.args[1].meta["val"]
        kinds.add(AttentionKind(q.shape[1], k.shape[1], q.shape[2], node.kwargs.get("sliding_window"),
                                node.kwargs.get("logit_softcap"), _rotary(node), node.kwargs.get("chunk_size"),
                                node.kwargs.get("alibi_slopes") is not None))
    return kinds


@pytest.mark.parametrize("model_type, dtype, kv", [
    ("llama", "float32", "auto"), ("llama", "bfloat16", "auto"), ("mistral", "float32", "auto"),
    ("gemma2", "float32", "auto"), ("qwen2", "float16", "auto"), ("llama", "float16", "fp8")])
def test_the_guess_covers_every_attention_kind_of_the_compiled_graph(model_type, dtype, kv):
    """(An FP8 pool: the RoPE stays a rope_qk before the attention, as fuse_rope_attention leaves it.)"""
    hf_config = tiny_config(model_type)
    config = CompileConfig(dtype=dtype, kv_cache_dtype=kv, **CPU_TRITON)
    found = graph_attention_kinds(compile_config(hf_config, config).gm)
    kv_dtype = torch.float8_e4m3fn if kv == "fp8" else getattr(torch, dtype)
    guessed = guess_compiled_kinds(hf_config, config, getattr(torch, dtype), kv_dtype)
    assert found and found <= set(guessed), (found, guessed)
    assert len(guessed) <= 2 * len(found)  # no more than one wrong guess per right one (mistral, qwen2)
    assert all(kind.rope is None for kind in guessed) == (kv == "fp8")


def test_the_guess_has_chunked_nope_and_alibi_kinds():
    """Llama-4: a chunked kind and a NoPE (full, no rotary) one; MPT's config flags ALiBi. (Their tiny
    graphs differ from the guess elsewhere: Llama-4's complex RoPE is not folded, the tiny MPT config
    carries a num_key_value_heads that MPT ignores.)"""
    llama4 = guess_attention_kinds(tiny_config("llama4_text"), torch.float16)
    assert {kind.chunk_size for kind in llama4} == {None, 8}
    assert any(kind.rope is None and kind.chunk_size is None for kind in llama4)
    mpt = guess_attention_kinds(tiny_config("mpt"), torch.float16)
    assert mpt and all(kind.alibi for kind in mpt)


def test_no_guess_without_a_head_count():
    assert guess_attention_kinds(PretrainedConfig(), torch.float16) == []


def test_no_paged_attention_guess_for_mla_models():
    assert guess_attention_kinds(tiny_config("deepseek_v3"), torch.float16) == []
    assert guess_attention_kinds(tiny_config("deepseek_v2"), torch.float16) == []


def test_a_partial_rotary_factor_sets_the_rotary_dim():
    hf_config = tiny_config("llama", head_dim=16, partial_rotary_factor=0.5)
    assert {kind.rope for kind in guess_attention_kinds(hf_config, torch.float16)} == {(8, torch.float16, False)}


def test_the_workers_get_exactly_the_kernels_the_warm_up_records_later():
    """Same JIT cache keys from the guess's two-page scratch cache as from a pool of any size: the warm-up's
    launches find their kernels in the disk cache the workers filled (an FP8 KV cache's variants too)."""
    env = {**os.environ, "TRITON_INTERPRET": "0", "PYTHONPATH": str(ROOT)}
    for args in (["llama", "float16", "float8_e4m3fn"], ["gemma2"]):
        child = subprocess.run([sys.executable, str(ROOT / "tests/kernels/early_compile_keys.py"), *args],
                               capture_output=True, text=True, env=env, timeout=300, check=False)
        assert child.returncode == 0, child.stderr[-3000:]
        keys = json.loads(child.stdout.strip().splitlines()[-1])
        assert keys["early"] and keys["early"] == keys["warm_up"]
        assert len(set(keys["early"])) == len(keys["early"])  # an FP8 pool's kernels are variants of their own


def _workers_with_jobs(monkeypatch):
    """CompileWorkers without processes whose submissions are recorded (each a pending Future)."""
    workers = CompileWorkers(0, GPUTarget("cuda", 90, 32))
    submitted = []

    def submit(path, data):
        submitted.append(data)
        return Future()

    monkeypatch.setattr(workers, "_submit", submit)
    return workers, submitted


class Spec:  # the fields of KernelSpec that CompileWorkers reads
    def __init__(self, key):
        self.kernel = SimpleNamespace(fn=SimpleNamespace(__module__="m", __name__="kernel"))
        self.key, self.data = key, f"data {key}"


def test_warm_waits_for_the_prefetched_compile_instead_of_starting_another(monkeypatch):
    workers, submitted = _workers_with_jobs(monkeypatch)
    a, b, c = Spec("a"), Spec("b"), Spec("c")
    workers.prefetch([a, b])
    jobs = workers._jobs_for([a, c], count_reused=True)
    assert submitted == ["data a", "data b", "data c"] and workers.reused == 1
    assert jobs[0] is workers._jobs[("m", "kernel", "a")]
    jobs[0].set_exception(RuntimeError("worker died"))  # a failed early compile is submitted again
    workers._jobs_for([a])
    assert submitted[-1] == "data a" and len(submitted) == 4
    assert "1 of 2 begun during the export" in workers.summary()


@pytest.mark.parametrize("early, backend, calls", [(True, "triton", 1), (False, "triton", 0), (True, "torch", 0)])
def test_compile_hands_the_guess_to_the_workers_only_where_it_can_be_used(monkeypatch, early, backend, calls):
    handed = []

    class Workers:
        def prefetch(self, specs):
            handed.append(list(specs))

        def close(self):
            pass

    monkeypatch.setattr(compiler, "_start_compile_workers", lambda config, device: Workers())
    options = {**CPU_TRITON, "attention_backend": backend, "early_compiles": early, "dtype": "float32"}
    model = compile_config(tiny_config("llama"), CompileConfig(**options))
    assert len(handed) == calls
    assert ("early_compiles" in model.report.stage_seconds) == bool(calls)
