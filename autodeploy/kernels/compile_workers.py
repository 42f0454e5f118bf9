"""Worker processes that compile start-up's Triton kernels into the on-disk cache.

The warm-up's thread pool (``precompile.py``) compiles ~4x faster than one thread on a 16-core H200
host, not 8x: Triton's Python code generation holds the GIL for ~14% of each compile. Processes share
no GIL. Each worker runs Triton with :class:`CompileOnlyDriver` (the parent's GPU target, no CUDA
context, no GPU memory) and ``preload``-s the specializations the parent recorded, which writes the
compiled kernels to Triton's on-disk cache (``TRITON_CACHE_DIR``, inherited). The parent then installs
every kernel exactly as without workers (``compile_specs``), now reading each from that cache.

Workers only warm a cache: a spec a worker fails on, or one whose cache key came out differently, is
compiled by the parent as before, so the kernels that run are the same either way. The pool starts
before ``torch.export`` (``compiler.compile_config``), so the workers' imports overlap it. On by default
on CUDA (:func:`default_workers`): on 16-core H100 hosts 15 workers took 2-9 s off an 8B cold start of
38-59 s, though their imports slow the export by up to a few seconds (docs/perf.md).
"""

from __future__ import annotations

import importlib
import json
import logging
import os
import queue
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future, wait

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.backends.driver import DriverBase

from .precompile import KernelSpec, available_cores, parallel_compile_supported

log = logging.getLogger("autodeploy.kernels")

MAX_DEFAULT_WORKERS = 16  # 15, measured on 16-core hosts: docs/perf.md


class CompileOnlyDriver(DriverBase):
    """A Triton driver that reports a fixed GPU target: launches specialize and compile, never run."""

    def __init__(self, target: GPUTarget):
        self.target = target

    @classmethod
    def is_active(cls) -> bool:
        return False

    def get_current_target(self) -> GPUTarget:
        return self.target

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device) -> int:
        return 0

    def get_active_torch_device(self) -> torch.device:
        return torch.device("cpu")

    def map_python_to_cpp_type(self, ty):
        raise NotImplementedError("a compile-only driver launches nothing")

    def get_benchmarker(self):
        raise NotImplementedError("a compile-only driver times nothing")


