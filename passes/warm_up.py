"""warm_up: run a few eager steps of the shapes an engine meets so every kernel is compiled at start-up.

Triton compiles a kernel on its first launch for each specialization of its arguments (constexprs
such as the attention launch config, integers equal to 1 or divisible by 16). CUDA-graph capture
compiles the decode kernels, but without this pass the first prefill and mixed steps of a server
compile theirs while requests wait: on the H200 the first offline run of the 8B shape had 437 ms
steps among its prefills. The steps below cover one and many sequences, token counts divisible by 16
and not, prefill-like and decode-like launch configs. The KV blocks they write are free blocks whose
contents nobody reads before overwriting them. Skipped on the CPU, where nothing is compiled.

The compiles themselves run on a thread pool (``autodeploy.kernels.precompile``): the steps and
launches first run with every launch that would compile recorded and skipped, the recorded kernels
compile in parallel, with those the KV sizing step recorded (``allocate_kv_cache``), then the steps
and launches run for real, finding each kernel compiled. On the H200 the 8B shape's warm-up was 43 s
of serial compiles on one of 16 cores.
"""

from __future__ import annotations

import time

import torch
from pydantic import Field

from autodeploy.export import get_tensor_attr
from autodeploy.kvcache.allocator import blocks_needed
from autodeploy.kvcache.metadata import BatchMetadata, SequenceChunk
from autodeploy.pipeline.base import CompileContext, Pass, PassConfig, PassResult, Stage


class WarmUpConfig(PassConfig):
    on_cpu: bool = False  # tests run the steps on the CPU too
    # every Triton attention launch config the engine's limits allow (~12 for the 8B shape: 2-4 s of
    # compiling each on a fresh H200 host, on the thread pool below; ~0 once Triton's disk cache has
    # them); off: the first steps that need one wait
    attention_variants: bool = True
    # threads compiling the Triton kernels the warm-up meets (default: min(8, CPU cores)); 0 or 1:
    # serially, each at the launch that needs it (the path before the thread pool existed)
    compile_threads: int | None = Field(None, ge=0)


class WarmUp(Pass):
    name = "warm_up"
    stage = Stage.COMPILE
    requires = ("kv_cache_allocated",)
    ensures = ("warmed_up",)
    Config = WarmUpConfig

    def apply(self, ctx: CompileContext) -> PassResult:
        if ctx.device.type != "cuda" and not self.config.on_cpu:
            return PassResult(0, "skipped: nothing is compiled on the CPU")
        from autodeploy.kernels.precompile import compile_in_parallel, compile_specs, counting_compiles

        pool, block_size = ctx.artifacts["kv_pool"], ctx.config.tokens_per_block
        steps = [s for s in warm_up_steps(block_size, pool.num_blocks, ctx.config) if s]
        threads = self._compile_threads(ctx.device)
        pending = ctx.artifacts.pop("pending_kernels", [])  # recorded by the KV sizing step
        start = time.perf_counter()
        with counting_compiles() as compiled:
            if threads > 1:
                pooled = compile_in_parallel(lambda: self._run(ctx, steps), threads, pending,
                                             workers=ctx.artifacts.get("compile_workers"))
            else:
                pooled = 0
                compile_specs(pending, 1)
            launches = self._run(ctx, steps)
        if threads > 1:
            late = len(compiled) - pooled  # launches the record run did not see (none expected)
            kernels = f"{pooled} kernels compiled on {threads} threads" + (f" (+{late} at their launch)" if late else "")
            workers = ctx.artifacts.get("compile_workers")
            kernels += f" [{workers.summary()} first]" if workers is not None else ""
        else:
            kernels = f"{len(compiled)} kernels compiled serially"
        return PassResult(len(steps), f"{len(steps)} eager steps, {launches} attention launch variants, {kernels} "
                                      f"in {time.perf_counter() - start:.1f} s")

    def _compile_threads(self, device: torch.device) -> int:
        """1 (serial) where nothing compiles (CPU, interpreter), where it is set so, or where Triton cannot."""
        from autodeploy.kernels.precompile import threads_for

        return threads_for(device, self.config.compile_threads)

    def _run(self, ctx: CompileContext, steps: list[list[SequenceChunk]]) -> int:
        """The eager steps, then the attention launch variants (their count)."""
        pool, block_size = ctx.artifacts["kv_pool"], ctx.config.tokens_per_block
        with torch.inference_mode():
            for chunks in steps:
                batch = BatchMetadata.build(chunks, block_size, ctx.device)
                ctx.gm(**batch.as_kwargs(), **pool.as_kwargs())
        launches = self._attention_launches(ctx) if self.config.attention_variants else 0
        if ctx.device.type == "cuda":
            torch.cuda.synchronize(ctx.device)
        return launches

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
            chunk, alibi = node.kwargs.get("chunk_size"), node.kwargs.get("alibi_slopes") is not None
            settings = (q.shape[1], q.dtype, node.kwargs["scale"], node.kwargs.get("sliding_window"),
                        node.kwargs.get("logit_softcap"), sinks is not None, tuple(cache.shape), cache.dtype, rope,
                        chunk, alibi)
            if settings in done:
                continue
            done.add(settings)
            count += warm_up_launches(cache, q.shape[1], q.dtype, node.kwargs["scale"],
                                      node.kwargs.get("sliding_window"), node.kwargs.get("logit_softcap"), sinks,
                                      cfg.max_batch_size, cfg.max_num_tokens,
                                      ctx.artifacts["kv_capacity"].max_blocks_per_seq, rope, chunk, alibi)
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
