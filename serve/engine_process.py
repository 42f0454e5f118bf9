"""The engine in a process of its own: it schedules, runs steps and samples, and nothing else.

The API process (HTTP, tokenization, chat templates, detokenization, SSE) and this one share no GIL:
under load the engine's host work per step (scheduling, metadata, bookkeeping) and the API's per
token work (detokenizing, formatting and writing an SSE event per stream) no longer take turns.
They talk over two ZeroMQ sockets on Unix-domain paths (``ipc://``): commands in (add, abort, stop,
shut down), events out (ready, each step's outputs with the engine's stats, rejections, heartbeats
while idle, failure). Messages are msgpack through msgspec (``engine_protocol``).

:func:`engine_main` is the process: it builds its engine (``get_parts``: compiles in a spawned
process; a forked one takes the engine its parent built), reports ``Ready`` with the bounds the API
process checks requests against, then loops: take every command waiting (block while idle), run a
step, send its outputs. It exits when told to shut down, when its parent process is gone, or after
reporting ``EngineFailed`` when a step raises (a device fault) or a tensor-parallel rank died.
"""

from __future__ import annotations

import logging
import os
import signal
import stat
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import zmq

from .engine_protocol import (AbortRequests, AddRequest, Codec, Command, EngineFailed, EngineInfo, Heartbeat, Ready,
                              Rejected, Shutdown, StartupFailed, StepOutputs, StopSequences, to_wire)

log = logging.getLogger("autodeploy.serve.engine_process")

HEARTBEAT_SECONDS = 0.5  # while idle: stats for /metrics, and proof of life
LINGER_MS = 2000  # how long a closing socket may take to deliver what is queued


@dataclass(frozen=True)
class EngineAddresses:
    commands: str  # the API process binds, the engine process connects
    events: str


def engine_main(addresses: EngineAddresses, get_parts: Callable, log_level: str, timeline_path: str | None,
                parent_pid: int, forked: bool = False) -> None:
    """The engine process's main function (its exit code: 0 after a shutdown, 1 after a failure)."""
    if forked:
        release_inherited_sockets()
    # Ctrl-C reaches every process of the terminal's group, and some service managers signal every
    # process of the service: the API process drains first, then tells this one to shut down.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=getattr(logging, log_level.upper(), logging.WARNING),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    exit_with_parent(parent_pid)
    context = zmq.Context()
    events = context.socket(zmq.PUSH)
    events.setsockopt(zmq.LINGER, LINGER_MS)
    events.connect(addresses.events)
    commands = context.socket(zmq.PULL)
    commands.connect(addresses.commands)
    code = 1
    try:
        code = _serve(get_parts, commands, events, addresses, timeline_path)
    finally:
        commands.close(0)
        events.close()
        context.term()
        if forked:
            os._exit(code)  # a forked engine must not run its parent's exit handlers
        sys.exit(code)


def _serve(get_parts, commands, events, addresses, timeline_path) -> int:
    from .startup import start_watching_compiles
    from .timeline import open_timeline

    codec = Codec(Command)
    try:
        parts = get_parts()
        timeline = open_timeline(timeline_path, "engine")
        start_watching_compiles(parts.engine, timeline)
    except BaseException as exc:  # noqa: BLE001 (the API process reports it and exits)
        log.exception("the engine process could not start")
        events.send(codec.encode(StartupFailed(f"{type(exc).__name__}: {exc}")))
        return 1
    report = parts.report
    if parts.workers is not None:
        report = "\n".join([report, *parts.workers.attach(parts.engine.model, _failure_reporter(addresses))])
    events.send(codec.encode(Ready(engine_info(parts.engine, report))))
    if timeline is not None:
        timeline.mark_ready()
    loop = EngineLoop(parts.engine, commands, events, codec, timeline)
    try:
        return loop.run()
    finally:
        if parts.workers is not None:
            parts.workers.stop()
        if timeline is not None:
            timeline.close()


def engine_info(engine, report: str) -> EngineInfo:
    model = engine.model
    return EngineInfo(os.getpid(), str(model.model_dir or ""), model.vocab_size, model.max_seq_len,
                      engine.max_total_tokens, engine.blocks.num_blocks, engine.blocks.block_size, report,
                      sorted(engine.eos_token_ids), engine.config.grammar_compile_timeout)


