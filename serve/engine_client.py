"""The API process's side of an engine in its own process (``engine_process``).

:class:`EngineClient` is an :class:`~autodeploy.serve.async_engine.EngineFrontEnd` like the in-process
:class:`~autodeploy.serve.async_engine.AsyncEngine`, so the handlers, the metrics and the graceful
drain do not know which one they have. It checks each request against the bounds the engine reported
(a client error is a 400 before anything crosses), sends the request's prompt ids and
:class:`SamplingParams` (stop strings and detokenization stay here), and a receiver thread turns the
engine's step outputs into reports (``output_processor``: text, stop strings) for the streams.

A dead engine process is noticed at once (a watchdog thread waits on its sentinel): the log says
which process exited with which code, and ``/health`` and every request answer 503 from then on.
"""

from __future__ import annotations

import atexit
import dataclasses
import logging
import multiprocessing
import os
import shutil
import tempfile
import threading
import time
from multiprocessing.connection import wait
from typing import Any, Sequence

import zmq

from autodeploy.sampling_params import SamplingParams, StructuredOutput

from .async_engine import EngineDeadError, EngineFrontEnd, RequestFailedError
from .engine import EngineStats
from .engine_process import EngineAddresses, engine_main
from .engine_protocol import (AbortRequests, AddRequest, Codec, EngineFailed, EngineInfo, Event, Heartbeat, Ready,
                              Rejected, Shutdown, StartupFailed, StepOutputs, StopSequences)
from .output_processor import OutputProcessor
from .request_bounds import RequestBounds, check_request
from .structured import GrammarCompiler

log = logging.getLogger("autodeploy.serve.engine_client")

POLL_MS = 200
SEND_WAIT_MS = 1000  # a command sent before the engine's socket connected waits this long for it


