"""Greedy equality on the GPU: the compiled model as served (Triton attention, fusions, CUDA graphs)
against the same model compiled with the torch reference attention backend, same random weights.

    python bench/greedy_equality.py --shape llama8b --steps 64

Both run through the engine (``LLM.generate``, temperature 0) on the same prompts. Prints the tokens
that agree and, at a divergence, the reference's margin between its top two log-probabilities
there: in bf16 two backends may only disagree where that margin is within rounding.
"""

from __future__ import annotations

import argparse
import gc
import random
import sys
import tempfile

import torch


def generate(config_dir: str, backend: str, prompts, steps: int):
    from autodeploy import LLM, SamplingParams

    llm = LLM(config_dir, tokenizer=None, weights="random", dtype="bfloat16", attention_backend=backend,
              max_seq_len=256, max_batch_size=len(prompts))
    outs = llm.generate(prompts, SamplingParams(max_tokens=steps, temperature=0.0, ignore_eos=True, logprobs=2))
    result = [(list(o.outputs[0].token_ids), list(o.outputs[0].logprobs)) for o in outs]
    del llm
    gc.collect()
    torch.cuda.empty_cache()
    return result


def main() -> None:
    from decode_bench import llama_config

    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", default="llama8b")
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--prompts", type=int, default=4)
    args = parser.parse_args()
    config_dir = tempfile.mkdtemp()
    cfg = llama_config(args.shape)
    cfg.save_pretrained(config_dir)
    rng = random.Random(0)
    prompts = [[rng.randrange(cfg.vocab_size) for _ in range(rng.randrange(8, 64))] for _ in range(args.prompts)]
    served = generate(config_dir, "triton", prompts, args.steps)
    reference = generate(config_dir, "torch", prompts, args.steps)
    equal = 0
    for i, ((got, _), (want, want_lp)) in enumerate(zip(served, reference)):
        same = next((j for j, (a, b) in enumerate(zip(got, want)) if a != b), len(want))
        equal += same == len(want)
        line = f"prompt {i} ({len(prompts[i])} tokens): {same}/{len(want)} greedy tokens equal"
        if same < len(want):
            top = want_lp[same].top
            margin = top[0][1] - top[1][1] if len(top) > 1 else float("nan")
            line += f"; first divergence at step {same}: reference top-2 log-prob margin {margin:.4f}"
        print(line, flush=True)
    print(f"{equal}/{len(prompts)} prompts identical for {args.steps} steps", flush=True)
    sys.exit(0 if equal == len(prompts) else 1)


if __name__ == "__main__":
    main()
