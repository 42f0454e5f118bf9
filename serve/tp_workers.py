"""Tensor-parallel serving: the worker ranks, and rank 0's watch over them.

``autodeploy serve MODEL --tp_size N`` is rank 0: it owns the HTTP server and the engine. Before it
compiles, :meth:`TensorParallelWorkers.start` starts ranks 1..N-1 (``torch.multiprocessing``; NCCL
on GPUs, gloo on CPUs). Every rank compiles the same model into its own shard; afterwards each
worker runs :func:`autodeploy.distributed_steps.follow_steps` while rank 0's ``CompiledModel``
publishes every step. Under torchrun (one host or several) the same command runs on every rank:
rank 0 serves, the others run :func:`serve_as_worker`.

A worker that dies must not leave the server hanging: a watchdog thread waits on the workers'
process sentinels; when one exits it logs which rank, aborts the process group (a collective in
flight fails instead of waiting for a dead peer) and fails the engine, so ``/health`` and every
request answer 503. Workers leave when rank 0 stops them, or exit when rank 0's process is gone.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import wait
from typing import Any

import torch

from autodeploy.distributed import TensorParallel, gather_to_driver, init_tensor_parallel
from autodeploy.distributed_launch import host_store, spawn_ranks
from autodeploy.distributed_steps import StepPublisher, follow_steps

from .engine_process import exit_with_parent

log = logging.getLogger("autodeploy.serve.tp")


class WorkerDied(RuntimeError):
    """A tensor-parallel rank exited: the model cannot run any more."""


class TensorParallelWorkers:
    """Rank 0's side of a tensor-parallel server: its job, its workers, their watchdog."""

    def __init__(self, job: TensorParallel, processes: list, store=None):
        self.job, self.processes = job, processes
        self._store = store  # rank 0 hosts the rendezvous for the job's lifetime
        self.publisher: StepPublisher | None = None
        self.failure: str | None = None
        self._on_failure: Callable[[WorkerDied], None] | None = None
        self._stopping = False
        if processes:
            threading.Thread(target=self._watch, name="autodeploy-tp-watchdog", daemon=True).start()

    @classmethod
    def start(cls, model_dir: str, compile_options: dict[str, Any], log_level: str = "warning") -> TensorParallelWorkers:
        """Join the job as rank 0: start ranks 1..N-1 here, or (under torchrun) meet the others."""
        world = compile_options["tp_size"]
        device = compile_options.get("device", "auto")
        if _under_torchrun():
            return cls(init_tensor_parallel(world, device=device), [])
        store, rendezvous = host_store(world)
        processes = spawn_ranks(rendezvous, _worker_main, (model_dir, compile_options, log_level), range(1, world))
        return cls(init_tensor_parallel(world, 0, store=store, device=device), processes, store)

    def attach(self, model, on_failure: Callable[[WorkerDied], None]) -> list[str]:
        """Rank 0's model publishes its steps from now on; returns the start-up report's lines."""
        self.publisher = StepPublisher(self.job)
        model.publisher = self.publisher
        self._on_failure = on_failure
        ranks = gather_to_driver(rank_memory(model))
        if self.failure:
            on_failure(WorkerDied(self.failure))
        return tensor_parallel_report(model, self.job, ranks)

    def stop(self, timeout: float = 10.0) -> None:
        """Tell the workers to leave, wait for them, terminate what is left."""
        self._stopping = True
        if self.publisher is not None and self.failure is None:
            try:
                self.publisher.stop()
            except Exception as exc:  # noqa: BLE001 (shutting down: a failed peer is reported, not raised)
                log.warning("stopping the tensor-parallel workers: %s", exc)
        deadline = time.monotonic() + timeout
        for process in self.processes:
            process.join(max(0.0, deadline - time.monotonic()))
            if process.is_alive():
                process.terminate()

    def _watch(self) -> None:
        sentinels = {p.sentinel: (rank, p) for rank, p in enumerate(self.processes, start=1)}
        ready = wait(list(sentinels))
        if self._stopping:
            return
        rank, process = sentinels[ready[0]]
        process.join(1.0)
        self.failure = (f"tensor-parallel rank {rank} (pid {process.pid}) exited with code {process.exitcode}; "
                        "the model cannot run without it: restart the server")
        log.error(self.failure)
        _abort_process_group()
        if self._on_failure is not None:
            self._on_failure(WorkerDied(self.failure))


def _under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def _abort_process_group() -> None:
    """Make collectives waiting for a dead peer fail now (NCCL would wait for its timeout)."""
    try:
        from torch.distributed.distributed_c10d import _abort_process_group as abort

        abort()
    except Exception as exc:  # noqa: BLE001 (gloo fails such collectives by itself when the peer's sockets close)
        log.debug("process group abort: %s", exc)


def _worker_main(rank: int, store, model_dir: str, compile_options: dict[str, Any], log_level: str) -> None:
    logging.basicConfig(level=getattr(logging, log_level.upper(), logging.WARNING),
                        format=f"%(asctime)s %(levelname)s rank {rank} %(name)s: %(message)s")
    exit_with_parent()
    job = init_tensor_parallel(compile_options["tp_size"], rank, store=store, device=compile_options.get("device", "auto"))
    serve_as_worker(model_dir, compile_options, job)


def serve_as_worker(model_dir: str, compile_options: dict[str, Any], job: TensorParallel | None = None) -> int:
    """A worker rank: compile this rank's shard, report its memory, run rank 0's steps until told to stop."""
    from autodeploy.compiler import compile as compile_model

    job = job or init_tensor_parallel(compile_options["tp_size"], device=compile_options.get("device", "auto"))
    model = compile_model(model_dir, **compile_options)
    gather_to_driver(rank_memory(model))
    steps = follow_steps(model, job)
    log.info("rank %d: stopped after %d steps", job.rank, steps)
    return 0


def rank_memory(model) -> dict[str, int]:
    """What this rank holds: weight and KV-cache bytes, and the device's allocation peak."""
    weights = sum(p.numel() * p.element_size() for p in model.gm.parameters())
    kv = sum(c.numel() * c.element_size() for c in model.pool.caches)
    peak = torch.cuda.max_memory_allocated(model.device) if model.device.type == "cuda" else 0
    return {"weights": weights, "kv_cache": kv, "peak": peak, "kv_blocks": model.num_blocks, "pid": os.getpid()}


def tensor_parallel_report(model, job: TensorParallel, ranks: list[dict[str, int]]) -> list[str]:
    """Start-up report lines: the plan's summary and every rank's memory."""
    plan = next((r.detail for r in model.report.passes if r.name == "shard"), "no shard pass")
    lines = [f"tensor par.  {plan} ({job.backend})"]
    for rank, memory in enumerate(ranks):
        peak = f", device peak {memory['peak'] / 2**30:.2f} GiB" if memory["peak"] else ""
        lines.append(f"  rank {rank}     pid {memory['pid']}: weights {memory['weights'] / 2**20:.1f} MiB, KV cache "
                     f"{memory['kv_cache'] / 2**20:.1f} MiB ({memory['kv_blocks']} blocks){peak}")
    return lines
