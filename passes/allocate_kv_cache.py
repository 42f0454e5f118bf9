"""allocate_kv_cache: size the KV pool from the memory left after a profiling forward, allocate it.

On CUDA: run one step of ``max_num_tokens`` tokens with a minimal cache, measure the activation
peak, then give ``kv_cache_free_gpu_memory_fraction`` of what stays free to the pool. On the CPU:
``kv_cache_cpu_bytes``, capped at what ``max_batch_size`` sequences of ``max_seq_len`` need. A fixed
``num_kv_blocks`` overrides both.
"""

from __future__ import annotations

import logging
import time

import torch

from autodeploy.kvcache.allocator import blocks_needed
from autodeploy.kvcache.metadata import BatchMetadata, SequenceChunk
from autodeploy.kvcache.pool import KVCapacity, KVPool
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
        start = time.perf_counter()
        if cfg.num_kv_blocks:
            num_blocks = cfg.num_kv_blocks
        elif ctx.device.type == "cuda":
            num_blocks = KVPool.blocks_for_budget(specs, block_size, self._cuda_budget(ctx, blocks_per_seq))
        else:
            budget = KVPool.blocks_for_budget(specs, block_size, cfg.kv_cache_cpu_bytes)
            num_blocks = min(budget, cfg.max_batch_size * blocks_per_seq)
        if num_blocks < blocks_per_seq:
            log.warning("KV cache holds %d blocks, fewer than one sequence of max_seq_len needs (%d)",
                        num_blocks, blocks_per_seq)
        if num_blocks < 1:
            raise RuntimeError("no memory left for the KV cache")
        sized = time.perf_counter()
        ctx.artifacts["kv_pool"] = KVPool(specs, num_blocks, block_size, ctx.device)
        if ctx.device.type == "cuda":
            torch.cuda.synchronize(ctx.device)
        capacity = KVCapacity(num_blocks, block_size, max_seq_len)
        ctx.artifacts["kv_capacity"] = capacity
        log.info(capacity.describe())
        timing = f" (sized in {sized - start:.1f} s, allocated in {time.perf_counter() - sized:.1f} s)"
        return PassResult(num_blocks, capacity.describe() + timing)

    def _cuda_budget(self, ctx: CompileContext, blocks_per_seq: int) -> int:
        cfg = ctx.config
        chunks, n_blocks = profiling_chunks(cfg.max_num_tokens, ctx.artifacts["max_seq_len"], cfg.max_batch_size,
                                           cfg.tokens_per_block)
        tokens = sum(len(c.token_ids) for c in chunks)
        scratch = KVPool(ctx.artifacts["kv_specs"], n_blocks + 1, cfg.tokens_per_block, ctx.device)
        batch = BatchMetadata.build(chunks, cfg.tokens_per_block, ctx.device)
        torch.cuda.synchronize(ctx.device)
        torch.cuda.reset_peak_memory_stats(ctx.device)
        baseline = torch.cuda.memory_allocated(ctx.device)
        with torch.inference_mode():
            ctx.gm(**batch.as_kwargs(), **scratch.as_kwargs())
        torch.cuda.synchronize(ctx.device)
        activations = torch.cuda.max_memory_allocated(ctx.device) - baseline
        del scratch, batch
        torch.cuda.empty_cache()
        free, _ = torch.cuda.mem_get_info(ctx.device)
        budget = int((free - activations) * cfg.kv_cache_free_gpu_memory_fraction)
        log.info("profiling step of %d tokens: activations %.2f GiB, free %.2f GiB -> KV budget %.2f GiB",
                 tokens, activations / 2**30, free / 2**30, budget / 2**30)
        return max(0, budget)


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