class EngineProcess:
    """The engine process and the API side of its two sockets (bound here, in a private directory)."""

    def __init__(self, get_parts, start_method: str, log_level: str = "warning", timeline: str | None = None):
        """``get_parts()`` builds the engine in the new process (``start_method`` spawn: it must pickle; fork:
        it may return objects of this process, which the child inherits)."""
        self._dir = tempfile.mkdtemp(prefix="autodeploy-engine-")
        self.addresses = EngineAddresses(f"ipc://{self._dir}/commands", f"ipc://{self._dir}/events")
        context = multiprocessing.get_context(start_method)
        # not a daemon: a daemonic process may not start the tensor-parallel ranks
        self.process = context.Process(target=engine_main, name="autodeploy-engine", daemon=False,
                                       args=(self.addresses, get_parts, log_level, timeline, os.getpid(),
                                             start_method == "fork"))
        self.process.start()
        self._zmq = zmq.Context()
        self._commands = self._zmq.socket(zmq.PUSH)
        self._commands.bind(self.addresses.commands)
        self._events = self._zmq.socket(zmq.PULL)
        self._events.bind(self.addresses.events)
        self._send_lock = threading.Lock()  # the event loop and the receiver thread both send
        self._codec = Codec(Event)
        self._commands.setsockopt(zmq.SNDHWM, 0)  # requests are never dropped or blocked by a queue limit
        atexit.register(self.stop_process, 0.0)  # a live non-daemonic child would hold up this process's exit

    @property
    def pid(self) -> int:
        return self.process.pid

    def wait_ready(self, timeout: float | None = None) -> EngineInfo:
        """Wait for ``Ready`` (the engine compiled and warmed up); raise if it failed or exited first."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while deadline is None or time.monotonic() < deadline:
            for event in self.receive():
                if isinstance(event, Ready):
                    return event.info
                if isinstance(event, StartupFailed):
                    raise RuntimeError(f"the engine process failed to start: {event.message}")
            if not self.process.is_alive():
                raise RuntimeError(f"the engine process (pid {self.pid}) exited with code {self.process.exitcode} "
                                   "before it was ready; its log is above")
        raise TimeoutError(f"the engine process was not ready within {timeout} s")

    def send(self, command) -> None:
        """Queue a command for the engine. Never blocks for long: with the engine gone it is dropped (the
        watchdog fails every request then)."""
        data = self._codec.encode(command)
        with self._send_lock:
            try:
                self._commands.send(data, zmq.NOBLOCK, copy=False)
            except zmq.Again:  # no engine connected: gone, or (at start-up) not yet
                if self.process.is_alive() and self._commands.poll(SEND_WAIT_MS, zmq.POLLOUT):
                    self._commands.send(data, zmq.NOBLOCK, copy=False)

    def receive(self, timeout_ms: int = POLL_MS) -> list:
        """Every event waiting (after up to ``timeout_ms`` for the first)."""
        if not self._events.poll(timeout_ms):
            return []
        events = []
        while True:
            try:
                events.append(self._codec.decode(self._events.recv(zmq.NOBLOCK)))
            except zmq.Again:
                return events

    def stop_process(self, timeout: float = 10.0) -> None:
        """Ask the engine to shut down, wait for it, then kill it (it ignores SIGTERM: see ``engine_main``)."""
        atexit.unregister(self.stop_process)
        if self.process.is_alive():
            self.send(Shutdown())
            self.process.join(timeout)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()

    def close(self) -> None:
        """Close the sockets (no other thread may use them any more)."""
        self._commands.close(0)
        self._events.close(0)
        self._zmq.term()
        shutil.rmtree(self._dir, ignore_errors=True)


class EngineClient(EngineFrontEnd):
    """Serves streams from an engine in its own process; see the module docstring."""

    def __init__(self, process: EngineProcess, info: EngineInfo, tokenizer: Any, on_outputs=None):
        super().__init__(on_outputs)
        self.process, self.info, self.tokenizer = process, info, tokenizer
        self.bounds = RequestBounds(info.vocab_size, info.max_seq_len, info.num_blocks, info.block_size)
        self.processor = OutputProcessor(tokenizer)
        self._stats = EngineStats(0, 0, 0, 0, info.num_blocks, 0, 0, 0, 0)
        self._stopping = False
        self._grammars: GrammarCompiler | None = None  # made at the first structured request
        self._grammars_lock = threading.Lock()
        self._receiver = threading.Thread(target=self._receive, name="autodeploy-engine-client", daemon=True)
        self._receiver.start()
        threading.Thread(target=self._watch, name="autodeploy-engine-watchdog", daemon=True).start()

    @property
    def is_running(self) -> bool:
        return self.error is None and self.process.process.is_alive()

    def stats(self) -> EngineStats:
        return self._stats

    def check_request(self, prompt_token_ids: Sequence[int], params: SamplingParams) -> None:
        check_request(prompt_token_ids, params, self.bounds, self.tokenizer is not None)

    def compile_grammar(self, spec: StructuredOutput) -> None:
        """Compiled here too, against the same vocabulary and deadline as in the engine process, so that a
        grammar that cannot be compiled is a 400 before the request crosses (the engine compiles its own
        copy on its compiler thread while the prompt is prefilled)."""
        if self.tokenizer is None:
            raise ValueError("structured outputs need a tokenizer (the grammar is matched against its vocabulary)")
        with self._grammars_lock:
            if self._grammars is None:
                self._grammars = GrammarCompiler(self.tokenizer, self.info.vocab_size, self.info.eos_token_ids,
                                                 self.info.grammar_compile_timeout)
        self._grammars.compile(spec)

    def shutdown(self, timeout: float = 10.0) -> None:
        self._stopping = True
        if self._grammars is not None:
            self._grammars.close()
        self.process.stop_process(timeout)
        self._receiver.join()
        self.process.close()

    def _submit(self, request_id, prompt_token_ids, params, arrival_time) -> None:
        self.processor.add(request_id, prompt_token_ids, params)
        self.process.send(AddRequest(request_id, list(prompt_token_ids), engine_params(params),
                                     arrival_time or time.monotonic()))

    def _cancel(self, request_id: str) -> None:
        self.processor.forget(request_id)
        if not self._stopping:
            self.process.send(AbortRequests([request_id]))

    # ---- the receiver thread ----------------------------------------------------------------------

    def _receive(self) -> None:
        try:
            while not self._stopping and self.error is None:
                outputs = []
                for event in self.process.receive():
                    outputs += self._handle(event)
                if outputs:
                    self._dispatch(outputs)
        except Exception as exc:  # noqa: BLE001 (a malformed message, a bug: no request may wait forever)
            log.exception("the engine client stopped receiving; failing all requests")
            self.fail(EngineDeadError(f"the engine client failed: {exc!r}"))

    def _handle(self, event) -> list:
        if isinstance(event, StepOutputs):
            self._stats = event.stats or self._stats
            processed = self.processor.process(event.outputs)
            if processed.stops:
                self.process.send(StopSequences(processed.stops))
            if processed.aborts:
                self.process.send(AbortRequests(processed.aborts))
            return processed.outputs
        if isinstance(event, Heartbeat):
            self._stats = event.stats
        elif isinstance(event, Rejected):
            self.processor.forget(event.request_id)
            self._deliver(event.request_id, ValueError(event.message) if event.client_error
                          else RequestFailedError(event.message))
        elif isinstance(event, EngineFailed):
            log.error("the engine process (pid %d) failed: %s", self.process.pid, event.message)
            self.fail(EngineDeadError(event.message))
        return []

    def _watch(self) -> None:
        wait([self.process.process.sentinel])
        if self._stopping:
            return
        self.process.process.join(1.0)
        message = (f"the engine process (pid {self.process.pid}) exited with code {self.process.process.exitcode}; "
                   "the server cannot generate any more: restart it")
        if self.error is None:
            log.error(message)
        self.fail(EngineDeadError(message))


def engine_params(params: SamplingParams) -> SamplingParams:
    """The request as the engine process runs it: stop strings are found here, text is made here."""
    if not params.stop and not params.detokenize:
        return params
    return dataclasses.replace(params, stop=(), include_stop_str_in_output=False, detokenize=False)


def start_engine_process(model_dir: str, settings, compile_options: dict[str, Any], url: str, log_level: str):
    """``autodeploy serve`` with the engine in a spawned process: it compiles there while this process
    answers 503; returns the ``LoadedModel`` once it is ready."""
    import functools

    from .startup import LoadedModel, build_engine
    from .tokenizer import load_tokenizer

    get_parts = functools.partial(build_engine, model_dir, settings, compile_options, url)
    process = EngineProcess(get_parts, "spawn", log_level, settings.timeline)
    try:
        info = process.wait_ready()
    except BaseException:
        process.stop_process(timeout=5.0)
        process.close()
        raise
    tokenizer = load_tokenizer(settings.tokenizer or info.model_dir, settings.chat_template,
                               compile_options.get("trust_remote_code", False))
    client = EngineClient(process, info, tokenizer)
    report = f"{info.report}\nengine       in its own process (pid {info.pid}); HTTP, tokenization and " \
             "detokenization in this one"
    return LoadedModel(client, tokenizer, info.max_total_tokens, report, model_dir=info.model_dir)


def fork_engine_process(engine, tokenizer: Any, log_level: str = "warning", timeline: str | None = None) -> EngineClient:
    """An engine built in this process, moved to a forked one (CPU only: a CUDA context does not survive
    a fork). The tests serve their compiled model this way; this process must not use ``engine`` after."""
    from .startup import EngineParts

    if engine.model.device.type != "cpu":
        raise ValueError("only an engine on the CPU can be forked; 'autodeploy serve' compiles CUDA models in a "
                         "spawned engine process")
    process = EngineProcess(lambda: EngineParts(engine, ""), "fork", log_level, timeline)
    return EngineClient(process, process.wait_ready(timeout=60), tokenizer)

