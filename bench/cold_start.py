"""Cold start: process start to the first generated token, in a fresh process.

    python bench/cold_start.py --shape llama8b

The child builds the model from a config directory with random bf16 weights (no checkpoint to read),
compiles it with the defaults of ``autodeploy serve`` (CUDA graphs included) and generates one token.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time

CHILD = """
import json, sys, time
started = time.time()
from autodeploy import LLM, SamplingParams
imported = time.time()
llm = LLM(sys.argv[1], weights="random", dtype="bfloat16", max_seq_len=4096, **json.loads(sys.argv[2]))
built = time.time()
out = llm.generate([[1, 2, 3, 4]], SamplingParams(max_tokens=1, temperature=0))
print("FIRST_TOKEN", time.time(), out[0].outputs[0].token_ids, flush=True)
print(llm.model.report.pass_table(), flush=True)
stages = ", ".join(f"{k} {v:.1f} s" for k, v in llm.model.report.stage_seconds.items())
print(f"STAGES interpreter start {started:.3f}; import {imported - started:.1f} s; "
      f"LLM() {built - imported:.1f} s ({stages}); first token {time.time() - built:.1f} s", flush=True)
"""


def main() -> None:
    from decode_bench import llama_config

    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", default="llama8b")
    parser.add_argument("--compile-workers", type=int, default=None,
                        help="CompileConfig.compile_workers: Triton compile processes (0: threads only; "
                        "default: the runtime's)")
    args = parser.parse_args()
    options = {"compile_workers": args.compile_workers} if args.compile_workers is not None else {}
    config_dir = tempfile.mkdtemp()
    llama_config(args.shape).save_pretrained(config_dir)
    start = time.time()
    # cwd outside the repository: its source tree must not shadow the installed package
    command = [sys.executable, "-c", CHILD, config_dir, json.dumps(options)]
    proc = subprocess.run(command, capture_output=True, text=True, cwd=config_dir)
    first = [line for line in proc.stdout.splitlines() if line.startswith("FIRST_TOKEN")]
    if proc.returncode or not first:
        print(proc.stdout[-3000:], proc.stderr[-3000:])
        sys.exit(1)
    seconds = float(first[0].split()[1]) - start
    print(proc.stdout.split("\n", 1)[1] if "\n" in proc.stdout else "")
    stages = next((line for line in proc.stdout.splitlines() if line.startswith("STAGES")), "")
    if stages:  # the interpreter's own start (process spawn, site imports) before the first line ran
        started = float(stages.split()[3].rstrip(";"))
        print(f"process start to the child's first line: {started - start:.1f} s")
    print(json.dumps({"shape": args.shape, **options, "cold_start_s": round(seconds, 1)}))


if __name__ == "__main__":
    main()