class EngineLoop:
    """Commands in, steps, outputs out; see the module docstring."""

    def __init__(self, engine, commands, events, codec: Codec, timeline=None):
        self.engine, self.commands, self.events, self.codec = engine, commands, events, codec
        self.step = timeline.step_recorder(engine) if timeline is not None else engine.step
        self._outputs: list = []
        self._stop = False
        self._poller = zmq.Poller()
        self._poller.register(commands, zmq.POLLIN)

    def run(self) -> int:
        last_sent = time.monotonic()
        while not self._stop:
            busy = self.engine.has_unfinished_requests()
            if self._poller.poll(0 if busy else HEARTBEAT_SECONDS * 1000):
                self._take_commands()
            elif not busy and time.monotonic() - last_sent >= HEARTBEAT_SECONDS:
                self._send(Heartbeat(self.engine.stats()))
                last_sent = time.monotonic()
            if self.engine.has_unfinished_requests() and not self._stop:
                if not self._run_step():
                    return 1
            if self._outputs:
                self._send(StepOutputs([to_wire(out) for out in self._outputs], self.engine.stats()))
                self._outputs.clear()
                last_sent = time.monotonic()
        return 0

    def _run_step(self) -> bool:
        try:
            self._outputs += self.step()
        except BaseException as exc:  # noqa: BLE001 (a device fault: every request fails, the process exits)
            log.exception("the engine stopped (a device fault, or a bug outside any one request); failing all "
                          "requests")
            self._send(EngineFailed(f"{type(exc).__name__}: {exc}"))
            return False
        return True

    def _take_commands(self) -> None:
        while True:
            try:
                data = self.commands.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            self._apply(self.codec.decode(data))

    def _apply(self, command) -> None:
        engine = self.engine
        if isinstance(command, AddRequest):
            self._add(command)
        elif isinstance(command, AbortRequests):
            self._outputs += [out for rid in command.request_ids if (out := engine.abort_request(rid)) is not None]
        elif isinstance(command, StopSequences):
            self._outputs += engine.stop_sequences(command.stops)
        elif isinstance(command, Shutdown):
            self._stop = True

    def _add(self, command: AddRequest) -> None:
        try:
            self.engine.add_request(command.request_id, command.prompt_token_ids, command.params, command.arrival_time)
        except ValueError as exc:
            self._send(Rejected(command.request_id, str(exc), client_error=True))
        except Exception as exc:  # noqa: BLE001 (this request alone fails)
            log.exception("request %s could not be added", command.request_id)
            self.engine.abort_request(command.request_id)
            self._send(Rejected(command.request_id, f"the request could not be added: {exc!r}", client_error=False))

    def _send(self, event) -> None:
        self.events.send(self.codec.encode(event), copy=False)


def _failure_reporter(addresses: EngineAddresses) -> Callable[[BaseException], None]:
    """For a tensor-parallel watchdog thread: tell the API process why (on a socket of its own: sockets
    are not shared between threads), then exit (the engine's thread may be stuck in a collective)."""

    def report(exc: BaseException) -> None:
        context = zmq.Context()
        events = context.socket(zmq.PUSH)
        events.setsockopt(zmq.LINGER, LINGER_MS)
        events.connect(addresses.events)
        events.send(Codec(Command).encode(EngineFailed(str(exc))))
        events.close()
        context.term()
        os._exit(1)

    return report


def release_inherited_sockets() -> None:
    """A forked process holds a copy of every descriptor its parent had: the HTTP server's listening
    socket and its clients' connections would stay open for as long as it lives (a client would wait
    on a connection its server closed). Each becomes /dev/null (a number still taken, so a stale
    socket object that closes it later cannot close a descriptor opened since)."""
    if not os.path.isdir("/proc/self/fd"):
        return
    devnull = os.open(os.devnull, os.O_RDWR)
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        try:
            if fd != devnull and stat.S_ISSOCK(os.fstat(fd).st_mode):
                os.dup2(devnull, fd)
        except OSError:  # the listing's own descriptor, already closed
            continue
    os.close(devnull)


def exit_with_parent(parent_pid: int | None = None) -> threading.Thread:
    """A thread that ends this process when its parent (``parent_pid``, default: the parent now) is
    gone: a child left alone would wait for its next command forever."""
    parent_pid = parent_pid or os.getppid()

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(0.5)
        os._exit(3)

    thread = threading.Thread(target=watch, name="autodeploy-parent-watch", daemon=True)
    thread.start()
    return thread
