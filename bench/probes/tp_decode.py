"""Tensor parallelism on GPUs: greedy equality of TP=N with TP=1, decode ms/step, all-reduce time.

    python bench/probes/tp_decode.py --tp 2 --shape llama8b                     # 2 GPUs: the issue's table
    python bench/probes/tp_decode.py --tp 2 --shape llama8b --fast-all-reduce 1048576   # + symmetric memory
    python bench/probes/tp_decode.py --tp 2 --shape tiny --device cpu --steps 8  # the same code on the CPU (gloo)

Weights are random and seeded by parameter name, so TP=1 and every rank of TP=N hold slices of the
same model. Each configuration runs in fresh processes (rank 0 drives, the others follow its steps):

- equality (``--check-dtype``, float32 by default: random weights leave bf16 logits tied to within a
  rounding step, see ``greedy_equality.py``): 4 prompts, ``--steps`` greedy tokens each through the
  engine (async scheduling and CUDA graphs as served); TP=N must give TP=1's tokens;
- timing (bf16): the bare decode step (``decode_bench``'s: ``--context`` cached tokens, random KV, the
  sampled ids read back) and the engine's steady decode step, at each of ``--batches``;
- all-reduce per step: the step's collectives alone (2 all-reduces of [batch, hidden] per layer and
  the LM head's all-gather) replayed in one CUDA graph on every rank (eagerly on the CPU).

Prints one table; exits 1 when tokens differ. Target (issue 37): TP=2 batch 1 <= 0.6 x TP=1.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/
from decode_bench import SHAPES, decode_chunks  # noqa: E402  (after the path: bench/ is no package)

SHAPES = {**SHAPES, "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                 num_key_value_heads=2, vocab_size=256, max_position_embeddings=1024,
                                 tie_word_embeddings=False)}


def compile_rank(args, tp: int, dtype: str, max_batch: int, fast_bytes: int):
    from transformers import LlamaConfig

    from autodeploy.compiler import compile_config
    from autodeploy.config import CompileConfig, parse_set_option, set_dotted

    max_seq_len = args.context + 2 * args.steps + 64
    fields = dict(weights="random", dtype=dtype, device=args.device, tp_size=tp, max_batch_size=max_batch,
                  max_seq_len=max_seq_len, num_kv_blocks=max_batch * (-(-max_seq_len // 16)) + 1,
                  passes={"shard": {"fast_all_reduce_max_bytes": fast_bytes}})
    for item in args.set:  # e.g. passes.compile_cuda_graphs.enabled=false
        set_dotted(fields, *parse_set_option(item))
    return compile_config(LlamaConfig(**SHAPES[args.shape], dtype=dtype), CompileConfig(**fields))


def sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def bare_step_ms(model, batch: int, context: int, steps: int) -> float:
    chunks = decode_chunks(model, batch, context)
    for _ in range(3):
        model(chunks).argmax(-1).tolist()
    sync(model.device)
    start = time.perf_counter()
    for _ in range(steps):
        model(chunks).argmax(-1).tolist()
    sync(model.device)
    return (time.perf_counter() - start) / steps * 1e3


def collectives_us(model, batch: int, reps: int = 20) -> float:
    """The step's all-reduces and all-gather alone, per step (every rank runs this together)."""
    from autodeploy.distributed import current

    job, cfg = current(), model.hf_config
    x = torch.randn(batch, cfg.hidden_size, dtype=model.report.dtype, device=model.device)
    logits = torch.randn(batch, cfg.vocab_size // job.world_size, dtype=model.report.dtype, device=model.device)

    def step():
        for _ in range(2 * cfg.num_hidden_layers):
            torch.ops.autodeploy.all_reduce(x, job.group_name)
        torch.ops.autodeploy.all_gather(logits, -1, job.group_name)

    if model.device.type != "cuda":
        step()
        start = time.perf_counter()
        for _ in range(reps):
            step()
        return (time.perf_counter() - start) / reps * 1e6
    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / reps


def prompts(vocab: int) -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(vocab) for _ in range(rng.randrange(8, 64))] for _ in range(4)]


def greedy(model, steps: int) -> list[list[int]]:
    from autodeploy.sampling_params import SamplingParams
    from autodeploy.serve.llm import LLM

    llm = LLM(model, tokenizer=None, enable_prefix_caching=False)
    outs = llm.generate(prompts(model.vocab_size), SamplingParams(max_tokens=steps, temperature=0.0, ignore_eos=True))
    return [list(o.outputs[0].token_ids) for o in outs]


