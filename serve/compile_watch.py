"""What compiles, captures or tunes after the server said ready: work a request waits for.

Start-up is meant to leave nothing for the first requests (the ``warm_up`` pass, the CUDA-graph
captures, ``warmup.warm_up_engine``), so every one of these after ready is a finding: logged as a
warning, counted by kind (``autodeploy_compiles_after_ready_total{kind}``), written to the timeline.

- ``triton``: a Triton kernel specialization compiled (or loaded from Triton's disk cache) at its
  launch, seen through Triton's ``jit_post_compile_hook``;
- ``torch_compile``: a torch.compile (Dynamo) compilation, seen through Dynamo's end-of-compile
  callbacks;
- ``cuda_graph``: a CUDA graph captured (the compiled model's graph count grew);
- ``gemm_timing``: a GEMM row bucket whose library ``ops/blas_choice.py`` timed (its table grew).

The first two are events; the last two are read off their tables when counted or polled.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable
from typing import Any

log = logging.getLogger("autodeploy.serve.compile_watch")

KINDS = ("triton", "torch_compile", "cuda_graph", "gemm_timing")


class CompileWatch:
    """Counts compiles after :meth:`start`; ``on_event(kind, detail)`` hears of each one."""

    def __init__(self, model: Any = None, on_event: Callable[[str, str], None] | None = None):
        self.model = model
        self.on_event = on_event
        self._events: Counter[str] = Counter()
        self._baseline: dict[str, int] = {}
        self._polled: dict[str, int] = {}
        self._previous_triton_hook = None
        self._started = False

    def start(self) -> None:
        self._baseline = self._tables()
        self._polled = dict(self._baseline)
        self._install_triton_hook()
        self._dynamo_handler().register_end_callback(self._on_dynamo_compile)
        self._started = True

    def stop(self) -> None:
        if not self._started:
            return
        self._started = False
        runtime = _triton_runtime()
        if runtime is not None and runtime.jit_post_compile_hook == self._on_triton_compile:
            runtime.jit_post_compile_hook = self._previous_triton_hook
        self._dynamo_handler().remove_end_callback(self._on_dynamo_compile)

    def counts(self) -> dict[str, int]:
        """Every kind, zero included, since :meth:`start`."""
        tables = self._tables()
        return {kind: self._events[kind] + max(0, tables.get(kind, 0) - self._baseline.get(kind, 0))
                for kind in KINDS}

    def poll(self) -> None:
        """Report the table-read kinds that grew since the last poll (the timeline polls every step)."""
        for kind, now in self._tables().items():
            grown = now - self._polled.get(kind, 0)
            if grown > 0:
                self._polled[kind] = now
                self._report(kind, f"{grown} new")

    def record(self, kind: str, detail: str) -> None:
        """One compile of ``kind`` now (the hooks call this; tests may too)."""
        self._events[kind] += 1
        self._report(kind, detail)

    def _report(self, kind: str, detail: str) -> None:
        log.warning("%s after the server said ready: %s (a request waited for it)", kind.replace("_", " "), detail)
        if self.on_event is not None:
            self.on_event(kind, detail)

    def _tables(self) -> dict[str, int]:
        from autodeploy.ops.blas_choice import CHOOSER

        graphs = getattr(self.model, "cuda_graphs", None)
        return {"cuda_graph": len(getattr(graphs, "graphs", ())), "gemm_timing": len(CHOOSER.choices)}

    def _install_triton_hook(self) -> None:
        runtime = _triton_runtime()
        if runtime is None:
            return
        self._previous_triton_hook = runtime.jit_post_compile_hook
        runtime.jit_post_compile_hook = self._on_triton_compile

    def _on_triton_compile(self, **kwargs) -> None:
        self.record("triton", str(kwargs.get("repr") or kwargs.get("key")))
        if self._previous_triton_hook is not None:
            self._previous_triton_hook(**kwargs)

    def _on_dynamo_compile(self, args=None) -> None:
        self.record("torch_compile", str(getattr(args, "compile_id", "") or "a graph"))

    @staticmethod
    def _dynamo_handler():
        from torch._dynamo.callback import callback_handler

        return callback_handler


def _triton_runtime():
    """``triton.knobs.runtime`` where this Triton has it (3.4+), else None (nothing to hook)."""
    try:
        import triton
    except ImportError:
        return None
    return getattr(getattr(triton, "knobs", None), "runtime", None)
