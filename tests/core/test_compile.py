import re
from pathlib import Path

import pytest
import torch

import autodeploy
from autodeploy.check import run_check
from autodeploy.compiler import compile_config
from autodeploy.config import CompileConfig
from autodeploy.errors import ConfigError, ModelLoadError, PassError
from autodeploy.pipeline.runner import load_pipeline
from autodeploy.tiny import tiny_config

CPU = {"device": "cpu", "dtype": "float32", "max_seq_len": 128}


@pytest.fixture(scope="module")
def compiled(tiny_llama, tmp_path_factory):
    dump = tmp_path_factory.mktemp("dump")
    return autodeploy.compile(tiny_llama, dump_dir=str(dump), **CPU), dump


def test_report_lists_every_pass_and_canonical_ops(compiled):
    model, _ = compiled
    names = [r.name for r in model.report.passes]
    assert names[:2] == ["canonicalize_attention", "canonicalize_rope"]
    assert model.report.op_counts["paged_attention"] == 2
    counts = model.report.op_counts
    # q and k rotations of a layer fused into one rope_qk, then folded into the paged attention
    assert counts.get("rope_qk", 0) == 0 and "fuse_rope_attention" in names
    # residual adds fused into the norms, and every norm into the linear it feeds (the final one into the
    # LM head: gather_logits gathers the rows before it)
    norms = (counts["rms_norm_linear"], counts["add_rms_norm_linear"], counts.get("fused_add_rms_norm", 0))
    assert norms == (1, 4, 0)
    assert [s.num_kv_heads for s in model.pool.specs] == [2, 2]  # GQA kept: the cache holds kv heads only
    assert "match_repeat_kv=4" in model.report.pass_table()
    table = model.report.pass_table()
    assert "canonicalize_attention" in table and "match_eager_attention=2" in table
    assert set(model.report.stage_seconds) == {"build", "export", "passes"}


def test_graph_inputs_follow_the_metadata_contract(compiled):
    model, _ = compiled
    inputs = [n.name for n in model.gm.graph.find_nodes(op="placeholder")]
    assert inputs[:2] == ["input_ids", "position_ids"]
    assert {"query_lens", "context_lens", "cu_seqlens", "block_table", "slot_mapping", "logits_indices"} <= set(inputs)
    assert [i for i in inputs if i.startswith("kv_cache_")] == ["kv_cache_0", "kv_cache_1"]


def test_dumps_and_provenance(compiled):
    model, dump = compiled
    files = sorted(p.name for p in dump.iterdir())
    assert files[0] == "00_exported.txt" and any("insert_kv_cache" in f for f in files)
    provenance = {n.meta.get("autodeploy_provenance") for n in model.gm.graph.nodes}
    assert any(p and p.startswith("fuse_norm_linear") for p in provenance)  # every add+norm ends in a linear
    fused = next(dump.glob("*_fuse_add_rms_norm.txt")).read_text()
    assert "fuse_add_rms_norm" in fused.split("\n", 1)[1]
    assert any(p and p.startswith("insert_kv_cache/layer") for p in provenance)
    assert "canonicalize_rope/match_rope" in (dump / "02_canonicalize_rope.txt").read_text()


def test_logits_only_at_the_last_token_of_each_chunk(compiled):
    from autodeploy.kvcache.metadata import SequenceChunk

    model, _ = compiled
    chunks = [SequenceChunk((1, 2, 3), 0, (0,)), SequenceChunk((4, 5), 0, (1,))]
    assert tuple(model(chunks).shape) == (2, model.vocab_size)


def test_canary_passes_with_sdpa_export(tiny_llama):
    result = run_check(tiny_llama, steps=4, prompt_lens=(3, 9), attn_implementation="sdpa")
    assert result.passed, result.summary()
    assert result.tokens_compared == 8


def test_random_weights_from_config_alone():
    config = CompileConfig(weights="random", **CPU)
    model = compile_config(tiny_config("llama"), config)
    assert model.report.op_counts["paged_attention"] == 2
    with pytest.raises(ConfigError, match="weights='random'"):
        compile_config(tiny_config("llama"), CompileConfig(**CPU))


def test_missing_canonicalization_is_one_sentence_naming_layer_kind_module_and_dump(tiny_llama, monkeypatch):
    monkeypatch.delenv("AUTODEPLOY_DUMP_DIR", raising=False)
    overrides = {"canonicalize_attention": {"rules": ["match_repeat_kv"]}}
    with pytest.raises(PassError) as info:
        autodeploy.compile(tiny_llama, passes=overrides, **CPU)
    message = str(info.value)
    assert message.startswith("pass 'canonicalize_attention' failed: the attention in "
                              "model.layers.0.self_attn (LlamaAttention) (and 1 more module) is not supported: ")
    assert "not canonicalized" in message and message.count("\n") == 0 and message.endswith(".")
    dump = Path(re.search(r"the graph is dumped at (\S+)\.$", message).group(1))
    assert dump.is_file() and "softmax" in dump.read_text()


