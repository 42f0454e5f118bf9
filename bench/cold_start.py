"""The cold-start section: process start to the first generated token in a fresh process, the model built from a
config directory with random bf16 weights (no checkpoint to read): ``autodeploy`` compiled with the defaults of
``autodeploy serve`` (CUDA graphs included), one token; ``hf_eager``, transformers' ``generate``, one token;
``hf_static``, ``generate(cache_implementation="static")``, two tokens (the second from the decode forward
transformers compiles: the compile a served HF model pays before its first decode step).

    python bench/cold_start.py --shape llama8b [--impl hf_static] [--options '{"compile_workers": 0}']
    python bench/cold_start.py --config DIR    # a fresh machine's first process: this one imports no torch
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator

from table import IMPLS, WEIGHT_FORMATS, TableRow

CHILD = """
import json, sys, time
started = time.time()
from autodeploy import LLM, SamplingParams
imported = time.time()
options = {"weights": "random", "dtype": "bfloat16", "max_seq_len": 4096, **json.loads(sys.argv[2])}
llm = LLM(sys.argv[1], **options)
built = time.time()
out = llm.generate([[1, 2, 3, 4]], SamplingParams(max_tokens=1, temperature=0))
print("FIRST_TOKEN", time.time(), out[0].outputs[0].token_ids, flush=True)
print(llm.model.report.pass_table(), flush=True)
stages = ", ".join(f"{k} {v:.1f} s" for k, v in llm.model.report.stage_seconds.items())
print(f"STAGES interpreter start {started:.3f}; import {imported - started:.1f} s; "
      f"LLM() {built - imported:.1f} s ({stages}); first token {time.time() - built:.1f} s", flush=True)
"""

CHILD_HF = """
import sys, time
started = time.time()
import torch
from transformers import AutoConfig, AutoModelForCausalLM
imported = time.time()
device = "cuda" if torch.cuda.is_available() else "cpu"  # the CPU for the bench's own tests
with torch.device(device):
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(sys.argv[1]), dtype=torch.bfloat16).eval()
built = time.time()
static = sys.argv[2] == "hf_static"
tokens = 2 if static else 1
with torch.inference_mode():
    out = model.generate(torch.tensor([[1, 2, 3, 4]], device=device), max_new_tokens=tokens, min_new_tokens=tokens,
                         do_sample=False, pad_token_id=0, cache_implementation="static" if static else None)
print("FIRST_TOKEN", time.time(), out[0, 4:].tolist(), flush=True)
print(f"STAGES interpreter start {started:.3f}; import {imported - started:.1f} s; "
      f"model built {built - imported:.1f} s; generate {time.time() - built:.1f} s ({out.shape[1] - 4} tokens)",
      flush=True)
"""


def add_options(group) -> None:
    group.add_argument("--coldstart-shape", default="llama8b", help="model shape")


def table_rows(args, header) -> Iterator[TableRow]:
    """autodeploy (once per weight format) and the HF peers, each in a fresh process."""
    runs = [("autodeploy", w) for w in args.weights if "autodeploy" in args.impls]
    runs += [(impl, WEIGHT_FORMATS["bf16"]) for impl in IMPLS[1:] if impl in args.impls]
    for impl, weights in runs:
        options = weights.settings if impl == "autodeploy" else None
        seconds, stages = cold_start(args.coldstart_shape, impl, options)
        yield TableRow("coldstart", f"{args.coldstart_shape} cold start to first token", impl, seconds,
                       note=stages.split("; ", 1)[-1], weights=weights.name)


def cold_start(shape: str, impl: str = "autodeploy", options: dict | None = None,
               config_dir: str | None = None) -> tuple[float, str]:
    """(seconds from process start to the first token, the child's STAGES line) of one fresh process.

    ``config_dir``: an HF config directory to use instead of writing ``shape``'s; then this process
    imports neither torch nor transformers, so on a fresh machine the child is the first to import them.
    """
    if impl not in IMPLS:
        raise ValueError(f"unknown impl {impl!r}; expected one of {IMPLS}")
    if config_dir is None:
        from decode_bench import llama_config

        config_dir = tempfile.mkdtemp()
        llama_config(shape).save_pretrained(config_dir)
    config_dir = os.path.abspath(config_dir)  # the child runs in it (see below)
    argument = json.dumps(options or {}) if impl == "autodeploy" else impl
    start = time.time()
    # cwd outside the repository: its source tree must not shadow the installed package
    command = [sys.executable, "-c", CHILD if impl == "autodeploy" else CHILD_HF, config_dir, argument]
    proc = subprocess.run(command, capture_output=True, text=True, cwd=config_dir)
    first = [line for line in proc.stdout.splitlines() if line.startswith("FIRST_TOKEN")]
    if proc.returncode or not first:
        raise RuntimeError(f"the {impl} child failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    seconds = float(first[0].split()[1]) - start
    print(proc.stdout.split("\n", 1)[1] if "\n" in proc.stdout else "")
    stages = next((line for line in proc.stdout.splitlines() if line.startswith("STAGES")), "")
    if stages:  # the interpreter's own start (process spawn, site imports) before the first line ran
        started = float(stages.split()[3].rstrip(";"))
        print(f"process start to the child's first line: {started - start:.1f} s")
    return seconds, stages


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="llama8b")
    parser.add_argument("--impl", default="autodeploy", choices=IMPLS)
    parser.add_argument("--options", type=json.loads, default={},
                        help="autodeploy's LLM options as JSON (CompileConfig fields): '{\"early_compiles\": false}'")
    parser.add_argument("--config", default=None, metavar="DIR",
                        help="an HF config directory (instead of --shape's): this process then imports no torch, so on "
                        "a fresh machine the child is the first process to import it")
    args = parser.parse_args()
    try:
        seconds, _ = cold_start(args.shape, args.impl, args.options, args.config)
    except RuntimeError as error:
        sys.exit(str(error))
    model = {"config": args.config} if args.config else {"shape": args.shape}
    print(json.dumps({**model, "impl": args.impl, **args.options, "cold_start_s": round(seconds, 1)}))


if __name__ == "__main__":
    main()
