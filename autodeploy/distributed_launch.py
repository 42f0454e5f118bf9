"""Start tensor-parallel ranks as processes of this host (``torch.multiprocessing``, spawn).

``autodeploy serve --tp_size N`` stays rank 0 itself and starts ranks 1..N-1 with
:func:`spawn_ranks`; tests and benchmarks run a function on every rank with :func:`run_on_ranks`.
The ranks meet at a ``TCPStore`` that rank 0's process hosts on a free port (no port is guessed),
then join the job through :func:`autodeploy.distributed.init_tensor_parallel`. Several hosts use
torchrun instead (its rendezvous sets the environment ``init_tensor_parallel`` reads).
"""

from __future__ import annotations

import queue
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch.distributed as dist
import torch.multiprocessing as mp

STORE_TIMEOUT = timedelta(minutes=10)  # a rank may still be importing torch when another is ready


@dataclass(frozen=True)
class Rendezvous:
    """Where the ranks meet: the store's address (its host process is rank 0)."""

    host: str
    port: int
    world_size: int

    def connect(self, rank: int) -> dist.TCPStore:
        return dist.TCPStore(self.host, self.port, self.world_size, is_master=False, timeout=STORE_TIMEOUT,
                             wait_for_workers=False)


def host_store(world_size: int, host: str = "127.0.0.1") -> tuple[dist.TCPStore, Rendezvous]:
    """Rank 0's store on a free port, and how the other ranks reach it."""
    store = dist.TCPStore(host, 0, world_size, is_master=True, timeout=STORE_TIMEOUT, wait_for_workers=False)
    return store, Rendezvous(host, store.port, world_size)


def spawn_ranks(rendezvous: Rendezvous, target: Callable, args: tuple, ranks: range) -> list[mp.Process]:
    """Start ``target(rank, store, *args)`` in a fresh process for each of ``ranks``."""
    context = mp.get_context("spawn")
    processes = []
    for rank in ranks:
        process = context.Process(target=_rank_main, args=(rendezvous, rank, target, args, None),
                                  name=f"autodeploy-tp-rank{rank}")
        process.start()
        processes.append(process)
    return processes


def run_on_ranks(world_size: int, target: Callable, *args: Any, timeout_s: float = 600.0,
                 start_method: str = "spawn") -> list[Any]:
    """``target(rank, store, *args)`` on ``world_size`` fresh processes; their results in rank order.

    A rank that raises fails the call with its traceback; so does one that does not answer in
    ``timeout_s`` seconds (all ranks are then terminated). ``start_method="forkserver"`` forks the
    ranks from one server process that imported ``target``'s module once (for callers that start
    many jobs, as the tests do; the processes are as fresh as spawned ones, their imports done).
    """
    store, rendezvous = host_store(world_size)
    context = mp.get_context(start_method)
    if start_method == "forkserver":
        context.set_forkserver_preload([target.__module__])  # (read when the server starts: the first job)
    results = context.Queue()
    processes = [context.Process(target=_rank_main, args=(rendezvous, rank, target, args, results))
                 for rank in range(world_size)]
    for p in processes:
        p.start()
    try:
        return _collect(results, processes, timeout_s)
    finally:
        for p in processes:
            p.join(timeout=10)
            if p.is_alive():
                p.terminate()
        del store


def _collect(results, processes: list[mp.Process], timeout_s: float) -> list[Any]:
    out: dict[int, Any] = {}
    while len(out) < len(processes):
        try:
            rank, ok, value = results.get(timeout=timeout_s)
        except queue.Empty:
            raise TimeoutError(f"ranks {sorted(set(range(len(processes))) - set(out))} gave no result in "
                               f"{timeout_s:.0f} s") from None
        if not ok:
            raise RuntimeError(f"rank {rank} failed:\n{value}")
        out[rank] = value
    return [out[r] for r in range(len(processes))]


def _rank_main(rendezvous: Rendezvous, rank: int, target: Callable, args: tuple, results) -> None:
    try:
        value = target(rank, rendezvous.connect(rank), *args)
    except BaseException:
        if results is None:
            raise
        results.put((rank, False, traceback.format_exc()))
        return
    if results is not None:
        results.put((rank, True, value))
