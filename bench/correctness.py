"""The suite's correctness section: what the GPU computes, checked before its speed is believed.

- the canary (``autodeploy check``: compiled model vs HF eager, fp32) on tiny llama, gemma2 and qwen3, and the
  Mamba-2 hybrids nemotron_h and bamba and the lightning-attention hybrid minimax (their state ops and state pool
  on CUDA), with each attention backend of ``--backends``;
- the engine with async scheduling (CUDA graphs reading the previous step's tokens on the device) against the
  engine without it: every request must generate the same tokens (greedy, seeded sampling, stop ids);
- 64-step greedy equality of the model shape as served (Triton, fusions, CUDA graphs) against the same
  random weights on the torch reference backend, through ``LLM.generate``. In float32: random weights give
  nearly flat distributions, and in bf16 two correct backends that sum in different orders part ways at
  near-ties within a few tokens (a divergence prints the reference's top-2 log-prob margin there).

Each row's time is the check's wall time.

    python bench/full_table.py --sections correctness
"""

from __future__ import annotations

import gc
import random
import tempfile
import time
from collections.abc import Iterator

import torch
from decode_bench import llama_config
from table import TableRow


def add_options(group) -> None:
    group.add_argument("--backends", default="torch,triton", help="attention backends of the canary")
    group.add_argument("--equality-shape", default="llama8b", help="model shape of the greedy equality")
    group.add_argument("--equality-steps", type=int, default=64, help="greedy steps compared")
    group.add_argument("--equality-dtype", default="float32")


def table_rows(args, header) -> Iterator[TableRow]:
    from autodeploy.check import run_check
    from autodeploy.tiny import make_tiny_checkpoint

    tmp = tempfile.mkdtemp()
    for arch in ("llama", "gemma2", "qwen3", "nemotron_h", "bamba", "minimax"):
        path = make_tiny_checkpoint(arch, f"{tmp}/{arch}")
        for backend in args.backends.split(","):
            start = time.perf_counter()
            result = run_check(path, device="cuda", attention_backend=backend)
            yield TableRow("correctness", f"tiny {arch} canary (fp32)", f"autodeploy {backend}",
                           time.perf_counter() - start, note=result.summary(), weights="fp32", passed=result.passed)
    start = time.perf_counter()
    same, total, tokens = engine_overlap_matches(make_tiny_checkpoint("llama", f"{tmp}/engine"))
    yield TableRow("correctness", "tiny llama async == sync engine", "autodeploy engine", time.perf_counter() - start,
                   note=f"{same}/{total} requests identical, {tokens} tokens", weights="fp32", passed=same == total)
    yield greedy_equality(args.equality_shape, args.equality_steps, args.equality_dtype)


def engine_overlap_matches(path) -> tuple[int, int, int]:
    """(requests with identical tokens, requests, tokens) of the engine with and without async scheduling."""
    from autodeploy.serve.engine import Engine, EngineConfig

    import autodeploy
    from autodeploy.sampling_params import SamplingParams

    model = autodeploy.compile(path, device="cuda", dtype="float32", max_batch_size=32, max_seq_len=256)
    rng = random.Random(0)
    prompts = [[rng.randrange(3, model.vocab_size) for _ in range(rng.randrange(1, 120))] for _ in range(40)]
    stops = tuple(range(3, model.vocab_size, 7))
    params = [SamplingParams(temperature=0, max_tokens=48, ignore_eos=True),
              SamplingParams(temperature=0.8, seed=3, max_tokens=40, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=64, stop_token_ids=stops, min_tokens=4)]
    tokens = {}
    for overlap in (False, True):
        engine = Engine(model, None, EngineConfig(overlap=overlap, max_num_tokens=512))
        for i, prompt in enumerate(prompts):
            engine.add_request(str(i), prompt, params[i % len(params)])
        out: dict[str, list[int]] = {}
        while engine.has_unfinished_requests():
            for o in engine.step():
                out.setdefault(o.request_id, []).extend(o.outputs[0].token_ids if o.outputs else ())
        tokens[overlap] = out
    same = sum(tokens[True][k] == tokens[False][k] for k in tokens[False])
    return same, len(prompts), sum(map(len, tokens[True].values()))


def generate(config_dir: str, backend: str, prompts, steps: int, dtype: str):
    from autodeploy import LLM, SamplingParams

    llm = LLM(config_dir, tokenizer=None, weights="random", dtype=dtype, attention_backend=backend,
              max_seq_len=256, max_batch_size=len(prompts), num_kv_blocks=len(prompts) * 16 + 8)
    outs = llm.generate(prompts, SamplingParams(max_tokens=steps, temperature=0.0, ignore_eos=True, logprobs=2))
    result = [(list(o.outputs[0].token_ids), list(o.outputs[0].logprobs)) for o in outs]
    del llm
    gc.collect()
    torch.cuda.empty_cache()
    return result


def greedy_equality(shape: str, steps: int, dtype: str, num_prompts: int = 4) -> TableRow:
    start = time.perf_counter()
    config_dir = tempfile.mkdtemp()
    cfg = llama_config(shape)
    cfg.save_pretrained(config_dir)
    rng = random.Random(0)
    prompts = [[rng.randrange(cfg.vocab_size) for _ in range(rng.randrange(8, 64))] for _ in range(num_prompts)]
    served = generate(config_dir, "triton", prompts, steps, dtype)
    reference = generate(config_dir, "torch", prompts, steps, dtype)
    equal, notes = 0, []
    for i, ((got, _), (want, want_lp)) in enumerate(zip(served, reference)):
        same = next((j for j, (a, b) in enumerate(zip(got, want)) if a != b), len(want))
        equal += same == len(want)
        if same < len(want):
            top = want_lp[same].top
            margin = top[0][1] - top[1][1] if len(top) > 1 else float("nan")
            notes.append(f"prompt {i} parts at step {same} (reference top-2 margin {margin:.4f})")
    return TableRow("correctness", f"{shape} greedy equality, {steps} steps", "autodeploy vs torch backend",
                    time.perf_counter() - start, weights={"float32": "fp32"}.get(dtype, dtype),
                    note="; ".join([f"{equal}/{num_prompts} prompts identical", *notes]), passed=equal == num_prompts)
