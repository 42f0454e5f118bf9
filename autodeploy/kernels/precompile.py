"""Compile the Triton kernels a piece of start-up code launches on a thread pool, before it runs.

Triton compiles a kernel on the first launch of each specialization, on the launching thread, so a
warm-up that meets 20 new kernels compiles them one after another (2-4 s each for the attention
kernel on an H200 host) while the other CPU cores idle. :func:`compile_in_parallel` runs the code
three times over:

1. record: the code runs with Triton's ``jit_cache_hook`` set; a launch that would compile records
   its specialization (Triton's own ``preload`` format, with the JIT's cache key) and is skipped,
   neither compiled nor launched; launches of compiled kernels run as usual;
2. compile: each distinct specialization is ``preload``-ed inside ``triton.AsyncCompileMode`` on a
   thread pool, which installs it in its kernel's JIT cache under the key the launch computed;
3. the caller runs the code for real: every launch is now a cache hit, so the set of kernels that
   ends up compiled is the set the code would have compiled on its own (whatever the record run
   missed compiles at its launch, as before, and is counted as late).

Threads suffice: Triton releases the GIL in its MLIR/LLVM passes and waits for ptxas in a
subprocess; only the Python AST -> TTIR code generation (~14% of an attention compile) holds it.
bench/compile_parallel.py (retired, commit 63c458d) measured the speed-up on the 8B warm-up's kernels.
The hooks are process-wide while they are set: run this at start-up, before anything else launches
kernels on other threads. Needs a GPU (or a Triton driver); under ``TRITON_INTERPRET=1`` nothing
compiles and the hooks never fire.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import triton

log = logging.getLogger("autodeploy.kernels")
MAX_DEFAULT_THREADS = 8  # the GIL-held share of a compile limits the gain of more threads


class KernelCompileError(RuntimeError):
    """A Triton kernel failed to compile on the warm-up's thread pool."""


@dataclass(frozen=True)
class KernelSpec:
    """One specialization of a kernel, as Triton's JIT would compile it at a launch."""

    kernel: triton.runtime.JITFunction
    key: str  # the JIT's per-device cache key: the launch looks the compiled kernel up under it
    data: str  # Triton's serialized specialization (signature, constexprs, attributes, options)
    device: int

    def describe(self) -> str:
        """``module.kernel[num_warps=.., num_stages=..](NAME=value, ...)``: what the launch asked for."""
        data = json.loads(self.data)
        names = self.kernel.arg_names
        constants = ", ".join(f"{names[path[0]]}={value}" for path, value in
                              zip(data["constant_keys"], data["constant_vals"]) if len(path) == 1)
        options = data["options"]
        return f"{data['name']}[num_warps={options['num_warps']}, num_stages={options['num_stages']}]({constants})"


