"""Shared pieces of the completion and chat handlers: server state, request admission, SSE
framing, merging the streams of several prompts, and abort on client disconnect."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Sequence

from fastapi import Request
from pydantic import BaseModel

from autodeploy.sampling_params import SamplingParams

from .async_engine import AsyncEngine, EngineDeadError, ServerShuttingDownError
from .request_bounds import context_length_message
from .errors import OpenAIError, bad_request, error_body
from .generation_config import SamplingDefaults
from .guards import APIKeys
from .limits import RequestLimits
from .metrics import Metrics
from .outputs import OutputAccumulator, RequestOutput
from .preprocess import Preprocessor
from .structured import GrammarError
from .tools import ToolSettings

DISCONNECT_POLL_SECONDS = 0.5


@dataclass
class ServerState:
    """What the handlers share. ``engine`` stays None while the model loads (503 until then).

    ``api_key`` (one or several) and ``api_key_file`` set the accepted keys (``guards.APIKeys``);
    ``limits`` are the operator's request limits; ``sampling_defaults`` what requests that leave a sampling
    parameter unset get; ``draining`` is set on SIGTERM (503 from then on); ``tools`` and
    ``reasoning_parser`` say how chat replies are read (tool calls, reasoning).
    """

    served_model_name: str
    api_key: str | Sequence[str] | None = None
    api_key_file: str | None = None
    metrics_without_key: bool = False
    limits: RequestLimits = field(default_factory=RequestLimits)
    tools: ToolSettings = field(default_factory=ToolSettings)
    reasoning_parser: str | None = None
    metrics_prefix: str = "both"  # /metrics names: both, autodeploy or vllm
    model_aliases: tuple[str, ...] = ()  # other names requests may use for the served model
    sampling_defaults: SamplingDefaults = field(default_factory=SamplingDefaults)  # generation_config.json's
    engine: AsyncEngine | None = None
    tokenizer: Any = None
    max_model_len: int = 0
    draining: bool = False
    metrics: Metrics = field(init=False)
    keys: APIKeys = field(init=False)
    preprocess: Preprocessor | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        self.metrics = Metrics(self.served_model_name, lambda: self.engine.stats() if self.engine else None,
                               self.metrics_prefix)
        self.keys = APIKeys(self.api_key, self.api_key_file)

    def attach(self, engine: AsyncEngine, tokenizer: Any, max_model_len: int) -> None:
        """The model is loaded: start serving it."""
        engine.on_outputs = self.metrics.observe
        self.tokenizer, self.max_model_len = tokenizer, max_model_len
        self.preprocess = Preprocessor(tokenizer, self.limits, max_model_len)
        self.engine = engine

    def require_engine(self) -> AsyncEngine:
        if self.draining:
            raise OpenAIError(503, "the server is shutting down")
        if self.engine is None:
            raise OpenAIError(503, "the model is still loading; retry shortly")
        if not self.engine.is_running:
            raise OpenAIError(503, f"the engine has stopped: {self.engine.error}")
        return self.engine

    @property
    def model_names(self) -> tuple[str, ...]:
        return (self.served_model_name, *self.model_aliases)

    def check_model(self, name: str | None) -> None:
        if name and name not in self.model_names:
            raise OpenAIError(404, f"The model `{name}` does not exist.", "model")


def admit(state: ServerState, engine: AsyncEngine, prompt_ids: list[int], make_params, requested: int | None,
          prompt_param: str) -> SamplingParams:
    """Sampling params of one prompt, checked against the limits and the context; every problem is a 400."""
    state.limits.check_prompt_tokens(len(prompt_ids), state.max_model_len, prompt_param)
    if len(prompt_ids) >= state.max_model_len:
        raise bad_request(context_length_message(state.max_model_len, len(prompt_ids), requested), prompt_param)
    max_tokens = state.sampling_defaults.max_tokens_for(requested, state.max_model_len - len(prompt_ids))
    try:
        params = make_params(max_tokens)
        if state.tokenizer is None:
            params = dataclasses.replace(params, detokenize=False)
        engine.check_request(prompt_ids, params)
    except ValueError as exc:
        raise bad_request(str(exc)) from None
    state.limits.check_logprobs(params)
    return params


async def compile_grammar(state: ServerState, engine: AsyncEngine, params: SamplingParams) -> None:
    """A structured output's grammar, checked against the limits and compiled into the engine's cache
    before the request reaches the engine (off the event loop); a 400 with the grammar engine's reason."""
    if params.structured is None:
        return
    state.limits.check_grammar(params.structured)
    try:
        await asyncio.to_thread(engine.compile_grammar, params.structured)
    except GrammarError as exc:
        raise bad_request(str(exc), "response_format") from None


def sse(payload: BaseModel | dict, exclude: set[str] | None = None) -> str:
    """One server-sent event. Models serialize straight to JSON in pydantic's Rust core (a streamed
    token costs one of these: through a dict and ``json.dumps`` it took 3x longer)."""
    data = payload.model_dump_json(exclude=exclude) if isinstance(payload, BaseModel) else json.dumps(payload)
    return f"data: {data}\n\n"


SSE_DONE = "data: [DONE]\n\n"


def sse_error(exc: BaseException) -> str:
    """The error event of a stream whose status line (200) is already sent."""
    return sse(error_body(error_status(exc), str(exc)))


def error_status(exc: BaseException) -> int:
    if isinstance(exc, OpenAIError):
        return exc.status
    if isinstance(exc, (EngineDeadError, ServerShuttingDownError)):
        return 503
    return 400 if isinstance(exc, ValueError) else 500


async def merge_streams(streams: list[AsyncIterator[RequestOutput]]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Items of several streams as they come, tagged with the stream's index. Leaving early
    cancels every stream (which aborts their requests)."""
    if len(streams) == 1:
        async for item in streams[0]:
            yield 0, item
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(i: int, stream: AsyncIterator[RequestOutput]) -> None:
        try:
            async for item in stream:
                await queue.put((i, item))
        except Exception as exc:  # noqa: BLE001 (re-raised in the consumer)
            await queue.put((i, exc))
        finally:
            await queue.put((i, done))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            i, item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item
    finally:
        for task in tasks:
            task.cancel()


async def collect(streams: list[AsyncIterator[RequestOutput]], raw_request: Request) -> list[RequestOutput]:
    """Final outputs of all streams; aborts them all if the client disconnects first."""

    async def gather() -> list[RequestOutput]:
        results = [OutputAccumulator("") for _ in streams]
        async for i, out in merge_streams(streams):
            results[i].request_id = out.request_id
            results[i].add(out)
        return [r.result() for r in results]

    task = asyncio.create_task(gather())
    while True:
        done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_SECONDS)
        if done:
            return task.result()
        if await raw_request.is_disconnected():
            task.cancel()
            raise OpenAIError(499, "client disconnected")

