"""A timeline of the server at work, as JSON lines: the probe that says where a served request's time goes.

Off unless asked (``autodeploy serve --timeline FILE`` or ``AUTODEPLOY_TIMELINE=FILE``); off, nothing
of it runs: no hook, no wrapper, no callback is installed. On, each process of the server appends to
``FILE`` (one ``write`` per flush of whole lines, so the API and engine processes can share it):

- ``step``: one per engine ``step()`` call: start ``t`` (``time.monotonic()``, one clock for both
  processes), wall ``ms``, ``waited_ms`` for the device; what it launched (``kind`` decode / mixed /
  prefill / idle, ``seqs``, ``tokens``, ``prefill_tokens``) and the tokens it reported (``out_tokens``);
  ``running``/``waiting`` sequences and KV ``used_blocks``; GC pauses during it (``gc_ms``); on CUDA the
  caching allocator's deltas (``cuda_mallocs``, ``cuda_frees``, ``alloc_retries``) and ``reserved_mb``;
- ``compile``: a compile, capture or GEMM timing after ready (``compile_watch``), with its ``kind``;
- ``ready``: the server says ready (``/health`` 200 from here on);
- ``loop``: per second of the API process: event-loop lag (max, mean, over ``LAG_PROBE_SECONDS``
  probes), SSE writes (count, total and longest ``send``), GC pauses, open streams;
- ``request``: one per generation request: ``status``, time to its first body byte (``ttfb_ms``), total
  ``ms``, body ``chunks``, time spent in ``send`` (``send_ms``, ``send_max_ms``);
- ``gc``: a single GC pause of ``GC_PAUSE_MS`` or more (with its generation).

``autodeploy bench timeline FILE`` (``timeline_report``) summarizes a file.
"""

from __future__ import annotations

import asyncio
import gc
import json
import os
import threading
import time
from collections.abc import Callable
from typing import Any

ENV = "AUTODEPLOY_TIMELINE"
FLUSH_SECONDS = 0.5
LAG_PROBE_SECONDS = 0.01
GC_PAUSE_MS = 2.0
ALLOCATOR_KEYS = {"num_device_alloc": "cuda_mallocs", "num_device_free": "cuda_frees",
                  "num_alloc_retries": "alloc_retries"}


def open_timeline(path: str | None, process: str) -> Timeline | None:
    """The timeline of this process (``process``: api, engine or server), or None when it is off."""
    path = path or os.environ.get(ENV)
    return Timeline(path, process) if path else None


class Timeline:
    def __init__(self, path: str, process: str):
        self.path, self.process = path, process
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        self._lines: list[str] = []
        self._lock = threading.Lock()  # the engine thread and the event loop both emit (in-process engine)
        self._flushed = time.monotonic()
        self.sse_sends: list[float] = []  # seconds of each response write in the current second (wrap_asgi)
        self._probe: asyncio.Task | None = None  # the event-loop probe (wrap_asgi)
        self.gc = _GcPauses(self)
        self.emit("start", pid=os.getpid())

    def emit(self, event: str, **fields: Any) -> None:
        fields.setdefault("t", time.monotonic())
        line = json.dumps({"event": event, "proc": self.process, **fields}, separators=(",", ":"))
        with self._lock:
            self._lines.append(line)
        if fields["t"] - self._flushed > FLUSH_SECONDS:
            self.flush()

    def flush(self) -> None:
        with self._lock:
            lines, self._lines = self._lines, []
            self._flushed = time.monotonic()
        if lines:
            os.write(self._fd, ("\n".join(lines) + "\n").encode())

    def close(self) -> None:
        self.gc.remove()
        self.flush()
        os.close(self._fd)

    def mark_ready(self) -> None:
        self.emit("ready")
        self.flush()

    def compile_event(self, kind: str, detail: str) -> None:
        self.emit("compile", kind=kind, detail=detail)

    def step_recorder(self, engine) -> Callable[[], list]:
        """``engine.step`` with a ``step`` line per call."""
        allocator = _Allocator(engine.model.device)

        def step() -> list:
            start, waited = time.monotonic(), engine.wait_seconds
            self.gc.take()
            outputs = engine.step()
            ms = (time.monotonic() - start) * 1e3
            watch = engine.compile_watch
            if watch is not None:
                watch.poll()
            self.emit("step", t=start, ms=round(ms, 3), waited_ms=round((engine.wait_seconds - waited) * 1e3, 3),
                      **schedule_fields(engine.last_schedule), out_tokens=_reported_tokens(outputs),
                      running=len(engine.scheduler.running), waiting=len(engine.scheduler.waiting),
                      used_blocks=engine.blocks.num_used, gc_ms=round(self.gc.take(), 3), **allocator.delta())
            return outputs

        return step

    # ---- the API process ------------------------------------------------------------------------

    def wrap_asgi(self, app, streams: Callable[[], int]):
        """The app with its generation requests' response writes timed (``request`` lines), and from the
        server's start (its ASGI lifespan) the event loop probed (``loop`` lines, ``streams`` open)."""

        async def timed_app(scope, receive, send):
            if scope["type"] == "lifespan":
                self._probe = asyncio.get_running_loop().create_task(self._probe_loop(streams))
            if scope["type"] != "http" or not scope["path"].startswith("/v1/"):
                return await app(scope, receive, send)
            record = _RequestRecord(time.monotonic())

            async def timed_send(message):
                begin = time.perf_counter()
                await send(message)
                record.sent(message, time.perf_counter() - begin, self.sse_sends)

            try:
                await app(scope, receive, timed_send)
            finally:
                self.emit("request", **record.fields(scope["path"]))

        return timed_app

    async def _probe_loop(self, streams: Callable[[], int]) -> None:
        window = _Window()
        loop = asyncio.get_running_loop()
        while True:
            begin = loop.time()
            await asyncio.sleep(LAG_PROBE_SECONDS)
            window.lags.append(loop.time() - begin - LAG_PROBE_SECONDS)
            if begin - window.start >= 1.0:
                sends, self.sse_sends = self.sse_sends, []
                self.emit("loop", **window.fields(), sse_writes=len(sends), sse_send_ms=round(sum(sends) * 1e3, 3),
                          sse_send_max_ms=round(max(sends, default=0.0) * 1e3, 3), gc_ms=round(self.gc.take(), 3),
                          streams=streams())
                window = _Window()