def available_cores() -> int:
    """The cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def default_threads() -> int:
    """min(8, the cores this process may run on)."""
    return max(1, min(MAX_DEFAULT_THREADS, available_cores()))


def parallel_compile_supported(device: torch.device) -> bool:
    """Whether Triton launches on ``device`` compile (CUDA, not the interpreter) and this Triton
    can compile on threads (``AsyncCompileMode`` and the JIT hooks in ``triton.knobs``)."""
    if device.type != "cuda" or os.environ.get("TRITON_INTERPRET") == "1":
        return False
    return hasattr(triton, "AsyncCompileMode") and hasattr(getattr(triton, "knobs", None), "runtime")


def threads_for(device: torch.device, configured: int | None = None) -> int:
    """Threads to compile on: ``configured`` (at least 1), else :func:`default_threads`; 1 (serially,
    at each launch) where nothing compiles (CPU, interpreter) or where this Triton cannot."""
    if not parallel_compile_supported(device):
        return 1
    return default_threads() if configured is None else max(configured, 1)


def precompile(run: Callable[[], object], device: torch.device, threads: int | None = None,
               workers=None) -> int:
    """:func:`compile_in_parallel` on ``threads_for(device, threads)`` threads; 0 (nothing done) where
    that is one thread. Start-up code wraps its first launches in it, then runs them for real."""
    threads = threads_for(device, threads)
    return compile_in_parallel(run, threads, workers=workers) if threads > 1 else 0


def compile_in_parallel(run: Callable[[], object], threads: int, pending: Sequence[KernelSpec] = (),
                        workers=None) -> int:
    """Record the kernels ``run()`` would compile (skipping those launches) and compile them, with
    ``pending`` (kernels recorded earlier, e.g. by the KV sizing step), on ``threads`` threads;
    returns how many. The caller then runs ``run()`` for real. With ``workers``
    (:class:`~autodeploy.kernels.compile_workers.CompileWorkers`) the worker processes compile them
    into the on-disk cache first, and the threads install them from it.

    ``run`` sees skipped launches: outputs of kernels not yet compiled are left unwritten, so it must
    not depend on their values (shapes decide what compiles). If it raises, what it recorded so far
    is compiled and the rest compiles at its launch in the real run, which raises a genuine error.
    """
    with recording_compiles(pending) as specs:
        try:
            run()
        except Exception as exc:  # noqa: BLE001 (skipped launches left garbage: the real run decides)
            log.warning("warm-up: recording stopped early (%s: %s); %d kernels found so far compile in parallel, "
                        "the rest at their first launch", type(exc).__name__, exc, len(specs))
    if workers is not None and specs:
        workers.warm(specs)
    compile_specs(specs, threads)
    return len(specs)


@contextmanager
def recording_compiles(pending: Sequence[KernelSpec] = ()) -> Iterator[list[KernelSpec]]:
    """Inside, a Triton launch that would compile appends its :class:`KernelSpec` (once per
    specialization) and returns without compiling or launching. The list starts with ``pending``
    (each specialization once)."""
    specs: list[KernelSpec] = []
    seen: set[tuple] = set()

    def add(spec: KernelSpec) -> None:
        if (id(spec.kernel), spec.device, spec.key) not in seen:
            seen.add((id(spec.kernel), spec.device, spec.key))
            specs.append(spec)

    for spec in pending:
        add(spec)

    def record(*, fn, compile, **_) -> bool:
        add(KernelSpec(fn.jit_function, compile["key"], compile["specialization_data"], compile["device"]))
        return True  # tells the JIT: skip this compile (and so the launch)

    with _hook("jit_cache_hook", record):
        yield specs


@contextmanager
def counting_compiles() -> Iterator[list[str]]:
    """Inside, the cache key of every kernel compiled (serially at a launch, or finalized from a
    thread pool) is appended to the yielded list."""
    keys: list[str] = []
    with _hook("jit_post_compile_hook", lambda *, key, **_: keys.append(key)):
        yield keys


def compile_specs(specs: list[KernelSpec], threads: int) -> None:
    """Compile each spec into its kernel's JIT cache, on ``threads`` threads (one: serially, here).

    Raises :class:`KernelCompileError` naming every spec that failed, after the others are installed.
    """
    if not specs:
        return
    if threads <= 1:
        for spec in specs:
            _check_device(spec)
            spec.kernel.preload(spec.data)
        return
    # ignore_errors: Triton's __exit__ would raise at the first failure and leave its mode active
    with ThreadPoolExecutor(threads, thread_name_prefix="triton-compile") as pool, \
            triton.AsyncCompileMode(pool, ignore_errors=True):
        futures = [(spec, _submit(spec)) for spec in specs]
    failed = [(spec, error) for spec, future in futures if future is not None
              and (error := future.future.exception()) is not None]
    if failed:
        raise _compile_error(failed, len(specs)) from failed[0][1]


def _submit(spec: KernelSpec):
    _check_device(spec)
    return spec.kernel.preload(spec.data)  # in AsyncCompileMode: a FutureKernel, compiling on the pool


def _check_device(spec: KernelSpec) -> None:
    # preload compiles for (and caches on) the current device; the record run was on the same thread
    current = triton.runtime.driver.active.get_current_device()
    if current != spec.device:
        raise KernelCompileError(f"{spec.describe()} was recorded on device {spec.device} but the current "
                                 f"device is {current}")


def _compile_error(failed: list[tuple[KernelSpec, BaseException]], total: int) -> KernelCompileError:
    lines = [f"Triton failed to compile {len(failed)} of {total} kernels on the warm-up's thread pool:"]
    for spec, error in failed:
        text = [line.strip() for line in str(error).strip().splitlines()] or [""]
        # Triton's compile errors: "at line:col:", the source around it, then the message
        summary = text[0] if len(text) == 1 else f"{text[0]} {text[-1]}"
        lines.append(f"  {spec.describe()}: {type(error).__name__}: {summary[:400]}")
    lines.append("(passes.warm_up.compile_threads=1 compiles each kernel at its launch instead, one at a time)")
    return KernelCompileError("\n".join(lines))


@contextmanager
def _hook(name: str, hook: Callable) -> Iterator[None]:
    """Set one of Triton's JIT hooks for the duration; the previous one is restored."""
    runtime = triton.knobs.runtime
    previous = getattr(runtime, name)
    setattr(runtime, name, hook)
    try:
        yield
    finally:
        setattr(runtime, name, previous)
