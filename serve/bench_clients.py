"""Client processes of ``autodeploy bench serve --processes N``.

One Python process streaming thousands of SSE chunks a second is busy enough to delay its own reads:
at 64 streams of an 8B model (~7,000 chunks/s) a single client measured time-to-first-token tails about
twice the server's own time to first byte in the same run, and four clients of 16 streams each measured a
third of the one client's p99 at the same throughput (issue 36). Each shard (``bench_serving.Shard``) runs
in its own spawned process with its share of the payloads (built once, in the parent); all of them start
sending at once, after every process has imported httpx, so that the run's duration (first send to last end, ``time.perf_counter``:
CLOCK_MONOTONIC, one clock for every process of a host) leaves out their start-up.
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import queue
import time

from .bench_serving import Shard, ShardResult

START_TIMEOUT = 120.0  # seconds for every client process to import and report ready


def run_shards(shards: list[Shard]) -> list[ShardResult]:
    """Each shard in a process of its own, started together; their results in shard order. A process that
    fails, dies or never reports is an error naming it."""
    context = mp.get_context("spawn")
    ready, go, results = context.Queue(), context.Event(), context.Queue()
    workers = [context.Process(target=_client, args=(i, shard, ready, go, results), daemon=True)
               for i, shard in enumerate(shards)]
    for worker in workers:
        worker.start()
    try:
        _receive(ready, len(workers), workers, START_TIMEOUT)
        go.set()
        timeout = max(shard.timeout for shard in shards) * max(len(shard.payloads) for shard in shards)
        found = dict(_receive(results, len(workers), workers, timeout))
    finally:
        for worker in workers:
            worker.join(timeout=5)
            if worker.is_alive():
                worker.kill()
    failed = {i: out for i, out in found.items() if isinstance(out, str)}
    if failed:
        raise RuntimeError(f"benchmark client process(es) failed: {failed}")
    return [found[i] for i in range(len(shards))]


def _receive(channel, count: int, workers, timeout: float) -> list:
    """``count`` messages from ``channel``, polling so that a client process that died is noticed."""
    got, deadline = [], time.monotonic() + timeout
    while len(got) < count:
        try:
            got.append(channel.get(timeout=0.5))
        except queue.Empty:
            dead = [i for i, w in enumerate(workers) if w.exitcode not in (None, 0)]
            if dead or time.monotonic() > deadline:
                raise RuntimeError(f"benchmark client process(es) {dead or 'all'} stopped or did not report in "
                                   f"time (exit codes {[w.exitcode for w in workers]})") from None
    return got


def _client(index: int, shard: Shard, ready, go, results) -> None:
    try:
        import httpx  # noqa: F401  (imported before the start signal: not timed)
    except ImportError as exc:
        ready.put(index)
        results.put((index, f"{type(exc).__name__}: {exc}"))
        return
    ready.put(index)
    go.wait()
    try:
        results.put((index, asyncio.run(shard.send_all())))
    except Exception as exc:  # noqa: BLE001 (reported to the parent, which raises)
        results.put((index, f"{type(exc).__name__}: {exc}"))
