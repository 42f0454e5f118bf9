"""After the server says ready nothing compiles or is captured (the watch counts every kind, and a
warmed-up server serving every sampler path counts zero), and the timeline probe records the server
at work in both processes for ``autodeploy bench timeline``."""

import asyncio
import json
import re
import types

import httpx
import torch

from autodeploy.ops.blas_choice import CHOOSER
from autodeploy.serve.compile_watch import KINDS, CompileWatch
from autodeploy.serve.timeline_report import load, render, runs
from autodeploy.serve.warmup import sampler_variants
from conftest import serving


def test_the_watch_counts_each_kind_of_compile_after_start_and_nothing_before():
    model = types.SimpleNamespace(cuda_graphs=types.SimpleNamespace(graphs={1: "captured at start-up"}))
    heard = []
    watch = CompileWatch(model, on_event=lambda kind, detail: heard.append(kind))
    torch.compile(lambda x: x * 2, backend="eager")(torch.ones(3))  # before start: not counted
    watch.start()
    try:
        torch.compile(lambda x: x + 1, backend="eager")(torch.ones(3))
        model.cuda_graphs.graphs[64] = "captured while serving"
        CHOOSER.choices["a row bucket timed while serving"] = "cublas"
        import triton

        # what Triton calls after compiling a kernel specialization at its launch
        triton.knobs.runtime.jit_post_compile_hook(key="k", repr="paged_attention[(64,)]", fn=None, compile=None,
                                                   is_manual_warmup=False, already_compiled=False)
        counts = watch.counts()
        watch.poll()
    finally:
        watch.stop()
        CHOOSER.choices.pop("a row bucket timed while serving", None)
    assert counts == {"triton": 1, "torch_compile": 1, "cuda_graph": 1, "gemm_timing": 1}
    assert sorted(heard) == sorted(KINDS)
    assert triton.knobs.runtime.jit_post_compile_hook is None  # stop() put Triton's hook back


def _compiles_after_ready(metrics: str) -> dict[str, float]:
    return {kind: float(value) for kind, value in
            re.findall(r'^autodeploy_compiles_after_ready_total{kind="(\w+)",model_name="tiny"} (\S+)$', metrics, re.M)}


def test_a_warmed_up_server_compiles_nothing_while_serving_every_sampler_path(compiled, tokenizer):
    with serving(compiled, tokenizer, engine_process=True, warm_up=True) as server:
        bodies = [{"prompt": "The quick brown fox " * n, "max_tokens": 4, "ignore_eos": True} for n in (1, 6, 24)]
        for params in sampler_variants(compiled.vocab_size):
            body = {"prompt": "Hello world", "max_tokens": params.max_tokens, "ignore_eos": True,
                    "temperature": params.temperature, "top_p": params.top_p, "min_p": params.min_p,
                    "repetition_penalty": params.repetition_penalty, "min_tokens": params.min_tokens,
                    "stop": list(params.stop), "seed": params.seed}
            if params.top_k > 0:
                body["top_k"] = params.top_k
            if params.logprobs is not None:
                body["logprobs"] = params.logprobs
            bodies.append(body)
        for body in bodies:
            response = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
            assert response.status_code == 200, response.text
        counts = _compiles_after_ready(httpx.get(server.url + "/metrics").text)
    assert counts == {kind: 0.0 for kind in KINDS}


def test_the_timeline_records_both_processes_and_its_report_reads_them(compiled, tokenizer, tmp_path):
    path = str(tmp_path / "timeline.jsonl")
    with serving(compiled, tokenizer, engine_process=True, timeline=path) as server:
        async def main():
            async with httpx.AsyncClient(timeout=60) as client:
                bodies = [{"prompt": [5 + i] * (3 + 20 * (i % 2)), "max_tokens": 12, "ignore_eos": True,
                           "stream": True} for i in range(8)]
                return await asyncio.gather(*(client.post(server.url + "/v1/completions", json=b) for b in bodies))

        assert all(r.status_code == 200 for r in asyncio.run(main()))
    events = load(path)
    steps = [e for e in events if e["event"] == "step"]
    assert {e["proc"] for e in steps} == {"engine"} and {"prefill", "decode"} <= {e["kind"] for e in steps}
    assert sum(e["out_tokens"] for e in steps) == 8 * 12
    requests = [e for e in events if e["event"] == "request"]
    assert len(requests) == 8 and all(r["proc"] == "api" and r["status"] == 200 and r["chunks"] >= 12
                                      for r in requests)
    assert sorted(e["proc"] for e in events if e["event"] == "ready") == ["api", "engine"]
    (run,) = runs(events, gap=5.0)
    assert run.output_tokens == 8 * 12 and run.requests == 8 and not run.compiles
    report = render(path, [run], events)
    assert "0 compile(s) after ready" in report and "decode" in report and "TTFB p50" in report
    json.dumps([vars(run)], default=vars)  # the --json output's content serializes
