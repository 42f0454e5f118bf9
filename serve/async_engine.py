"""The engine's asyncio face for the server, and the engine on a background thread behind it.

:class:`EngineFrontEnd` is what the HTTP handlers use, wherever the engine runs: here, on a thread
(:class:`AsyncEngine`), or in a process of its own (``engine_client.EngineClient``). With
:class:`AsyncEngine` one thread owns the :class:`Engine` and runs steps while there is work.
Coroutines talk to it through a command queue (add, abort) and receive their request's delta
outputs on an ``asyncio.Queue``. Leaving :meth:`EngineFrontEnd.generate` early (a cancelled task, a
closed stream, a disconnected client) aborts the request, and the engine frees its blocks before its
next step.

A request that fails in the engine (a report with ``error``) raises :class:`RequestFailedError` in
its own stream only. The thread stops only when a step raises (a device fault): then every stream
gets :class:`EngineDeadError` and ``error`` says why.
"""

from __future__ import annotations

import asyncio
import logging
import os
import queue
import threading
from dataclasses import dataclass
from typing import AsyncIterator, Callable, Sequence

from autodeploy.sampling_params import SamplingParams, StructuredOutput

from .engine import Engine, EngineStats
from .outputs import OutputAccumulator, RequestOutput

log = logging.getLogger("autodeploy.serve.async_engine")

# AUTODEPLOY_COALESCE_STREAMS=1: a stream whose reader fell behind takes the deltas queued for it as one (as vLLM's
# output collector merges what its consumer has not read), so a late event loop writes fewer SSE events instead of
# falling further behind. On the H100 (2026-12-08) the c64 runs whose API process lagged more lost throughput, ~2
# points of the engine's a ms of mean lag (docs/perf.md); off until the serving benchmark is run with it
COALESCE_STREAMS = os.environ.get("AUTODEPLOY_COALESCE_STREAMS", "0") == "1"


class EngineDeadError(RuntimeError):
    """The engine thread failed; every request in flight gets this error."""


class RequestFailedError(RuntimeError):
    """This request failed in the engine (a server-side error); the engine serves the others."""


class ServerShuttingDownError(RuntimeError):
    """The server is shutting down and the drain timeout has passed: this request was cut short."""


@dataclass(frozen=True)
class _Add:
    request_id: str
    prompt_token_ids: tuple[int, ...]
    params: SamplingParams
    arrival_time: float | None


@dataclass(frozen=True)
class _Abort:
    request_id: str


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue


