"""Parallel compile of the Triton kernels a warm-up meets: record the launches, compile on threads,
find them compiled at the real launch. Real sm_90 compiles (Triton ships ptxas) behind a stand-in
driver: no GPU needed, nothing is launched."""

import functools
import inspect
import logging
import os
import subprocess
import sys
import threading
import types
from pathlib import Path
from unittest import mock

import pytest
import torch
import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.runtime import _async_compile
from triton.runtime.driver import driver

from autodeploy.kernels import precompile
from autodeploy.kernels.precompile import (
    KernelCompileError,
    compile_in_parallel,
    compile_specs,
    counting_compiles,
    recording_compiles,
)


def in_a_clean_process(test):
    """Run ``test`` here, or in a fresh pytest process once Triton's CPU interpreter has run in this
    one: in Triton 3.6 a kernel calling a jit helper leaves triton.language patched
    (``InterpretedFunction.__call__`` never restores it), and real compiles then fail."""

    @functools.wraps(test)
    def run(*args, **kwargs):
        if tl.core.is_builtin(tl.core.arange):
            return test(*args, **kwargs)
        node_id = f"{inspect.getsourcefile(test)}::{test.__name__}"  # the test's own file, not this one's
        child = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", node_id],
                               check=False, capture_output=True, text=True, timeout=600,
                               cwd=Path(__file__).resolve().parents[2])
        assert child.returncode == 0, child.stdout[-4000:] + child.stderr[-2000:]

    return run


def _add_one(x_ptr, y_ptr, n, BLOCK: tl.constexpr, SMALL_BLOCKS_ONLY: tl.constexpr):
    if SMALL_BLOCKS_ONLY:
        tl.static_assert(BLOCK <= 32, "this variant does not compile")
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(y_ptr + offsets, tl.load(x_ptr + offsets, mask=offsets < n) + 1, mask=offsets < n)


def _fresh_kernel():
    """A real JIT function (the tests otherwise run the interpreter) with empty caches."""
    with mock.patch.dict(os.environ, {"TRITON_INTERPRET": "0"}):
        return triton.jit(_add_one)


@pytest.fixture
def sm90(monkeypatch, tmp_path):
    """The JIT's view of an H100/H200 on device 0 (compiles only: nothing here launches)."""
    fake = types.SimpleNamespace(get_current_target=lambda: GPUTarget("cuda", 90, 32),
                                 get_current_device=lambda: 0, get_current_stream=lambda device: 0)
    monkeypatch.setattr(driver, "_active", fake)
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))  # cold: every compile is a real one


def _launch_all(kernel, x, y, variants):
    return [kernel[(1,)](x, y, 64, BLOCK=block, SMALL_BLOCKS_ONLY=small) for block, small in variants]


VARIANTS = [(16, False), (32, False), (16, False), (64, False)]  # one repeated: three specializations


COMPILED_ON: list[str] = []  # thread names, appended by _CountingPool's workers


class _CountingPool(precompile.ThreadPoolExecutor):
    def submit(self, fn, *args, **kwargs):
        def on_worker():
            COMPILED_ON.append(threading.current_thread().name)
            return fn(*args, **kwargs)
        return super().submit(on_worker)


@in_a_clean_process
def test_recorded_launches_compile_on_threads_into_the_cache_the_launch_reads(sm90, monkeypatch):
    kernel, x, y = _fresh_kernel(), torch.zeros(64), torch.zeros(64)
    before = triton.knobs.runtime.jit_cache_hook
    with recording_compiles() as specs:
        assert _launch_all(kernel, x, y, VARIANTS) == [None] * 4  # skipped: neither compiled nor launched
    assert len(specs) == 3 and not kernel.device_caches[0][0]
    assert triton.knobs.runtime.jit_cache_hook is before
    monkeypatch.setattr(precompile, "ThreadPoolExecutor", _CountingPool)
    COMPILED_ON.clear()
    compile_specs(specs, threads=2)
    assert len(COMPILED_ON) == 3 and all(name.startswith("triton-compile") for name in COMPILED_ON)
    with counting_compiles() as compiled:
        pooled = {kernel.warmup(x, y, 64, BLOCK=b, SMALL_BLOCKS_ONLY=s, grid=(1,)).hash for b, s in VARIANTS}
    assert compiled == []  # every launch found its kernel: same cache keys as the launch path computes
    serial_kernel = _fresh_kernel()  # the same launches compiled one by one, as without the pool
    with counting_compiles() as compiled:
        serial = {serial_kernel.warmup(x, y, 64, BLOCK=b, SMALL_BLOCKS_ONLY=s, grid=(1,)).hash for b, s in VARIANTS}
    assert len(compiled) == 3 and serial == pooled  # same specializations, same binaries
    assert set(serial_kernel.device_caches[0][0]) == set(kernel.device_caches[0][0])


