"""Worker processes compile recorded specializations into Triton's on-disk cache; the parent's
threads then install each from it (cache hits), and whatever a worker fails on the parent compiles
itself. Real sm_90 compiles behind stand-in drivers: no GPU needed."""

import logging
import os
import subprocess
import sys
import textwrap

import pytest
import torch
import triton
from triton.backends.compiler import GPUTarget

from autodeploy.kernels import compile_workers
from autodeploy.kernels.compile_workers import CompileWorkers, default_workers, start_compile_workers
from autodeploy.kernels.precompile import KernelCompileError, compile_in_parallel, counting_compiles

from test_precompile import _launch_all, in_a_clean_process, sm90  # noqa: F401  (sm90 is a fixture)

VARIANTS = [(16, False), (32, False), (64, False)]


@pytest.fixture
def cache_hits(monkeypatch):
    """cache_hit of every Triton compile in this process from now on (True: read from disk)."""
    hits = []
    monkeypatch.setattr(triton.knobs.compilation, "listener", lambda **kw: hits.append(kw["cache_hit"]))
    return hits


@in_a_clean_process
def test_workers_compile_into_the_disk_cache_the_parent_then_reads(sm90, cache_hits):  # noqa: F811
    from compile_worker_kernel import add_one

    x, y = torch.zeros(64), torch.zeros(64)
    workers = CompileWorkers(2, GPUTarget("cuda", 90, 32))
    try:
        launches = lambda: _launch_all(add_one, x, y, VARIANTS)  # noqa: E731
        assert compile_in_parallel(launches, threads=2, workers=workers) == 3
    finally:
        workers.close()
    assert cache_hits == [True, True, True]  # nothing compiled here: all three came from the workers
    with counting_compiles() as compiled:
        for block, small in VARIANTS:
            add_one.warmup(x, y, 64, BLOCK=block, SMALL_BLOCKS_ONLY=small, grid=(1,))
    assert compiled == []  # the launches find them installed


@in_a_clean_process
def test_what_a_worker_fails_on_the_parent_compiles_and_reports(sm90, cache_hits, caplog):  # noqa: F811
    from compile_worker_kernel import add_one

    x, y = torch.zeros(64), torch.zeros(64)
    workers = CompileWorkers(1, GPUTarget("cuda", 90, 32))
    try:
        with caplog.at_level(logging.WARNING, logger="autodeploy.kernels"):
            with pytest.raises(KernelCompileError) as error:
                compile_in_parallel(lambda: _launch_all(add_one, x, y, [(16, True), (64, True)]), threads=2,
                                    workers=workers)
    finally:
        workers.close()
    assert "compile worker failed on compile_worker_kernel.add_one" in caplog.text
    assert "BLOCK=64, SMALL_BLOCKS_ONLY=True) (CompileTimeAssertionFailure: this variant" in caplog.text
    assert "1 of 2 kernels" in str(error.value) and "this variant does not compile" in str(error.value)
    assert cache_hits == [True]  # the variant that compiles came from the worker


def test_no_workers_where_nothing_compiles():
    assert start_compile_workers(4, torch.device("cpu")) is None
    assert start_compile_workers(0, torch.device("cuda", 0)) is None


def test_default_workers_leave_a_core_to_the_parent(monkeypatch):
    for cores, expected in ((2, 0), (3, 0), (4, 3), (16, 15), (128, 16)):
        monkeypatch.setattr(compile_workers.os, "sched_getaffinity", lambda pid, n=cores: set(range(n)))
        assert default_workers() == expected


def test_workers_never_rerun_an_unguarded_main_script(tmp_path):
    """Workers are fresh interpreters, not multiprocessing spawns: a script with no ``__main__`` guard
    runs once, not once more per worker."""
    runs = tmp_path / "runs.txt"
    script = tmp_path / "unguarded.py"
    script.write_text(textwrap.dedent(f"""
        from triton.backends.compiler import GPUTarget
        from autodeploy.kernels.compile_workers import CompileWorkers
        with open({str(runs)!r}, "a") as f:
            f.write("ran\\n")
        workers = CompileWorkers(2, GPUTarget("cuda", 90, 32))
        workers.wait_until_started()
        print("started", [f.result() for f in workers._started])
        workers.close()
    """))
    child = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300,
                           env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert child.returncode == 0, child.stderr[-3000:]
    assert "started [True, True]" in child.stdout
    assert runs.read_text() == "ran\n"


def test_a_worker_that_dies_fails_its_kernel_and_the_rest_are_refused(tmp_path):
    workers = CompileWorkers(1, GPUTarget("cuda", 90, 32))
    try:
        workers.wait_until_started()
        dying = workers._submit(("compile_worker_exits_on_import", "kernel"), "{}")
        with pytest.raises(RuntimeError, match=r"compile worker exited \(code 3\)"):
            dying.result(timeout=120)
        after = workers._submit(("compile_worker_kernel", "add_one"), "{}")
        with pytest.raises(RuntimeError, match="no compile worker is running|every compile worker exited"):
            after.result(timeout=10)
    finally:
        workers.close()


def test_workers_import_the_kernels_without_the_runtime():
    """The worker's import leaves out autodeploy's __init__ (and with it transformers)."""
    workers = CompileWorkers(1, GPUTarget("cuda", 90, 32))
    try:
        probe = workers._submit(("compile_worker_reports_imports", "kernel"), "{}")
        with pytest.raises(compile_workers.WorkerCompileError, match="transformers: False, compile: False"):
            probe.result(timeout=120)
    finally:
        workers.close()


def test_a_failed_compile_comes_back_named_and_close_stops_the_workers():
    workers = CompileWorkers(2, GPUTarget("cuda", 90, 32))
    workers.wait_until_started()
    missing = workers._submit(("compile_worker_kernel", "no_such_kernel"), "{}")
    with pytest.raises(compile_workers.WorkerCompileError, match="no_such_kernel") as error:
        missing.result(timeout=120)
    assert error.value.kind == "AttributeError"
    workers.close()
    for process in workers._processes:
        assert process.wait(timeout=30) == 0
    with pytest.raises(RuntimeError, match="no compile worker is running"):
        workers._submit(("compile_worker_kernel", "add_one"), "{}").result(timeout=1)


def test_an_answer_outside_the_protocol_fails_the_kernel_and_retires_the_worker():
    import io
    from concurrent.futures import Future

    class Worker:
        stdin, stdout = io.StringIO(), io.StringIO("Traceback: something printed on the answer pipe\n")

    job = Future()
    assert compile_workers._ask(Worker(), '{"module": "m"}', job) is False
    assert Worker.stdin.getvalue() == '{"module": "m"}\n'
    with pytest.raises(RuntimeError, match="compile worker answered 'Traceback: something printed"):
        job.result(timeout=1)