class CompileWorkers:
    """``processes`` worker processes compiling for ``target``; started at construction.

    Each worker is a fresh interpreter (``python -c``, the parent's ``sys.path``) that reads one kernel
    per line on its stdin and answers one line on a private pipe. Unlike ``multiprocessing``'s spawn,
    this never re-imports the parent's ``__main__``, so a script without an ``if __name__ ==
    "__main__":`` guard is safe. One thread per worker feeds it from a shared queue.
    """

    def __init__(self, processes: int, target: GPUTarget):
        self.processes = processes
        self.compiled, self.seconds = 0, 0.0  # kernels the workers compiled, wall time spent waiting on them
        self.prefetched, self.reused = 0, 0  # kernels handed over early (prefetch), and of them ones warm() met
        self._jobs: dict[tuple[str, str, str], Future] = {}  # (module, kernel, JIT cache key) -> its compile
        self._tasks: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._alive, self._closed = processes, False  # workers still taking kernels; no more submissions
        self._started = [Future() for _ in range(processes)]
        target_args = [target.backend, target.arch, target.warp_size]
        args = json.dumps({"sys_path": [str(path) for path in sys.path], "target": target_args})
        self._processes = [subprocess.Popen([sys.executable, "-c", _BOOTSTRAP, args], stdin=subprocess.PIPE,
                                            stdout=subprocess.PIPE, text=True) for _ in range(processes)]
        for process, started in zip(self._processes, self._started):
            threading.Thread(target=self._feed, args=(process, started), name="triton-compile-worker",
                             daemon=True).start()

    def wait_until_started(self) -> None:
        """Block until every worker has imported Triton and the kernels' package (or died trying)."""
        wait(self._started)

    def prefetch(self, specs: Sequence[KernelSpec]) -> None:
        """Start compiling ``specs`` without waiting: a later :meth:`warm` of the same kernel waits for
        this compile instead of starting another (``early_compile.py``)."""
        self._jobs_for(specs)
        self.prefetched += len(specs)

    def warm(self, specs: Sequence[KernelSpec]) -> None:
        """Compile ``specs`` into the on-disk cache on the workers (counted in ``compiled``)."""
        start = time.perf_counter()
        jobs = self._jobs_for(specs, count_reused=True)
        wait(jobs)
        self.seconds += time.perf_counter() - start
        failed = [(spec, job.exception()) for spec, job in zip(specs, jobs) if job.exception() is not None]
        for spec, error in failed:  # the parent compiles these itself and raises a genuine error, if any
            last_line = (str(error).strip().splitlines() or [""])[-1]
            log.warning("compile worker failed on %s (%s: %s); compiling it here", spec.describe(),
                        getattr(error, "kind", type(error).__name__), last_line)
        self.compiled += len(specs) - len(failed)

    def summary(self) -> str:
        early = f", {self.reused} of {self.prefetched} begun during the export" if self.prefetched else ""
        return f"{self.compiled} kernels compiled in {self.processes} worker processes ({self.seconds:.1f} s{early})"

    def _jobs_for(self, specs: Sequence[KernelSpec], count_reused: bool = False) -> list[Future]:
        """One compile per distinct kernel: a job already submitted for it (running, or done without
        error) is reused; a failed one is submitted again."""
        jobs = []
        for spec in specs:
            path = _kernel_path(spec.kernel)
            key = (*path, spec.key)
            job = self._jobs.get(key)
            failed = job is not None and job.done() and job.exception() is not None
            if job is None or failed:
                job = self._jobs[key] = self._submit(path, spec.data)
            elif count_reused:
                self.reused += 1
            jobs.append(job)
        return jobs

    def close(self) -> None:
        """Stop the workers once their current kernel is done; what is still queued is not compiled."""
        with self._lock:
            self._closed = True
        self._fail_queued(RuntimeError("compile workers closed"))
        for _ in range(self.processes):
            self._tasks.put(None)

    def _submit(self, path: tuple[str, str], data: str) -> Future:
        job: Future = Future()
        with self._lock:
            if self._alive > 0 and not self._closed:
                self._tasks.put((job, json.dumps({"module": path[0], "name": path[1], "data": data})))
                return job
        job.set_exception(RuntimeError("no compile worker is running"))
        return job

    def _feed(self, process: subprocess.Popen, started: Future) -> None:
        """One thread per worker: pass it queued kernels, one at a time, until told to stop or it dies."""
        try:
            alive = process.stdout.readline().strip() == "ready"
            started.set_result(alive)
            while alive and (task := self._tasks.get()) is not None:
                job, line = task
                alive = _ask(process, line, job)
        finally:
            if not started.done():
                started.set_result(False)
            _stop(process)
            with self._lock:
                self._alive -= 1
                last = self._alive == 0
            if last:  # nobody is left to take what is queued
                self._fail_queued(RuntimeError("every compile worker exited"))

    def _fail_queued(self, error: Exception) -> None:
        """Settle every queued kernel with ``error``; the stop signals drained on the way go back."""
        stops = 0
        while True:
            try:
                task = self._tasks.get_nowait()
            except queue.Empty:
                break
            if task is None:
                stops += 1
            else:
                task[0].set_exception(error)
        for _ in range(stops):
            self._tasks.put(None)


class WorkerCompileError(RuntimeError):
    """A kernel a worker failed to compile; ``kind`` names the exception raised there."""

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind


def _stop(process: subprocess.Popen) -> None:
    """Close a worker's pipes (end of input: it exits) and reap it."""
    try:
        process.stdin.close()
    except OSError:  # unflushed input to a worker that died
        pass
    process.stdout.close()
    process.wait()


