"""allocate_kv_cache: size the KV pool from the memory left after a profiling forward, allocate it.

On CUDA: run one step of ``max_num_tokens`` tokens with a minimal cache, measure the activation
peak, then give ``kv_cache_free_gpu_memory_fraction`` of what stays free to the pool, or with
``gpu_memory_utilization`` (vLLM's flag) that share of the device's total memory less what this process
holds (see :func:`kv_budget`). On the CPU:
``kv_cache_cpu_bytes``, capped at what ``max_batch_size`` sequences of ``max_seq_len`` need. A fixed
``num_kv_blocks`` overrides both. Under tensor parallelism each rank sizes its own pool (its own
key/value heads and free memory) and all take the smallest.

A model with recurrent or convolution state (``insert_state_cache``'s specs) gets its state pool
first: one slot per sequence of ``max_batch_size``, fixed size whatever the length; the KV pool
takes what is left of the budget. The report gives the two capacities separately.

The profiling step is the first forward on the GPU: run as is, its first launches would compile
their Triton kernels one after another (a fresh H200 host: 4-5 s for the 8B shape, mostly the prefill
attention). Only its memory peak matters, and where no op's allocations depend on values (no MoE
routing), that peak is the same whether the kernels run or not: so the step runs with every launch
that would compile recorded and skipped (``kernels.precompile``), and the recorded kernels are left in
``artifacts["pending_kernels"]`` for the ``warm_up`` pass, which compiles them on its thread pool with
its own (without ``warm_up`` they compile at their first launch). Should an op reject the values the
skipped kernels left unwritten, the step runs again for real.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator

import torch

from autodeploy.distributed import min_over_ranks
from autodeploy.kvcache.allocator import blocks_needed
from autodeploy.kvcache.metadata import BatchMetadata, SequenceChunk
from autodeploy.kvcache.pool import KVCapacity, KVPool
from autodeploy.kvcache.state_pool import StatePool
from autodeploy.pipeline.base import CompileContext, Pass, PassResult, Stage

log = logging.getLogger("autodeploy.kv_cache")


class AllocateKVCache(Pass):
    name = "allocate_kv_cache"
    stage = Stage.CACHE_INIT
    requires = ("kv_cache_inserted", "weights_loaded")
    ensures = ("kv_cache_allocated",)

    def apply(self, ctx: CompileContext) -> PassResult:
        specs, cfg = ctx.artifacts["kv_specs"], ctx.config
        block_size, max_seq_len = cfg.tokens_per_block, ctx.artifacts["max_seq_len"]
        blocks_per_seq = blocks_needed(max_seq_len, block_size)
        state_specs = ctx.artifacts.get("state_specs", [])
        state_bytes = cfg.max_batch_size * StatePool.bytes_per_slot(state_specs)
        start = time.perf_counter()
        if cfg.num_kv_blocks:
            num_blocks = cfg.num_kv_blocks
        elif ctx.device.type == "cuda":
            budget = self._cuda_budget(ctx, blocks_per_seq) - state_bytes
            num_blocks = KVPool.blocks_for_budget(specs, block_size, max(0, budget))
        else:
            budget = KVPool.blocks_for_budget(specs, block_size, max(0, cfg.kv_cache_cpu_bytes - state_bytes))
            num_blocks = min(budget, cfg.max_batch_size * blocks_per_seq)
        num_blocks = _addressable(num_blocks, specs, block_size, explicit=bool(cfg.num_kv_blocks))
        if cfg.tp_size > 1:  # rank 0 hands out block ids for every rank's pool: all hold the fewest
            num_blocks = min_over_ranks(num_blocks)
        if num_blocks < blocks_per_seq:
            log.warning("KV cache holds %d blocks, fewer than one sequence of max_seq_len needs (%d)",
                        num_blocks, blocks_per_seq)
        if num_blocks < 1:
            raise RuntimeError("no memory left for the KV cache")
        sized = time.perf_counter()
        state = StatePool(state_specs, cfg.max_batch_size, ctx.device) if state_specs else None
        ctx.artifacts["kv_pool"] = KVPool(specs, num_blocks, block_size, ctx.device, state=state)
        if ctx.device.type == "cuda":
            torch.cuda.synchronize(ctx.device)
        capacity = KVCapacity(num_blocks, block_size, max_seq_len, KVPool.describe_layout(specs), specs[0].dtype,
                              ctx.dtype)
        ctx.artifacts["kv_capacity"] = capacity
        described = capacity.describe() + (f"; state cache: {state.capacity().describe()}" if state is not None else "")
        log.info(described)
        pending = len(ctx.artifacts.get("pending_kernels", ()))
        deferred = f", {pending} kernels left to the warm-up's compile" if pending else ""
        allocated = time.perf_counter() - sized
        timing = f" (sized in {sized - start:.1f} s{deferred}, allocated in {allocated:.1f} s)"
        return PassResult(num_blocks, described + timing)

    def _cuda_budget(self, ctx: CompileContext, blocks_per_seq: int) -> int:
        cfg = ctx.config
        chunks, n_blocks = profiling_chunks(cfg.max_num_tokens, ctx.artifacts["max_seq_len"], cfg.max_batch_size,
                                           cfg.tokens_per_block)
        tokens = sum(len(c.token_ids) for c in chunks)
        state_specs = ctx.artifacts.get("state_specs", [])
        scratch_state = StatePool(state_specs, 1, ctx.device) if state_specs else None  # the step writes no slot
        scratch = KVPool(ctx.artifacts["kv_specs"], n_blocks + 1, cfg.tokens_per_block, ctx.device, state=scratch_state)
        batch = BatchMetadata.build(chunks, cfg.tokens_per_block, ctx.device)
        activations = self._profile(ctx, lambda: ctx.gm(**batch.as_kwargs(), **scratch.as_kwargs()))
        del scratch, batch
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(ctx.device)
        held = torch.cuda.memory_reserved(ctx.device)
        budget = kv_budget(cfg, free=free, total=total, held=held, activations=activations)
        log.info("profiling step of %d tokens: activations %.2f GiB, free %.2f GiB, held %.2f GiB of %.2f GiB "
                 "-> KV budget %.2f GiB", tokens, activations / 2**30, free / 2**30, held / 2**30, total / 2**30,
                 budget / 2**30)
        return budget

    def _profile(self, ctx: CompileContext, forward) -> int:
        """Activation bytes of ``forward`` (peak over the memory allocated before it). Its compiles are
        left pending where ``_deferred_compiles`` allows; should the step fail on values that skipped
        kernels left unwritten, it runs again for real."""
        for defer in (True, False):
            torch.cuda.synchronize(ctx.device)
            torch.cuda.reset_peak_memory_stats(ctx.device)
            baseline = torch.cuda.memory_allocated(ctx.device)
            try:
                with torch.inference_mode(), _deferred_compiles(ctx, defer) as pending:
                    forward()
            except Exception as exc:  # noqa: BLE001 (a real run raises the genuine error)
                if not (defer and pending):
                    raise
                log.warning("KV sizing: the step with its compiles deferred failed (%s: %s); "
                            "running it for real", type(exc).__name__, exc)
                continue
            torch.cuda.synchronize(ctx.device)
            if pending:
                ctx.artifacts["pending_kernels"] = pending
            return torch.cuda.max_memory_allocated(ctx.device) - baseline
        raise AssertionError("unreachable: the real run returns or raises")


def kv_budget(cfg, *, free: int, total: int, held: int, activations: int) -> int:
    """Bytes for the KV pool on a GPU with ``free`` of ``total`` bytes free, ``held`` of them held by this
    process's allocator (weights and other tensors) and a step's ``activations`` peak to leave room for.

    ``kv_cache_free_gpu_memory_fraction`` (TensorRT-LLM's meaning): that share of what stays free after
    the activations. ``gpu_memory_utilization`` (vLLM's): this process may use that share of the total
    in all, so the pool gets it less what the process holds and the activations; never more than is free
    (other processes' memory is not counted against the share, but cannot be taken either).
    """
    if cfg.gpu_memory_utilization is None:
        return max(0, int((free - activations) * cfg.kv_cache_free_gpu_memory_fraction))
    allowed = int(cfg.gpu_memory_utilization * total) - held - activations
    return max(0, min(allowed, free - activations))


# ops whose allocations (or host syncs) depend on the values they read, e.g. MoE routing sizes each
# expert's batch: with kernels skipped their inputs are garbage, so the profiling step runs for real
VALUE_DEPENDENT_OPS = frozenset({"autodeploy::moe", "aten::nonzero", "aten::unique", "aten::_unique2",
                                 "aten::unique_consecutive", "aten::masked_select", "aten::bincount",
                                 "aten::_local_scalar_dense"})


@contextlib.contextmanager
def _deferred_compiles(ctx: CompileContext, defer: bool = True) -> Iterator[list]:
    """Inside, Triton launches that would compile are recorded and skipped (the yielded list), where
    ``defer``, kernels compile on threads and the graph's memory does not depend on values; else
    nothing changes (the list stays empty)."""
    from autodeploy.kernels.precompile import recording_compiles, threads_for

    if not defer or threads_for(ctx.device) <= 1 or _value_dependent(ctx.gm):
        yield []
        return
    with recording_compiles() as specs:
        yield specs


def _value_dependent(gm) -> bool:
    """Whether the graph calls an op of ``VALUE_DEPENDENT_OPS``."""
    return any(node.op == "call_function" and getattr(getattr(node.target, "_schema", None), "name", None)
               in VALUE_DEPENDENT_OPS for node in gm.graph.nodes)


def profiling_chunks(max_num_tokens: int, max_seq_len: int, max_batch_size: int,
                     block_size: int) -> tuple[list[SequenceChunk], int]:
    """The largest step the scheduler can build: ``max_num_tokens`` prompt tokens in at most
    ``max_batch_size`` sequences of at most ``max_seq_len`` (one prompt of 1,024 tokens needs an
    eighth of the activations of eight), on distinct blocks after block 0; returns the chunks and
    the number of blocks they use."""
    chunks, next_block, left = [], 1, max_num_tokens
    while left > 0 and len(chunks) < max_batch_size:
        n = min(left, max_seq_len)
        blocks = blocks_needed(n, block_size)
        chunks.append(SequenceChunk(tuple([0] * n), 0, tuple(range(next_block, next_block + blocks))))
        next_block, left = next_block + blocks, left - n
    return chunks, next_block - 1


def _addressable(num_blocks: int, specs: list, block_size: int, explicit: bool) -> int:
    """``num_blocks``, capped at what the kernels' 32-bit offsets reach in one layer's tensor."""
    limit = KVPool.max_addressable_blocks(specs, block_size)
    if num_blocks <= limit:
        return num_blocks
    if explicit:
        raise RuntimeError(f"num_kv_blocks {num_blocks}: a layer's KV tensor would hold more than 2^31 elements, "
                           f"beyond the attention kernels' 32-bit offsets; at most {limit} blocks of {block_size}")
    log.info("KV cache capped at %d blocks (from %d): a layer's tensor holds at most 2^31 elements, what the "
             "attention kernels' 32-bit offsets reach", limit, num_blocks)
    return limit
