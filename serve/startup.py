"""Start-up of ``autodeploy serve``: bind the port, compile with progress bars, attach the engine,
print the start-up report.

The port is bound before the model loads (as trtllm-serve does), so clients get 503 instead of
"connection refused" while compiling; ``/health`` turns 200 once the engine is attached.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import socket
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from .limits import RequestLimits
from .reasoning import REASONING_PARSERS
from .tool_parsers import TOOL_PARSERS
from .tools import ToolSettings

MetricsPrefix = Literal["both", "autodeploy", "vllm"]  # (serve/metrics.py's; it imports the engine)

log = logging.getLogger("autodeploy.serve")

# A mixed step of the Llama-3.1-8B shape with 512 prompt tokens next to 64 decodes computes ~576 rows of
# every GEMM: about twice the batch-64 decode step on an H100, inside the ITL p99 bound of 3x.
DEFAULT_PREFILL_TOKENS = 512
# ... and 128 once half the batch decodes: such a chunk rides on the weights the decodes stream (H100, 2026-12-07
# 22:18, bench/probes/prefill_budget.py, 8B c64 128/128: 82.7% -> 84.7% of the engine's batch-64 decode, ITL p99
# 18.0 -> 9.7 ms, TTFT p99 231-253 -> 325-363 ms)
DEFAULT_BUSY_PREFILL_TOKENS = 128


class ServeSettings(BaseModel):
    """Server options of ``autodeploy serve`` (compile options are validated by ``CompileConfig``)."""

    model_config = ConfigDict(extra="forbid")

    host: str = Field("127.0.0.1", description="address to bind (default: loopback only)")
    port: int = Field(8000, ge=0, le=65535, description="port to listen on")
    served_model_name: list[str] | None = Field(
        None, description="model names in the API, as vLLM's: the first is the one responses and /metrics give, "
        "every one is accepted in requests (default: the model as given: its directory, file or Hub id)")
    tokenizer: str | None = Field(None, description="tokenizer directory (default: the model directory)")
    chat_template: str | None = Field(None, description="chat template file or inline Jinja, replacing the model's")
    enable_prefix_caching: bool = Field(True, description="reuse KV blocks of shared prompt prefixes")
    api_key: list[str] | None = Field(None, description="require 'Authorization: Bearer KEY' on every route but "
                                      "/health (repeat the flag for several keys)")
    api_key_file: str | None = Field(None, description="file of accepted API keys, one per line (# comments); "
                                     "re-read when it changes, so keys rotate without a restart")
    metrics_without_key: bool = Field(False, description="serve /metrics without the API key")
    drain_timeout: float = Field(30.0, ge=0, description="on SIGTERM/SIGINT, seconds to let requests in flight "
                                 "finish before they are ended with an error")
    limits: RequestLimits = Field(default_factory=RequestLimits, description="request limits (each one a flag)")
    engine_process: Literal["auto", "on", "off"] = Field(
        "auto", description="run the engine (scheduler, model, sampler) in a process of its own, apart from HTTP, "
        "tokenization and detokenization, so the two do not share one GIL; auto: on for CUDA, off on the CPU")
    max_num_prefill_tokens: int = Field(
        DEFAULT_PREFILL_TOKENS, ge=0, description="most prompt tokens per engine step: long prompts are prefilled in "
        "chunks of this many next to the decodes, which keeps the time between two tokens of every other stream "
        "short; 0: prompts may take the whole --max_num_tokens budget")
    busy_prefill_tokens: int = Field(
        DEFAULT_BUSY_PREFILL_TOKENS, ge=0, description="most prompt tokens per engine step once at least half of --max_batch_size sequences "
        "decode in it: a small chunk next to many decodes rides on the weights they stream anyway; "
        "0: --max_num_prefill_tokens in every step")
    warm_up: bool | None = Field(None, description="before saying ready, run requests through the engine that meet "
                                 "every sampler path and GEMM row bucket (nothing compiles at request time); "
                                 "default: on for CUDA")
    timeline: str | None = Field(None, description="write a JSON-lines timeline of the server at work to this file "
                                 "(engine steps, compiles, allocator, event-loop lag, SSE writes, GC); "
                                 "'autodeploy bench timeline FILE' summarizes it (default: $AUTODEPLOY_TIMELINE)")
    enable_auto_tool_choice: bool = Field(False, description="let the model decide when to call tools (tool_choice "
                                          "\"auto\", the default with tools); needs --tool-call-parser")
    tool_call_parser: str | None = Field(None, description="how tool calls are read out of the model's output: "
                                         + ", ".join(TOOL_PARSERS))
    reasoning_parser: str | None = Field(None, description="return <think>...</think> as reasoning_content: "
                                         + ", ".join(REASONING_PARSERS))
    seed: int | None = Field(None, ge=0, description="seed of the engine's random numbers: requests without a "
                             "seed sample the same tokens in the same order of arrival (as vLLM's --seed)")
    generation_config: str = Field("auto", description="default sampling parameters: auto (the model's "
                                   "generation_config.json), vllm (none), or a directory holding one")
    override_generation_config: dict[str, Any] | None = Field(
        None, description='JSON of defaults over the generation config, e.g. \'{"temperature": 0.5}\'')
    metrics_prefix: MetricsPrefix = Field("both", description="/metrics names: both (autodeploy_* and vLLM's "
                                          "vllm:*, which vLLM's Grafana dashboards query), autodeploy or vllm")

    @field_validator("api_key", "served_model_name", mode="before")
    @classmethod
    def _one_or_more(cls, value):
        return [value] if isinstance(value, str) else value

    @field_validator("tool_call_parser", "reasoning_parser")
    @classmethod
    def _known_parser(cls, value, info):
        known = TOOL_PARSERS if info.field_name == "tool_call_parser" else REASONING_PARSERS
        if value is not None and value not in known:
            raise ValueError(f"unknown {info.field_name.replace('_', ' ')} '{value}'; choose one of {', '.join(known)}")
        return value

    @model_validator(mode="after")
    def _auto_tool_choice_has_a_parser(self):
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError(f"--enable-auto-tool-choice needs --tool-call-parser ({', '.join(TOOL_PARSERS)})")
        return self

    @property
    def tool_settings(self) -> ToolSettings:
        return ToolSettings(self.enable_auto_tool_choice, self.tool_call_parser)

    @field_validator("generation_config")
    @classmethod
    def _generation_config_found(cls, value: str) -> str:
        if value not in ("auto", "vllm") and not (Path(value).expanduser() / "generation_config.json").is_file():
            raise ValueError(f"'{value}' is neither auto, vllm nor a directory holding a generation_config.json")
        return value

    @property
    def requires_key(self) -> bool:
        return bool(self.api_key) or self.api_key_file is not None


@dataclass(frozen=True)
class LoadedModel:
    engine: Any  # an EngineFrontEnd: AsyncEngine (this process) or EngineClient (the engine's own process)
    tokenizer: Any
    max_model_len: int
    report: str
    close: Callable[[], None] = lambda: None  # after the engine stopped (tensor parallel: stops the workers)
    sampling_defaults: Any = None  # generation_config.SamplingDefaults (None: the API's own)
    model_dir: str = ""  # the resolved checkpoint (where its generation_config.json is)


@dataclass
class EngineParts:
    """An engine ready to serve, built in the process that will run it, and its start-up report."""

    engine: Any  # Engine
    report: str
    workers: Any = None  # TensorParallelWorkers, to attach once the engine runs and to stop at the end


def bind_socket(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def uses_engine_process(settings: ServeSettings, compile_options: dict[str, Any]) -> bool:
    """``engine_process``: on, off, or (auto) on where the model runs on CUDA."""
    if settings.engine_process != "auto":
        return settings.engine_process == "on"
    from autodeploy.compiler import resolve_device

    return resolve_device(compile_options.get("device", "auto")).type == "cuda"


def load_model(model_dir: str, settings: ServeSettings, compile_options: dict[str, Any], url: str,
               log_level: str = "warning", timeline=None) -> LoadedModel:
    """Compile (with progress bars), load the tokenizer, start the engine (here, or in its own process);
    ``timeline``: this process's (the engine process opens its own). The sampling defaults are read here,
    where requests are parsed."""
    from .generation_config import load_sampling_defaults

    if uses_engine_process(settings, compile_options):
        from .engine_client import start_engine_process

        loaded = start_engine_process(model_dir, settings, compile_options, url, log_level)
    else:
        loaded = _load_here(model_dir, settings, compile_options, url, timeline)
    defaults = load_sampling_defaults(settings.generation_config, loaded.model_dir, settings.override_generation_config)
    seed = f"; seed {settings.seed}" if settings.seed is not None else ""
    report = f"{loaded.report}\ndefaults     {defaults.describe()}{seed}"
    return dataclasses.replace(loaded, sampling_defaults=defaults, report=report)


def _load_here(model_dir: str, settings: ServeSettings, compile_options: dict[str, Any], url: str,
               timeline=None) -> LoadedModel:
    from .async_engine import AsyncEngine

    parts = build_engine(model_dir, settings, compile_options, url)
    async_engine = AsyncEngine(parts.engine, step=timeline.step_recorder(parts.engine) if timeline else None)
    report = parts.report
    if parts.workers is not None:
        report = "\n".join([report, *parts.workers.attach(parts.engine.model, async_engine.fail)])
    start_watching_compiles(parts.engine, timeline)
    # the longest request the engine can hold: max_seq_len, or less when the KV pool is smaller
    return LoadedModel(async_engine, parts.engine.tokenizer, parts.engine.max_total_tokens, report,
                       parts.workers.stop if parts.workers is not None else (lambda: None),
                       model_dir=str(parts.engine.model.model_dir or ""))


def build_engine(model_dir: str, settings: ServeSettings, compile_options: dict[str, Any], url: str) -> EngineParts:
    """Compile, load the tokenizer, build the engine and (``warm_up``) run its start-up requests."""
    from autodeploy.compiler import compile as compile_model

    import torch

    from .engine import Engine
    from .tokenizer import load_tokenizer
    from .warmup import warm_up_engine

    options = dict(compile_options)
    options.setdefault("passes", {}).setdefault("load_weights", {}).setdefault("progress", True)
    start = time.perf_counter()
    workers = _start_workers(model_dir, compile_options)
    with pass_progress(options):
        model = compile_model(model_dir, **options)
    # the resolved checkpoint (a .gguf input is converted into one), not the path the user gave
    tokenizer = load_tokenizer(settings.tokenizer or model.model_dir, settings.chat_template,
                               options.get("trust_remote_code", False))
    engine = Engine(model, tokenizer, engine_config(settings))
    warmed = ""
    if settings.warm_up if settings.warm_up is not None else model.device.type == "cuda":
        warmed = warm_up_engine(engine).summary()
    if settings.seed is not None:  # the generator of requests without their own seed (every device's)
        torch.manual_seed(settings.seed)
    report = startup_report(model, engine, settings, url, time.perf_counter() - start, tokenizer)
    return EngineParts(engine, report + (f"\nwarm-up      {warmed}" if warmed else ""), workers)


def engine_config(settings: ServeSettings):
    from .engine import EngineConfig

    return EngineConfig(enable_prefix_caching=settings.enable_prefix_caching,
                        max_num_prefill_tokens=settings.max_num_prefill_tokens or None,
                        busy_prefill_tokens=settings.busy_prefill_tokens or None,
                        grammar_compile_timeout=settings.limits.grammar_compile_timeout)


def prompt_budget_words(scheduler) -> str:
    words = f"{scheduler.max_num_prefill_tokens} of them prompt tokens"
    if scheduler.busy_prefill_tokens < scheduler.max_num_prefill_tokens:
        words += f", {scheduler.busy_prefill_tokens} once half the batch decodes"
    return words


def start_watching_compiles(engine, timeline=None) -> None:
    """The server is about to say ready: from now on every compile or capture is counted (and logged)."""
    from .compile_watch import CompileWatch

    engine.compile_watch = CompileWatch(engine.model, on_event=timeline.compile_event if timeline else None)
    engine.compile_watch.start()


def _start_workers(model_dir: str, compile_options: dict[str, Any]):
    """Tensor parallelism: ranks 1..N-1 start compiling next to this process (rank 0)."""
    if compile_options.get("tp_size", 1) == 1:
        return None
    from .tp_workers import TensorParallelWorkers

    level = logging.getLevelName(logging.getLogger().getEffectiveLevel()).lower()
    return TensorParallelWorkers.start(model_dir, compile_options, level)


def startup_report(model, engine, settings: ServeSettings, url: str, seconds: float, tokenizer) -> str:
    report = model.report
    cap = model.capacity
    lines = [
        f"model        {model.model_dir} ({report.architecture}, {report.model_type})",
        f"dtype        {report.dtype} on {report.device}",
        "quantization " + "\n             ".join(report.quantization_lines()),
        f"compile      {seconds:.1f} s: " + ", ".join(f"{k} {v:.2f} s" for k, v in report.stage_seconds.items()),
        f"KV cache     {cap.num_blocks} blocks x {cap.block_size} tokens = {cap.num_tokens} tokens, "
        f"{cap.seqs_at_max_len} sequences at max length {cap.max_seq_len} ({cap.dtype_words()})",
        *([f"state cache  {model.pool.state.capacity().describe()}"] if model.num_state_slots else []),
        f"batching     max {engine.scheduler.max_batch_size} sequences, {engine.max_num_tokens} tokens per step "
        f"({prompt_budget_words(engine.scheduler)}); "
        f"prefix caching {'on' if engine.blocks.enable_prefix_caching else 'off'}"
        + (" (the model has recurrent state)" if model.num_state_slots else ""),
        f"CUDA graphs  {cuda_graph_line(model.cuda_graphs, model.piecewise, model.mixed_graphs)}",
        f"tokenizer    {type(tokenizer).__name__ if tokenizer is not None else 'none (token-id prompts only)'}",
        f"serving      {', '.join(settings.served_model_name or ())} at {url}/v1" + ("  (API key required)" if settings.requires_key else ""),
    ]
    return "\n".join(lines)


def cuda_graph_line(graphs, piecewise=None, whole_steps=None) -> str:
    """The decode graphs, the whole-step graphs of prefill and mixed steps, and the piecewise graphs of
    the other steps, where there are any."""
    if graphs is None:
        line = "none (not on CUDA, --enforce_eager, or an attention backend that cannot be captured)"
    else:
        sizes = ", ".join(map(str, graphs.batch_sizes))
        line = f"decode batch sizes {sizes} (captured in {graphs.capture_seconds:.1f} s)"
    if whole_steps is not None:
        tokens = whole_steps.token_sizes
        line += (f"; whole steps: {whole_steps.num_captures} shapes over {len(tokens)} token buckets "
                 f"({tokens[0]}-{tokens[-1]}) (captured in {whole_steps.capture_seconds:.1f} s"
                 f"{_mib(whole_steps.memory_bytes)})")
    if piecewise is not None:
        line += (f"; piecewise: {piecewise.describe()} (captured in {piecewise.capture_seconds:.1f} s"
                 f"{_mib(piecewise.memory_bytes)})")
    return line


def _mib(nbytes: int) -> str:
    return f", {nbytes / 2**20:.0f} MiB" if nbytes else ""


@contextlib.contextmanager
def pass_progress(compile_options: dict[str, Any]):
    """A progress bar over the compile pipeline, advanced by the runner's one log line per pass."""
    from tqdm import tqdm

    from autodeploy.pipeline import load_pipeline

    try:
        total = len(load_pipeline(compile_options.get("pipeline"), compile_options.get("passes")))
    except Exception:  # noqa: BLE001 (a bad pipeline is reported by compile itself)
        total = None
    logger = logging.getLogger("autodeploy.pipeline")
    bar = tqdm(total=total, desc="compiling", unit="pass", file=sys.stderr)
    handler = _PassProgress(bar, forward_level=logging.getLogger().getEffectiveLevel())
    saved = logger.level, logger.propagate
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False  # the handler forwards what the user's log level asks for
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.setLevel(saved[0])
        logger.propagate = saved[1]
        bar.close()


class _PassProgress(logging.Handler):
    def __init__(self, bar, forward_level: int):
        super().__init__(logging.DEBUG)
        self.bar = bar
        self.forward_level = forward_level

    def emit(self, record: logging.LogRecord) -> None:
        if record.levelno == logging.INFO and record.getMessage().startswith("pass "):
            self.bar.set_postfix_str(record.getMessage().split()[1])
            self.bar.update(1)
        if record.levelno >= self.forward_level:
            logging.getLogger().handle(record)


def load_in_background(load: Callable[[], LoadedModel], on_loaded: Callable[[LoadedModel], None],
                       on_error: Callable[[BaseException], None]) -> threading.Thread:
    def run() -> None:
        try:
            on_loaded(load())
        except BaseException as exc:  # noqa: BLE001 (reported, then the server exits)
            on_error(exc)

    thread = threading.Thread(target=run, name="autodeploy-load", daemon=True)
    thread.start()
    return thread