class EngineFrontEnd:
    """The streams side of an engine, whichever way the engine runs: requests in, each one's outputs on
    an ``asyncio.Queue`` of the event loop that asked. Subclasses send requests and aborts to their
    engine (:meth:`_submit`, :meth:`_cancel`) and hand its outputs to :meth:`_dispatch` from any thread.
    ``on_outputs`` (if set) sees every batch of outputs, on the thread that dispatches them."""

    def __init__(self, on_outputs: Callable[[list[RequestOutput]], None] | None = None):
        self.on_outputs = on_outputs
        self._streams: dict[str, _Stream] = {}
        self.error: BaseException | None = None

    # ---- what a subclass provides -----------------------------------------------------------------

    @property
    def is_running(self) -> bool:
        raise NotImplementedError

    def stats(self) -> EngineStats:
        raise NotImplementedError

    def check_request(self, prompt_token_ids: Sequence[int], params: SamplingParams) -> None:
        """Raise ``ValueError`` if the request can never be served (reads only fixed settings)."""
        raise NotImplementedError

    def shutdown(self, timeout: float = 5.0) -> None:
        raise NotImplementedError

    def _submit(self, request_id: str, prompt_token_ids: tuple[int, ...], params: SamplingParams,
                arrival_time: float | None) -> None:
        raise NotImplementedError

    def _cancel(self, request_id: str) -> None:
        raise NotImplementedError

    # ---- streams ----------------------------------------------------------------------------------

    def compile_grammar(self, spec: StructuredOutput) -> None:
        """Compile a request's grammar, or raise ``GrammarError`` with the reason (blocking: call it from a
        worker thread)."""
        raise NotImplementedError

    async def generate(
        self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams, arrival_time: float | None = None
    ) -> AsyncIterator[RequestOutput]:
        """Delta outputs of one request until it finishes. Validation errors raise ``ValueError`` first."""
        if self.error is not None:
            raise EngineDeadError(f"the engine has stopped: {self.error}")
        self.check_request(prompt_token_ids, params)
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())
        self._streams[request_id] = stream
        self._submit(request_id, tuple(prompt_token_ids), params, arrival_time)
        finished, behind = False, None
        try:
            while not finished:
                item = behind if behind is not None else await stream.queue.get()
                behind = None
                if COALESCE_STREAMS and isinstance(item, RequestOutput):
                    item, behind = coalesce(item, stream.queue)
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                if item.error is not None:
                    raise RequestFailedError(f"the request failed in the engine ({item.error}); "
                                             "other requests are not affected")
                yield item
        finally:
            self._streams.pop(request_id, None)
            if not finished:
                self._cancel(request_id)

    def abort(self, request_id: str) -> None:
        self._cancel(request_id)

    def fail(self, exc: BaseException) -> None:
        """Stop for good: ``exc`` becomes the engine's error and every request in flight gets it. Any
        thread may call it (a watchdog does, while the engine may be stuck)."""
        if self.error is None:
            self.error = exc
        for request_id in list(self._streams):
            self._deliver(request_id, EngineDeadError(f"the engine failed: {exc!r}"))

    @property
    def num_streams(self) -> int:
        """Requests whose clients are still being served."""
        return len(self._streams)

    def end_all_streams(self, error: BaseException) -> None:
        """End every request in flight with ``error`` (their streams abort them in the engine)."""
        for request_id in list(self._streams):
            self._deliver(request_id, error)

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        if outputs:
            self._observe(outputs)
        self._deliver_all([(out.request_id, out) for out in outputs])

    def _observe(self, outputs: list[RequestOutput]) -> None:
        if self.on_outputs is None:
            return
        try:
            self.on_outputs(outputs)
        except Exception:  # noqa: BLE001 (metrics must never stop the engine)
            log.exception("the outputs observer failed; serving goes on")

    def _deliver(self, request_id: str, item) -> None:
        self._deliver_all([(request_id, item)])

    def _deliver_all(self, items: list[tuple[str, object]]) -> None:
        """Hand items to their requests' streams: one call per event loop, not one per item (each
        call_soon_threadsafe wakes the loop through its self-pipe and takes the GIL back and forth)."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, object]]] = {}
        for request_id, item in items:
            stream = self._streams.get(request_id)
            if stream is not None:
                by_loop.setdefault(stream.loop, []).append((stream.queue, item))
        for loop, queued in by_loop.items():
            loop.call_soon_threadsafe(_put_all, queued)


class AsyncEngine(EngineFrontEnd):
    """The engine on a thread of this process (``step``: how each step is run, e.g. timed by the
    timeline probe; default ``engine.step``)."""

    def __init__(self, engine: Engine, on_outputs: Callable[[list[RequestOutput]], None] | None = None,
                 step: Callable[[], list[RequestOutput]] | None = None):
        super().__init__(on_outputs)
        self.engine = engine
        self._step = step or engine.step
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="autodeploy-engine", daemon=True)
        self._thread.start()

    @property
    def is_running(self) -> bool:
        return self._thread.is_alive() and self.error is None

    def stats(self) -> EngineStats:
        return self.engine.stats()

    def check_request(self, prompt_token_ids: Sequence[int], params: SamplingParams) -> None:
        self.engine.check_request(prompt_token_ids, params)

    def compile_grammar(self, spec: StructuredOutput) -> None:
        self.engine.compile_grammar(spec)  # into the engine's own cache: its request will not compile it again

    def fail(self, exc: BaseException) -> None:
        if self.error is None:
            self.error = exc
        self._stop = True
        self._wake.set()
        super().fail(exc)

    def shutdown(self, timeout: float = 5.0) -> None:
        self._stop = True
        self._wake.set()
        self._thread.join(timeout)

    def _submit(self, request_id, prompt_token_ids, params, arrival_time) -> None:
        self._send(_Add(request_id, prompt_token_ids, params, arrival_time))

    def _cancel(self, request_id: str) -> None:
        self._send(_Abort(request_id))

    def _send(self, command) -> None:
        self._commands.put(command)
        self._wake.set()

    # ---- the engine thread ----------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while not self._stop:
                self._drain_commands()
                if not self.engine.has_unfinished_requests():
                    self._wake.wait()
                    self._wake.clear()
                    continue
                self._dispatch(self._step())
        except BaseException as exc:  # noqa: BLE001 (a failed step must reach every waiting client)
            if self.error is None:
                log.exception("the engine stopped (a device fault, or a bug outside any one request); "
                              "failing all requests")
            self.fail(exc)

    def _drain_commands(self) -> None:
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            if isinstance(command, _Add):
                self._add(command)
            else:
                aborted = self.engine.abort_request(command.request_id)
                if aborted is not None:
                    self._observe([aborted])

    def _add(self, command: _Add) -> None:
        if command.request_id not in self._streams:
            return  # its client left before the engine saw it
        try:
            self.engine.add_request(command.request_id, command.prompt_token_ids, command.params, command.arrival_time)
        except ValueError as exc:
            self._deliver(command.request_id, exc)
        except Exception as exc:  # noqa: BLE001 (this request alone fails)
            log.exception("request %s could not be added", command.request_id)
            self.engine.abort_request(command.request_id)
            self._deliver(command.request_id, RequestFailedError(f"the request could not be added: {exc!r}"))


def coalesce(first: RequestOutput, waiting: asyncio.Queue) -> tuple[RequestOutput, object | None]:
    """``first`` and the deltas queued behind it as one delta (text, tokens and logprobs joined, the last
    finish state), up to the first item that cannot join: an exception, or a report of an error (returned
    second, to be taken next)."""
    if first.finished or first.error is not None or waiting.empty():
        return first, None
    merged = OutputAccumulator(first.request_id)
    merged.add(first)
    while not merged.finished and not waiting.empty():
        item = waiting.get_nowait()
        if not isinstance(item, RequestOutput) or item.error is not None:
            return merged.result(), item
        merged.add(item)
    return merged.result(), None


def _put_all(items: list[tuple[asyncio.Queue, object]]) -> None:
    for q, item in items:
        q.put_nowait(item)
