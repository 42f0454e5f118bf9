"""Worker processes compile recorded specializations into Triton's on-disk cache; the parent's
threads then install each from it (cache hits), and whatever a worker fails on the parent compiles
itself. Real sm_90 compiles behind stand-in drivers: no GPU needed."""

import logging

import pytest
import torch
import triton
from triton.backends.compiler import GPUTarget

from autodeploy.kernels.compile_workers import CompileWorkers, start_compile_workers
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
