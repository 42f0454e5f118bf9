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

from autodeploy.export import get_tensor_attr
from autodeploy.kvcache.allocator import blocks_needed
from autodeploy.kvcache.metadata import BatchMetadata, SequenceChunk
from autodeploy.pipeline.base import CompileContext, Pass, PassConfig, PassResult, Stage


class WarmUpConfig(PassConfig):
    on_cpu: bool = False  # tests run the steps on the CPU too
    # every Triton attention launch config the engine's limits allow (~12: about 10 s of compiling on a
    # fresh H200 machine, ~0 once Triton's disk cache has them); off: the first steps that need one wait
    attention_variants: bool = True


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
        launches = self._attention_launches(ctx) if self.config.attention_variants else 0
        if ctx.device.type == "cuda":
            torch.cuda.synchronize(ctx.device)
        return PassResult(len(steps), f"{len(steps)} eager steps, {launches} attention launch variants "
                                      f"in {time.perf_counter() - start:.1f} s")

    def _attention_launches(self, ctx: CompileContext) -> int:
        """Launch every reachable Triton attention config once per distinct layer setting."""
        from autodeploy.kernels.attention_warmup import warm_up_launches

        target = torch.ops.autodeploy.paged_attention_triton.default
        caches, cfg, done, count = ctx.artifacts["kv_pool"].as_kwargs(), ctx.config, set(), 0
        for node in ctx.gm.graph.find_nodes(op="call_function", target=target):
            q, cache = node.args[0].meta["val"], caches[node.args[3].target]
            sinks = node.kwargs.get("sinks")
            sinks = get_tensor_attr(ctx.gm, sinks.target) if sinks is not None else None
            rope = _rotary(node)
            settings = (q.shape[1], q.dtype, node.kwargs["scale"], node.kwargs.get("sliding_window"),
                        node.kwargs.get("logit_softcap"), sinks is not None, tuple(cache.shape), cache.dtype, rope)
            if settings in done:
                continue
            done.add(settings)
            count += warm_up_launches(cache, q.shape[1], q.dtype, node.kwargs["scale"],
                                      node.kwargs.get("sliding_window"), node.kwargs.get("logit_softcap"), sinks,
                                      cfg.max_batch_size, cfg.max_num_tokens,
                                      ctx.artifacts["kv_capacity"].max_blocks_per_seq, rope)
        return count


def _rotary(node) -> tuple[int, torch.dtype, bool] | None:
    """(rotary dim, cos dtype, interleaved) of an attention with its RoPE folded in (fuse_rope_attention)."""
    cos = node.kwargs.get("rope_cos")
    if cos is None:
        return None
    return int(cos.meta["val"].shape[-1]), cos.meta["val"].dtype, bool(node.kwargs.get("rope_interleaved", False))


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