def schedule_fields(schedule) -> dict[str, Any]:
    """What a launched :class:`~autodeploy.serve.scheduler.Schedule` was: its kind and sizes."""
    tokens = [c.num_tokens for c in schedule.chunks]
    prefill = sum(n for n in tokens if n > 1)
    decodes = sum(1 for n in tokens if n == 1)
    kind = "idle" if not tokens else "decode" if not prefill else "prefill" if not decodes else "mixed"
    return {"kind": kind, "seqs": len(tokens), "tokens": sum(tokens), "prefill_tokens": prefill}


def _reported_tokens(outputs: list) -> int:
    return sum(len(c.token_ids) for out in outputs for c in out.outputs)


class _GcPauses:
    """Python GC pauses of this process: summed until taken, and the long ones emitted as they end."""

    def __init__(self, timeline: Timeline):
        self.timeline, self._start, self._total = timeline, 0.0, 0.0
        gc.callbacks.append(self._callback)

    def _callback(self, phase: str, info: dict) -> None:
        now = time.perf_counter()
        if phase == "start":
            self._start = now
            return
        ms = (now - self._start) * 1e3
        self._total += ms
        if ms >= GC_PAUSE_MS:
            self.timeline.emit("gc", ms=round(ms, 3), generation=info.get("generation"))

    def take(self) -> float:
        total, self._total = self._total, 0.0
        return total

    def remove(self) -> None:
        if self._callback in gc.callbacks:
            gc.callbacks.remove(self._callback)


class _Allocator:
    """The CUDA caching allocator's counters since the last call (nothing on the CPU)."""

    def __init__(self, device):
        import torch

        self.device = device if device.type == "cuda" else None
        self._torch = torch
        self._last = self._read() if self.device is not None else {}

    def _read(self) -> dict[str, int]:
        stats = self._torch.cuda.memory_stats(self.device)
        values = {name: stats.get(key, 0) for key, name in ALLOCATOR_KEYS.items()}
        values["reserved_mb"] = stats.get("reserved_bytes.all.current", 0) >> 20
        return values

    def delta(self) -> dict[str, int]:
        if self.device is None:
            return {}
        now = self._read()
        delta = {name: now[name] - self._last[name] for name in ALLOCATOR_KEYS.values()}
        self._last = now
        return {**delta, "reserved_mb": now["reserved_mb"]}


class _Window:
    def __init__(self):
        self.start, self.lags = time.monotonic(), []

    def fields(self) -> dict[str, Any]:
        return {"lag_max_ms": round(max(self.lags, default=0.0) * 1e3, 3),
                "lag_mean_ms": round(sum(self.lags) / max(1, len(self.lags)) * 1e3, 3), "probes": len(self.lags)}


class _RequestRecord:
    def __init__(self, start: float):
        self.start, self.first_byte, self.status = start, None, None
        self.chunks, self.send_seconds, self.send_max = 0, 0.0, 0.0

    def sent(self, message: dict, seconds: float, window: list[float]) -> None:
        if message["type"] == "http.response.start":
            self.status = message.get("status")
            return
        if message["type"] != "http.response.body" or not message.get("body"):
            return
        self.first_byte = self.first_byte or time.monotonic()
        self.chunks += 1
        self.send_seconds += seconds
        self.send_max = max(self.send_max, seconds)
        window.append(seconds)

    def fields(self, path: str) -> dict[str, Any]:
        ttfb = (self.first_byte - self.start) * 1e3 if self.first_byte else None
        return {"t": self.start, "path": path, "status": self.status, "ttfb_ms": round(ttfb, 3) if ttfb else None,
                "ms": round((time.monotonic() - self.start) * 1e3, 3), "chunks": self.chunks,
                "send_ms": round(self.send_seconds * 1e3, 3), "send_max_ms": round(self.send_max * 1e3, 3)}