def test_unsupported_layer_graph_is_dumped_where_asked(tiny_llama, tmp_path):
    overrides = {"canonicalize_attention": {"rules": ["match_repeat_kv"]}}
    with pytest.raises(PassError, match=f"dumped at {tmp_path}/01_canonicalize_attention.failed.txt"):
        autodeploy.compile(tiny_llama, passes=overrides, dump_dir=str(tmp_path), **CPU)


def test_bad_inputs_are_clear_errors(tmp_path, tiny_llama):
    with pytest.raises(ModelLoadError, match="config.json not found"):
        autodeploy.compile(tmp_path)
    with pytest.raises(ConfigError, match="no_such_option"):
        autodeploy.compile(tiny_llama, no_such_option=1)


def test_pickle_weights_need_opt_in(tmp_path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(tiny_config("llama"))
    model.config.save_pretrained(tmp_path)
    torch.save(model.state_dict(), tmp_path / "pytorch_model.bin")
    with pytest.raises(ModelLoadError, match="allow_pickle"):
        autodeploy.compile(tmp_path, **CPU)
    compiled = autodeploy.compile(tmp_path, allow_pickle=True, **CPU)
    assert compiled.report.op_counts["paged_attention"] == 2
    assert torch.equal(
        compiled.gm.get_parameter("model.embed_tokens.weight"), model.model.embed_tokens.weight.detach()
    )


def test_warm_up_runs_eager_steps_and_leaves_the_model_exact(tiny_llama):
    from autodeploy.passes.warm_up import warm_up_steps

    model = autodeploy.compile(tiny_llama, passes={"warm_up": {"on_cpu": True}}, **CPU)
    record = next(r for r in model.report.passes if r.name == "warm_up")
    assert record.matches == 5 and "5 eager steps" in record.detail
    assert run_check(tiny_llama, compiled=model).passed  # the blocks it wrote are reused without harm
    small = CompileConfig(max_batch_size=4, max_num_tokens=64)
    assert len(warm_up_steps(16, 1000, small)) == 2  # steps larger than the engine's limits are left out
    assert warm_up_steps(16, 1, CompileConfig())[0] == []  # a pool too small for a step skips it


def test_warm_up_is_skipped_on_the_cpu_by_default(compiled):
    model, _ = compiled
    record = next(r for r in model.report.passes if r.name == "warm_up")
    assert record.matches == 0 and "skipped" in record.detail


@pytest.mark.parametrize("setting, threads, runs", [(3, 3, 2), (None, 6, 2), (1, 1, 1), (0, 1, 1)])
def test_warm_up_compiles_on_threads_then_runs_for_real(tiny_llama, monkeypatch, setting, threads, runs):
    """Where Triton compiles, the steps run twice: recorded (what they compile goes to the thread pool),
    then for real. compile_threads 0/1: once, each kernel compiled at its launch as before."""
    from autodeploy.passes.warm_up import WarmUp

    from autodeploy.kernels import precompile

    monkeypatch.setattr(precompile, "parallel_compile_supported", lambda device: True)  # as on a GPU
    monkeypatch.setattr(precompile, "default_threads", lambda: 6)
    pools, real_compile = [], precompile.compile_in_parallel
    def counted(run, n, pending=(), workers=None):
        pools.append(n)
        return real_compile(run, n, pending)

    monkeypatch.setattr(precompile, "compile_in_parallel", counted)
    steps, real_run = [], WarmUp._run
    monkeypatch.setattr(WarmUp, "_run", lambda self, ctx, s: steps.append(len(s)) or real_run(self, ctx, s))
    model = autodeploy.compile(tiny_llama, passes={"warm_up": {"on_cpu": True, "compile_threads": setting}}, **CPU)
    detail = next(r for r in model.report.passes if r.name == "warm_up").detail
    assert steps == [5] * runs and pools == ([threads] if threads > 1 else [])
    assert f"on {threads} threads" in detail if threads > 1 else "compiled serially" in detail
    assert run_check(tiny_llama, compiled=model, steps=2, prompt_lens=(5, 9)).passed


@pytest.mark.parametrize("setting", [3, 1])
def test_warm_up_compiles_the_kernels_the_kv_sizing_step_left_pending(tiny_llama, monkeypatch, setting):
    """What the KV sizing step recorded instead of compiling goes to the warm-up's thread pool with its own
    kernels, or is compiled first, serially, without a pool."""
    from autodeploy.kernels import precompile
    from autodeploy.passes.allocate_kv_cache import AllocateKVCache

    sentinel = object()
    real_apply = AllocateKVCache.apply

    def apply_and_leave_pending(self, ctx):
        result = real_apply(self, ctx)
        ctx.artifacts["pending_kernels"] = [sentinel]
        return result

    monkeypatch.setattr(AllocateKVCache, "apply", apply_and_leave_pending)
    monkeypatch.setattr(precompile, "parallel_compile_supported", lambda device: True)
    handed = []
    def pooled(run, n, pending=(), workers=None):
        handed.append(("pool", pending))
        return run() or len(pending)

    monkeypatch.setattr(precompile, "compile_in_parallel", pooled)
    monkeypatch.setattr(precompile, "compile_specs", lambda specs, n: handed.append(("serial", specs, n)))
    autodeploy.compile(tiny_llama, passes={"warm_up": {"on_cpu": True, "compile_threads": setting}}, **CPU)
    assert handed == ([("pool", [sentinel])] if setting > 1 else [("serial", [sentinel], 1)])


def test_compile_workers_serve_the_warm_up_and_the_captures_then_close(tiny_llama, monkeypatch):
    """compile_workers > 0: the pool starts before the export, the warm-up's compile gets it (the CUDA
    graph capture's too, on a GPU), and it is closed once the passes are done, or have failed."""
    from autodeploy.kernels import compile_workers, precompile

    class Workers:
        closed = 0

        def close(self):
            Workers.closed += 1

        def summary(self):
            return "2 kernels compiled in 3 worker processes (0.5 s)"

    started, handed, real = [], [], precompile.compile_in_parallel
    monkeypatch.setattr(compile_workers, "start_compile_workers",
                        lambda n, device: started.append((n, device.type)) or Workers())
    monkeypatch.setattr(precompile, "parallel_compile_supported", lambda device: True)
    def handing(run, n, pending=(), workers=None):
        handed.append(workers)
        return real(run, n, pending)

    monkeypatch.setattr(precompile, "compile_in_parallel", handing)
    warm_up = {"warm_up": {"on_cpu": True, "compile_threads": 2}}
    model = autodeploy.compile(tiny_llama, compile_workers=3, passes=warm_up, **CPU)
    assert started == [(3, "cpu")] and len(handed) == 1 and isinstance(handed[0], Workers)
    detail = next(r for r in model.report.passes if r.name == "warm_up").detail
    assert "[2 kernels compiled in 3 worker processes (0.5 s) first]" in detail
    assert Workers.closed == 1 and run_check(tiny_llama, compiled=model, steps=2, prompt_lens=(5,)).passed
    bad_pass = {**warm_up, "fuse_qkv": {"nonexistent": 1}}
    with pytest.raises(ConfigError):  # raised after the export, with the pool running
        autodeploy.compile(tiny_llama, compile_workers=3, passes=bad_pass, **CPU)
    assert len(started) == 2 and Workers.closed == 2


def test_compile_workers_default_on_cuda_only(monkeypatch):
    """Unset, ``compile_workers`` starts the default pool on CUDA and nothing elsewhere; 0 turns it off."""
    from autodeploy import compiler
    from autodeploy.kernels import compile_workers

    started = []
    monkeypatch.setattr(compile_workers, "start_compile_workers", lambda n, device: started.append(n) or "pool")
    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    assert compiler._start_compile_workers(CompileConfig(), cuda) == "pool" and started == [None]
    assert compiler._start_compile_workers(CompileConfig(), cpu) is None
    assert compiler._start_compile_workers(CompileConfig(compile_workers=0), cuda) is None
    assert started == [None]


def test_warm_up_compile_threads_are_validated():
    with pytest.raises(ConfigError, match="config of pass 'warm_up'.*compile_threads"):
        load_pipeline(overrides={"warm_up": {"compile_threads": -1}})
    with pytest.raises(ConfigError, match="config of pass 'warm_up'.*compile_thread"):
        load_pipeline(overrides={"warm_up": {"compile_thread": 8}})


def test_warm_up_launches_the_triton_attention_variants(tiny_llama):
    model = autodeploy.compile(tiny_llama, passes={"warm_up": {"on_cpu": True}}, attention_backend="triton",
                               max_batch_size=4, max_num_tokens=32, **CPU)
    detail = next(r for r in model.report.passes if r.name == "warm_up").detail
    variants = int(detail.split(" attention launch variants")[0].rsplit(" ", 1)[-1])
    assert variants >= 2  # decode-like and prefill-like launches at least
    assert run_check(tiny_llama, compiled=model, steps=2, prompt_lens=(5, 9), chunk_size=4).passed
