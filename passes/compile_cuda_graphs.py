"""compile_cuda_graphs: capture decode steps as CUDA graphs (see ``autodeploy.cudagraph``).

Skipped, with the reason in the pass table, on the CPU and with attention backends that synchronize
with the host (the torch reference backend), and for models with state ops (their torch references
loop over the sequences on the host).
"""

from __future__ import annotations

from autodeploy.cudagraph import CudaGraphRunner, default_batch_sizes
from autodeploy.ops.attention_backends import ATTENTION_BACKENDS
from autodeploy.ops.state_ops import has_state_ops
from autodeploy.pipeline.base import CompileContext, Pass, PassConfig, PassResult, Stage


class CudaGraphConfig(PassConfig):
    batch_sizes: list[int] | None = None  # default: default_batch_sizes(max_batch_size)


class CompileCudaGraphs(Pass):
    name = "compile_cuda_graphs"
    stage = Stage.COMPILE
    requires = ("kv_cache_allocated",)
    ensures = ("cuda_graphs",)
    Config = CudaGraphConfig

    def apply(self, ctx: CompileContext) -> PassResult:
        from autodeploy.kernels.precompile import threads_for

        if ctx.device.type != "cuda":
            return PassResult(0, "skipped: not on CUDA")
        backend = ctx.artifacts["attention_backend"]
        if not ATTENTION_BACKENDS.get(backend).capturable:
            return PassResult(0, f"skipped: attention backend '{backend}' cannot be captured")
        if has_state_ops(ctx.gm):
            return PassResult(0, "skipped: the state ops (SSM scan, delta rule, causal conv) synchronize with the host")
        max_bs = ctx.config.max_batch_size
        sizes = sorted({min(s, max_bs) for s in (self.config.batch_sizes or default_batch_sizes(max_bs)) if s >= 1})
        pool = ctx.artifacts["kv_pool"]
        runner = CudaGraphRunner(ctx.gm, pool, sizes, ctx.artifacts["kv_capacity"].max_blocks_per_seq)
        workers = ctx.artifacts.get("compile_workers")
        runner.capture(compile_threads=threads_for(ctx.device), compile_workers=workers)
        ctx.artifacts["cuda_graphs"] = runner
        compiled = f" ({runner.precompiled} kernels compiled on threads first)" if runner.precompiled else ""
        seconds = runner.capture_seconds
        return PassResult(len(sizes), f"batch sizes {sizes} captured in {seconds:.1f} s{compiled}")
