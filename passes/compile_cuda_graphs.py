"""compile_cuda_graphs: capture decode steps whole (``autodeploy.cudagraph``) and, with ``piecewise``
(on by default), the pieces of every other step between its eager attention calls
(``autodeploy.piecewise``), in one memory pool. The pass table's detail says what was captured.

Decode graphs are skipped, with the reason in the pass table, with attention backends that
synchronize with the host (the torch reference backend) and with ops that do (MoE's reference
routing); the state ops synchronize only on steps other than decodes (``DECODE_CAPTURABLE_OPS``: a
decode step updates every slot in one batched step), so models with state get decode graphs.
Piecewise graphs run the syncing ops eagerly between the pieces, so they need neither, but rely on
``check_uncached_state`` having proved the graph token-local outside attention and the state ops
(padding rows stay in their rows). On
the CPU nothing is captured; ``piecewise_on_cpu`` runs the piecewise path there with each piece
called where a graph would replay (tests). ``enforce_eager`` (vLLM's ``--enforce-eager``) captures nothing.
"""

from __future__ import annotations

import torch

from autodeploy.cudagraph import CudaGraphRunner, default_batch_sizes
from autodeploy.graph.modules import layers_of
from autodeploy.graph.split import HOST_SYNC_OPS
from autodeploy.ops.attention_backends import ATTENTION_BACKENDS
from autodeploy.ops.state_ops import DECODE_CAPTURABLE_OPS
from autodeploy.piecewise import PiecewiseRunner, default_piecewise_sizes
from autodeploy.pipeline.base import CompileContext, Pass, PassConfig, PassResult, Stage


class CudaGraphConfig(PassConfig):
    # decode steps, one graph per batch size (default: default_batch_sizes(max_batch_size)); []: none
    batch_sizes: list[int] | None = None
    # other steps (prefills, mixed prefill + decode) of at most the largest token bucket: padded to their
    # bucket, the pieces between attention calls replay graphs captured per bucket. Off by default until
    # bench/probes/mixed_steps.py has checked and timed it on a GPU; off, those steps run eagerly
    # on since its check on an H100 (bench/probes/mixed_steps.py, 2026-12-07: every padded step equal to eager; a mixed
    # step's host time 34 -> 8.7 ms); false: prefill and mixed steps run eagerly
    piecewise: bool = True
    # the token buckets (default: default_piecewise_sizes(max_num_tokens)); []: none, as piecewise=false
    piecewise_sizes: list[int] | None = None
    # tests: the piecewise path on the CPU (with piecewise), each piece called where its graph would replay
    piecewise_on_cpu: bool = False


class CompileCudaGraphs(Pass):
    name = "compile_cuda_graphs"
    stage = Stage.COMPILE
    requires = ("kv_cache_allocated",)
    ensures = ("cuda_graphs",)
    Config = CudaGraphConfig

    def apply(self, ctx: CompileContext) -> PassResult:
        if ctx.config.enforce_eager:
            return PassResult(0, "skipped: enforce_eager")
        cuda = ctx.device.type == "cuda"
        if not cuda and not self.config.piecewise_on_cpu:
            return PassResult(0, "skipped: not on CUDA")
        memory_pool = torch.cuda.graph_pool_handle() if cuda else None
        decode, decode_detail = self._decode(ctx, memory_pool) if cuda else (None, "decode graphs: not on CUDA")
        piecewise, piecewise_detail = self._piecewise(ctx, memory_pool)
        ctx.artifacts["cuda_graphs"], ctx.artifacts["piecewise_graphs"] = decode, piecewise
        count = (len(decode.batch_sizes) if decode else 0) + (piecewise.num_captures if piecewise else 0)
        return PassResult(count, f"{decode_detail}; {piecewise_detail}")

    def _decode(self, ctx: CompileContext, memory_pool) -> tuple[CudaGraphRunner | None, str]:
        from autodeploy.kernels.precompile import threads_for

        backend = ctx.artifacts["attention_backend"]
        if not ATTENTION_BACKENDS.get(backend).capturable:
            return None, f"decode graphs skipped: attention backend '{backend}' cannot be captured"
        if (why := _host_sync(ctx)) is not None:
            return None, f"decode graphs skipped: {why}"
        max_bs = ctx.config.max_batch_size
        wanted = default_batch_sizes(max_bs) if self.config.batch_sizes is None else self.config.batch_sizes
        sizes = sorted({min(s, max_bs) for s in wanted if s >= 1})
        if not sizes:
            return None, "decode graphs: none asked for"
        runner = CudaGraphRunner(ctx.gm, ctx.artifacts["kv_pool"], sizes, ctx.artifacts["kv_capacity"].max_blocks_per_seq)
        runner.capture(threads_for(ctx.device), ctx.artifacts.get("compile_workers"), memory_pool)
        compiled = f" ({runner.precompiled} kernels compiled on threads first)" if runner.precompiled else ""
        return runner, f"decode batch sizes {sizes} captured in {runner.capture_seconds:.1f} s{compiled}"

    def _piecewise(self, ctx: CompileContext, memory_pool) -> tuple[PiecewiseRunner | None, str]:
        from autodeploy.kernels.precompile import threads_for

        if not self.config.piecewise:
            return None, "piecewise graphs: off (passes.compile_cuda_graphs.piecewise=false)"
        if "state_is_kv_only" not in ctx.properties:
            return None, "piecewise graphs skipped: check_uncached_state did not prove padding rows stay apart"
        max_tokens = ctx.config.max_num_tokens
        wanted = default_piecewise_sizes(max_tokens) if self.config.piecewise_sizes is None else self.config.piecewise_sizes
        sizes = sorted({min(s, max_tokens) for s in wanted if s >= 1})
        if not sizes:
            return None, "piecewise graphs: none asked for"
        runner = PiecewiseRunner(ctx.gm, ctx.artifacts["kv_pool"], sizes, ctx.config.max_batch_size,
                                 ctx.artifacts["kv_capacity"].max_blocks_per_seq)
        runner.capture(threads_for(ctx.device), ctx.artifacts.get("compile_workers"), memory_pool)
        memory = f", {runner.memory_bytes / 2**20:.0f} MiB" if runner.memory_bytes else ""
        compiled = f", {runner.precompiled} kernels compiled on threads first" if runner.precompiled else ""
        return runner, (f"piecewise: {runner.describe()}, {runner.num_captures} captures in "
                        f"{runner.capture_seconds:.1f} s{memory}{compiled}")


def _host_sync(ctx: CompileContext) -> str | None:
    """Why a decode step cannot be captured whole: the first op that synchronizes with the host on one."""
    for node in ctx.gm.graph.nodes:
        if node.op == "call_function" and node.target in HOST_SYNC_OPS and node.target not in DECODE_CAPTURABLE_OPS:
            layers = layers_of([node])
            where = f" ({layers[0]})" if layers else ""
            return f"{node.target}{where} {HOST_SYNC_OPS[node.target]}"
    return None
