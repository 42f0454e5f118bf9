"""Start-up of ``autodeploy serve``: bind the port, compile with progress bars, attach the engine,
print the start-up report.

The port is bound before the model loads (as trtllm-serve does), so clients get 503 instead of
"connection refused" while compiling; ``/health`` turns 200 once the engine is attached.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

from pydantic import BaseModel, ConfigDict, Field, field_validator

from .limits import RequestLimits

log = logging.getLogger("autodeploy.serve")


class ServeSettings(BaseModel):
    """Server options of ``autodeploy serve`` (compile options are validated by ``CompileConfig``)."""

    model_config = ConfigDict(extra="forbid")

    host: str = Field("127.0.0.1", description="address to bind (default: loopback only)")
    port: int = Field(8000, ge=0, le=65535, description="port to listen on")
    served_model_name: str | None = Field(None, description="model name in the API (default: the model directory)")
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

    @field_validator("api_key", mode="before")
    @classmethod
    def _one_or_more_keys(cls, value):
        return [value] if isinstance(value, str) else value

    @property
    def requires_key(self) -> bool:
        return bool(self.api_key) or self.api_key_file is not None


@dataclass(frozen=True)
class LoadedModel:
    engine: Any  # AsyncEngine
    tokenizer: Any
    max_model_len: int
    report: str
    close: Callable[[], None] = lambda: None  # after the engine stopped (tensor parallel: stops the workers)


def bind_socket(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def load_model(model_dir: str, settings: ServeSettings, compile_options: dict[str, Any], url: str) -> LoadedModel:
    """Compile (with progress bars), load the tokenizer, start the engine; returns the report."""
    from autodeploy.compiler import compile as compile_model

    from .async_engine import AsyncEngine
    from .engine import Engine, EngineConfig
    from .tokenizer import load_tokenizer

    options = dict(compile_options)
    options.setdefault("passes", {}).setdefault("load_weights", {}).setdefault("progress", True)
    start = time.perf_counter()
    workers = _start_workers(model_dir, compile_options)
    with pass_progress(options):
        model = compile_model(model_dir, **options)
    # the resolved checkpoint (a .gguf input is converted into one), not the path the user gave
    tokenizer = load_tokenizer(settings.tokenizer or model.model_dir, settings.chat_template,
                               options.get("trust_remote_code", False))
    engine = Engine(model, tokenizer, EngineConfig(enable_prefix_caching=settings.enable_prefix_caching))
    async_engine = AsyncEngine(engine)
    report = startup_report(model, engine, settings, url, time.perf_counter() - start, tokenizer)
    if workers is None:
        # the longest request the engine can hold: max_seq_len, or less when the KV pool is smaller
        return LoadedModel(async_engine, tokenizer, engine.max_total_tokens, report)
    report = "\n".join([report, *workers.attach(model, async_engine.fail)])
    return LoadedModel(async_engine, tokenizer, engine.max_total_tokens, report, workers.stop)


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
    graphs = model.cuda_graphs
    lines = [
        f"model        {model.model_dir} ({report.architecture}, {report.model_type})",
        f"dtype        {report.dtype} on {report.device}",
        "quantization " + "\n             ".join(report.quantization_lines()),
        f"compile      {seconds:.1f} s: " + ", ".join(f"{k} {v:.2f} s" for k, v in report.stage_seconds.items()),
        f"KV cache     {cap.num_blocks} blocks x {cap.block_size} tokens = {cap.num_tokens} tokens, "
        f"{cap.seqs_at_max_len} sequences at max length {cap.max_seq_len}",
        *([f"state cache  {model.pool.state.capacity().describe()}"] if model.num_state_slots else []),
        f"batching     max {engine.scheduler.max_batch_size} sequences, {engine.max_num_tokens} tokens per step; "
        f"prefix caching {'on' if engine.blocks.enable_prefix_caching else 'off'}"
        + (" (the model has recurrent state)" if model.num_state_slots else ""),
        f"CUDA graphs  {cuda_graph_line(graphs)}",
        f"tokenizer    {type(tokenizer).__name__ if tokenizer is not None else 'none (token-id prompts only)'}",
        f"serving      {settings.served_model_name} at {url}/v1" + ("  (API key required)" if settings.requires_key else ""),
    ]
    return "\n".join(lines)


def cuda_graph_line(graphs) -> str:
    if graphs is None:
        return "none (not on CUDA, or an attention backend that cannot be captured)"
    return f"decode batch sizes {', '.join(map(str, graphs.batch_sizes))} (captured in {graphs.capture_seconds:.1f} s)"


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
