"""Worker processes that compile start-up's Triton kernels into the on-disk cache.

The warm-up's thread pool (``precompile.py``) compiles ~4x faster than one thread on a 16-core H200
host, not 8x: Triton's Python code generation holds the GIL for ~14% of each compile. Processes share
no GIL. Each worker runs Triton with :class:`CompileOnlyDriver` (the parent's GPU target, no CUDA
context, no GPU memory) and ``preload``-s the specializations the parent recorded, which writes the
compiled kernels to Triton's on-disk cache (``TRITON_CACHE_DIR``, inherited). The parent then installs
every kernel exactly as without workers (``compile_specs``), now reading each from that cache.

Workers only warm a cache: a spec a worker fails on, or one whose cache key came out differently, is
compiled by the parent as before, so the kernels that run are the same either way. The pool starts
before ``torch.export`` (``compiler.compile_config``), so the workers' imports overlap it.
"""

from __future__ import annotations

import importlib
import logging
import multiprocessing
import time
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor, wait

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.backends.driver import DriverBase

from .precompile import KernelSpec, parallel_compile_supported

log = logging.getLogger("autodeploy.kernels")


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
    """``processes`` spawned workers compiling for ``target``; started at construction."""

    def __init__(self, processes: int, target: GPUTarget):
        context = multiprocessing.get_context("spawn")  # fork would copy a CUDA-initialized parent
        self.processes = processes
        self.compiled, self.seconds = 0, 0.0  # kernels the workers compiled, wall time spent waiting on them
        self._pool = ProcessPoolExecutor(processes, mp_context=context, initializer=_init_worker,
                                         initargs=(target.backend, target.arch, target.warp_size))
        # the executor spawns on demand: one no-op per worker starts them all now
        self._started = [self._pool.submit(_ready) for _ in range(processes)]

    def wait_until_started(self) -> None:
        """Block until every worker has spawned and run its initializer."""
        wait(self._started)

    def warm(self, specs: Sequence[KernelSpec]) -> None:
        """Compile ``specs`` into the on-disk cache on the workers (counted in ``compiled``)."""
        start = time.perf_counter()
        jobs = [self._pool.submit(_compile, _kernel_path(spec.kernel), spec.data) for spec in specs]
        wait(jobs)
        self.seconds += time.perf_counter() - start
        failed = [(spec, job.exception()) for spec, job in zip(specs, jobs) if job.exception() is not None]
        for spec, error in failed:  # the parent compiles these itself and raises a genuine error, if any
            last_line = (str(error).strip().splitlines() or [""])[-1]
            log.warning("compile worker failed on %s (%s: %s); compiling it here", spec.describe(),
                        type(error).__name__, last_line)
        self.compiled += len(specs) - len(failed)

    def summary(self) -> str:
        return f"{self.compiled} kernels compiled in {self.processes} worker processes ({self.seconds:.1f} s)"

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def start_compile_workers(processes: int, device: torch.device) -> CompileWorkers | None:
    """Workers compiling for ``device``'s target; None where there are none to start (0 processes, a
    device without Triton compiles, the interpreter)."""
    if processes <= 0 or not parallel_compile_supported(device):
        return None
    with torch.cuda.device(device):
        target = triton.runtime.driver.active.get_current_target()
    log.info("starting %d Triton compile workers for %s", processes, target)
    return CompileWorkers(processes, target)


def _kernel_path(kernel) -> tuple[str, str]:
    """(module, attribute) under which a worker finds the kernel's JIT function."""
    return kernel.fn.__module__, kernel.fn.__name__


def _init_worker(backend: str, arch, warp_size: int) -> None:
    triton.runtime.driver.set_active(CompileOnlyDriver(GPUTarget(backend, arch, warp_size)))


def _ready() -> None:
    """A no-op task: running it means the worker has started."""


def _compile(path: tuple[str, str], data: str) -> None:
    module, name = path
    kernel = getattr(importlib.import_module(module), name)
    while not isinstance(kernel, triton.runtime.JITFunction):  # autotuner / heuristics wrappers
        kernel = kernel.fn
    kernel.preload(data)