def _exit_code(process: subprocess.Popen) -> int | None:
    """The code of a worker whose output just closed: it is exiting, give it a moment."""
    try:
        return process.wait(timeout=10)
    except subprocess.TimeoutExpired:
        return None


def _ask(process: subprocess.Popen, line: str, job: Future) -> bool:
    """Send one kernel to a worker and settle ``job`` with its answer; False if the worker is gone."""
    try:
        process.stdin.write(line + "\n")
        process.stdin.flush()
        answer = process.stdout.readline()
    except OSError as exc:  # a closed pipe: the worker died
        answer = f"{type(exc).__name__}: {exc}"
    if not answer.endswith("\n"):
        job.set_exception(RuntimeError(f"compile worker exited (code {_exit_code(process)}) {answer.strip()}"))
        return False
    try:
        reply = json.loads(answer)
    except ValueError:  # not our protocol: stop using this worker
        job.set_exception(RuntimeError(f"compile worker answered {answer.strip()[:200]!r}"))
        return False
    if reply["ok"]:
        job.set_result(None)
    else:
        job.set_exception(WorkerCompileError(reply["type"], reply["message"]))
    return True


def default_workers() -> int:
    """One fewer than the cores this process may run on, at most 16; none below 4 cores."""
    cores = available_cores()
    return min(MAX_DEFAULT_WORKERS, cores - 1) if cores >= 4 else 0


def start_compile_workers(processes: int | None, device: torch.device) -> CompileWorkers | None:
    """Workers compiling for ``device``'s target (``processes``, None: :func:`default_workers`); None
    where there are none to start (0 processes, a device without Triton compiles, the interpreter)."""
    processes = default_workers() if processes is None else processes
    if processes <= 0 or not parallel_compile_supported(device):
        return None
    with torch.cuda.device(device):
        target = triton.runtime.driver.active.get_current_target()
    log.info("starting %d Triton compile workers for %s", processes, target)
    return CompileWorkers(processes, target)


def _kernel_path(kernel) -> tuple[str, str]:
    """(module, attribute) under which a worker finds the kernel's JIT function."""
    return kernel.fn.__module__, kernel.fn.__name__


# A worker needs the kernels' modules, not the runtime: an empty `autodeploy` package stands in for its
# __init__ (transformers, pydantic, ...), a third of the import's CPU time (1.0 s against 3.1-4.1 s).
_BOOTSTRAP = """
import importlib.util, json, sys, types
args = json.loads(sys.argv[1])
sys.path[:] = args["sys_path"]
spec = importlib.util.find_spec("autodeploy")
package = types.ModuleType("autodeploy")
package.__path__, package.__spec__ = list(spec.submodule_search_locations), spec
sys.modules["autodeploy"] = package
from autodeploy.kernels.compile_workers import serve_compiles
serve_compiles(*args["target"])
"""


def serve_compiles(backend: str, arch, warp_size: int) -> None:
    """A worker's main loop: compile each kernel named on stdin, answer each on the original stdout.

    Anything else printed goes to stderr, so stray output cannot corrupt the answers.
    """
    answers = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    triton.runtime.driver.set_active(CompileOnlyDriver(GPUTarget(backend, arch, warp_size)))
    answers.write("ready\n")
    for line in sys.stdin:
        task = json.loads(line)
        try:
            _compile(task["module"], task["name"], task["data"])
            reply = {"ok": True}
        except Exception as exc:  # noqa: BLE001 (reported to the parent, which compiles it itself)
            reply = {"ok": False, "type": type(exc).__name__, "message": str(exc)}
        answers.write(json.dumps(reply) + "\n")


def _compile(module: str, name: str, data: str) -> None:
    kernel = getattr(importlib.import_module(module), name)
    while not isinstance(kernel, triton.runtime.JITFunction):  # autotuner / heuristics wrappers
        kernel = kernel.fn
    kernel.preload(data)
