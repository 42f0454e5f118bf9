"""warm_up: run a few eager steps of the shapes an engine meets so every kernel is compiled at start-up.

Triton compiles a kernel on its first launch for each specialization of its arguments (constexprs
such as the attention launch config, integers equal to 1 or divisible by 16). CUDA-graph capture
compiles the decode kernels, but without this pass the first prefill and mixed steps of a server
compile theirs while requests wait: on the H200 the first offline run of the 8B shape had 437 ms
steps among its prefills. The steps below cover one and many sequences, token counts divisible by 16
and not, prefill-like and decode-like launch configs. The KV blocks they write are free blocks whose
contents nobody reads before overwriting them. Skipped on the CPU, where nothing is compiled.
"""

from __future__ import annotations

import time

import torch

from autodeploy.kvcache.allocator import blocks_needed
from autodeploy.kvcache.metadata import BatchMetadata, SequenceChunk
from autodeploy.pipeline.base import CompileContext, Pass, PassConfig, PassResult, Stage


class WarmUpConfig(PassConfig):
    on_cpu: bool = False  # tests run the steps on the CPU too


class WarmUp(Pass):
    name = "warm_up"
    stage = Stage.COMPILE
    requires = ("kv_cache_allocated",)
    ensures = ("warmed_up",)
    Config = WarmUpConfig

    def apply(self, ctx: CompileContext) -> PassResult:
        if ctx.device.type != "cuda" and not self.config.on_cpu:
            return PassResult(0, "skipped: nothing is compiled on the CPU")
        pool, block_size = ctx.artifacts["kv_pool"], ctx.config.tokens_per_block
        steps = [s for s in warm_up_steps(block_size, pool.num_blocks, ctx.config) if s]
        start = time.perf_counter()
        with torch.inference_mode():
            for chunks in steps:
                batch = BatchMetadata.build(chunks, block_size, ctx.device)
                ctx.gm(**batch.as_kwargs(), **pool.as_kwargs())
        if ctx.device.type == "cuda":
            torch.cuda.synchronize(ctx.device)
        return PassResult(len(steps), f"{len(steps)} eager steps in {time.perf_counter() - start:.1f} s")


def warm_up_steps(block_size: int, num_blocks: int, config) -> list[list[SequenceChunk]]:
    """(context, new tokens) per sequence for each step, turned into chunks over the free blocks."""
    shapes = [
        [(0, 17)],  # one sequence, odd token count
        [(16, 20), (5, 1), (0, 7)],  # chunked prefill next to a decode
        [(3, 2)] * 16,  # 16 sequences x 2 tokens: counts divisible by 16, decode-like launch
        [(9, 1)] * 16 + [(0, 15)],  # a large decode batch with a prefill chunk
        [(0, 16)] * 16,  # 16 whole prompts, 256 tokens
    ]
    steps = []
    for shape in shapes:
        if len(shape) > config.max_batch_size or sum(n for _, n in shape) > config.max_num_tokens:
            continue
        steps.append(_chunks(shape, block_size, num_blocks))
    return steps


def _chunks(shape: list[tuple[int, int]], block_size: int, num_blocks: int) -> list[SequenceChunk]:
    chunks, next_block = [], 0
    for context, new in shape:
        n = blocks_needed(context + new, block_size)
        if next_block + n > num_blocks:
            return []  # a pool this small serves few shapes: skip the step
        ids = tuple(range(next_block, next_block + n))
        chunks.append(SequenceChunk(tuple([1] * new), context, ids))
        next_block += n
    return chunks