def run_rank(rank: int, store, args, tp: int, phase: str, fast_bytes: int):
    """One configuration on one rank: rank 0 returns its measurements, the others follow its steps."""
    from autodeploy.distributed import current, init_tensor_parallel
    from autodeploy.distributed_steps import StepPublisher, follow_steps

    if tp > 1:
        init_tensor_parallel(tp, rank, store=store, device=args.device)
    batches = [int(b) for b in args.batches.split(",")]
    dtype = args.check_dtype if phase == "check" else "bfloat16"
    model = compile_rank(args, tp, dtype, max(batches) if phase == "time" else 4, fast_bytes)
    result = {"collectives_us": {b: collectives_us(model, b) for b in batches}} if tp > 1 and phase == "time" else {}
    if rank > 0:
        follow_steps(model, current())
        return None
    if tp > 1:
        model.publisher = StepPublisher(current())
    if phase == "check":
        result["tokens"] = greedy(model, args.steps)
    else:
        from autodeploy.serve.bench import engine_decode_step_ms

        for b in batches:
            result[b] = (bare_step_ms(model, b, args.context, args.timed_steps),
                         engine_decode_step_ms(model, b, args.context - 4, args.timed_steps).ms)
    if tp > 1:
        model.publisher.stop()
    return result


def run(args, tp: int, phase: str, fast_bytes: int = 0) -> dict:
    from autodeploy.distributed_launch import run_on_ranks

    print(f"-- {phase} at TP={tp}{' + symmetric-memory all-reduce' if fast_bytes else ''}", flush=True)
    return run_on_ranks(tp, run_rank, args, tp, phase, fast_bytes, timeout_s=args.timeout)[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--shape", default="llama8b", choices=sorted(SHAPES))
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--steps", type=int, default=64, help="greedy tokens per prompt in the equality check")
    parser.add_argument("--check-dtype", default="float32")
    parser.add_argument("--batches", default="1,64")
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--timed-steps", type=int, default=20)
    parser.add_argument("--fast-all-reduce", type=int, default=0, metavar="BYTES",
                        help="also run TP=N with the symmetric-memory one-shot all-reduce up to BYTES")
    parser.add_argument("--skip", default="", help="phases to skip: check, time")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="compile setting of every configuration (dotted key), e.g. passes.warm_up.enabled=false")
    parser.add_argument("--timeout", type=float, default=540.0, help="seconds per configuration")
    args = parser.parse_args()
    configs = [(args.tp, 0)] + ([(args.tp, args.fast_all_reduce)] if args.fast_all_reduce else [])
    ok = True
    if "check" not in args.skip:
        want = run(args, 1, "check")["tokens"]
        for tp, fast in configs:
            got = run(args, tp, "check", fast)["tokens"]
            same = [next((j for j, (a, b) in enumerate(zip(g, w)) if a != b), len(w)) for g, w in zip(got, want)]
            ok &= all(s == args.steps for s in same)
            print(f"TP={tp}{' symm' if fast else ''} vs TP=1 ({args.check_dtype}): greedy tokens equal for "
                  f"{same} of {args.steps} steps per prompt", flush=True)
    if "time" not in args.skip:
        rows = {("TP=1", ""): run(args, 1, "time")}
        backend = "nccl" if args.device.startswith("cuda") else "gloo"
        rows.update({(f"TP={tp}", "symm" if fast else backend): run(args, tp, "time", fast) for tp, fast in configs})
        print(f"\n{args.shape} bf16, context {args.context}, device {args.device}")
        print(f"{'config':<12}{'batch':>6}{'bare ms/step':>14}{'engine ms/step':>16}{'collectives us/step':>21}{'vs TP=1':>9}")
        for (name, path), result in rows.items():
            for b in [int(b) for b in args.batches.split(",")]:
                bare, engine = result[b]
                coll = result.get("collectives_us", {}).get(b)
                base = rows[("TP=1", "")][b][0]
                print(f"{name + ' ' + path:<12}{b:>6}{bare:>14.3f}{engine:>16.3f}"
                      f"{'-' if coll is None else format(coll, '.1f'):>21}{bare / base:>9.2f}")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