@in_a_clean_process
def test_one_thread_compiles_serially_without_a_pool(sm90, monkeypatch):
    kernel, x, y = _fresh_kernel(), torch.zeros(64), torch.zeros(64)
    with recording_compiles() as specs:
        _launch_all(kernel, x, y, VARIANTS[:2])
    monkeypatch.setattr(precompile, "ThreadPoolExecutor", None)  # would fail if used
    with counting_compiles() as compiled:
        compile_specs(specs, threads=1)
    assert len(compiled) == 2 and set(kernel.device_caches[0][0]) == {s.key for s in specs}


@in_a_clean_process
def test_pending_specs_compile_with_the_recorded_ones_once_each(sm90):
    """Kernels an earlier step recorded (the KV sizing step) compile on the warm-up's pool with what the
    warm-up records; a specialization both met compiles once."""
    kernel, x, y = _fresh_kernel(), torch.zeros(64), torch.zeros(64)
    with recording_compiles() as earlier:
        _launch_all(kernel, x, y, [(16, False), (128, False)])
    assert compile_in_parallel(lambda: _launch_all(kernel, x, y, VARIANTS), threads=2, pending=earlier) == 4
    with counting_compiles() as compiled:
        for block in (16, 32, 64, 128):
            kernel.warmup(x, y, 64, BLOCK=block, SMALL_BLOCKS_ONLY=False, grid=(1,))
    assert compiled == [] and len(kernel.device_caches[0][0]) == 4


@in_a_clean_process
def test_a_failing_compile_names_the_kernel_and_leaves_triton_usable(sm90):
    kernel, x, y = _fresh_kernel(), torch.zeros(64), torch.zeros(64)
    with recording_compiles() as specs:
        _launch_all(kernel, x, y, [(16, True), (64, True)])
    with pytest.raises(KernelCompileError) as error:
        compile_specs(specs, threads=2)
    message = str(error.value)
    assert "1 of 2 kernels" in message and "_add_one" in message and "BLOCK=64, SMALL_BLOCKS_ONLY=True" in message
    assert "this variant does not compile" in message and "compile_threads=1" in message
    assert _async_compile.active_mode.get() is None  # later launches compile as usual, not on a dead pool
    assert list(kernel.device_caches[0][0]) == [specs[0].key]  # the one that compiled is installed
    with counting_compiles() as compiled:
        kernel.warmup(x, y, 64, BLOCK=32, SMALL_BLOCKS_ONLY=False, grid=(1,))
    assert len(compiled) == 1


@in_a_clean_process
def test_a_record_run_that_fails_compiles_what_it_saw_and_leaves_the_rest_to_the_real_run(sm90, caplog):
    kernel, x, y = _fresh_kernel(), torch.zeros(64), torch.zeros(64)

    def run():
        _launch_all(kernel, x, y, VARIANTS[:1])
        raise IndexError("read a skipped kernel's output")

    with caplog.at_level(logging.WARNING, logger="autodeploy.kernels"):
        assert compile_in_parallel(run, threads=2) == 1
    assert "recording stopped early (IndexError" in caplog.text
    assert triton.knobs.runtime.jit_cache_hook is None and len(kernel.device_caches[0][0]) == 1


def test_parallel_compile_only_where_triton_compiles(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert precompile.parallel_compile_supported(torch.device("cuda", 0))
    assert not precompile.parallel_compile_supported(torch.device("cpu"))
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert not precompile.parallel_compile_supported(torch.device("cuda", 0))
    assert 1 <= precompile.default_threads() <= 8


def test_precompile_runs_the_record_pass_only_where_kernels_compile(monkeypatch):
    calls = []
    assert precompile.threads_for(torch.device("cpu"), 8) == 1
    assert precompile.precompile(lambda: calls.append("ran"), torch.device("cpu")) == 0 and calls == []
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    cuda = torch.device("cuda", 0)
    assert precompile.threads_for(cuda, 0) == 1 and precompile.threads_for(cuda, 3) == 3
    assert precompile.threads_for(cuda) == precompile.default_threads()
    monkeypatch.setattr(precompile, "compile_in_parallel",
                        lambda run, threads, workers=None: (run(), threads)[1])
    assert precompile.precompile(lambda: calls.append("ran"), cuda, threads=4) == 4 and calls == ["ran"]
    assert precompile.precompile(lambda: calls.append("again"), cuda, threads=1) == 0 and calls == ["ran"]
