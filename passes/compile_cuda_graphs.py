"""compile_cuda_graphs: capture decode steps whole (``autodeploy.cudagraph``); with ``piecewise``
(on by default), the pieces of every other step between its eager attention calls
(``autodeploy.piecewise``); with ``mixed_graphs`` (on by default), prefill and mixed steps whole, per token bucket and
sequence bucket (``autodeploy.mixed_graphs``), the piecewise graphs taking the steps those cannot; all in one memory
pool. The pass
table's detail says what was captured (count, seconds, MiB).

Decode graphs are skipped, with the reason in the pass table, with attention backends that
synchronize with the host (the torch reference backend) and with ops that do (MoE's reference
routing); the state ops synchronize only on steps other than decodes (``DECODE_CAPTURABLE_OPS``: a
decode step updates every slot in one batched step), so models with state get decode graphs.
Piecewise graphs run the syncing ops eagerly between the pieces, so they need neither, but rely on
``check_uncached_state`` having proved the graph token-local outside attention and the state ops
(padding rows stay in their rows). On
the CPU nothing is captured; ``piecewise_on_cpu`` runs the piecewise path there with each piece
called where a graph would replay (tests), ``mixed_graphs_on_cpu`` the whole-step graphs' path (any
attention backend: the stand-in calls the graph). Whole-step graphs need what decode graphs need and
no host-syncing op at all (the state ops loop on the host on prefill steps). ``enforce_eager``
(vLLM's ``--enforce-eager``) captures nothing.
"""

from __future__ import annotations

import torch

from autodeploy.cudagraph import CudaGraphRunner, default_batch_sizes
from autodeploy.graph.modules import layers_of
from autodeploy.graph.split import HOST_SYNC_OPS
from autodeploy.mixed_graphs import MixedGraphRunner, sequence_buckets
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
    # the token buckets of piecewise and whole-step graphs (default: default_piecewise_sizes(max_num_tokens));
    # []: none, as piecewise=false and mixed_graphs=false
    piecewise_sizes: list[int] | None = None
    # tests: the piecewise path on the CPU (with piecewise), each piece called where its graph would replay
    piecewise_on_cpu: bool = False
    # prefill and mixed steps of at most the largest token bucket as one graph each (padded to their token
    # bucket and a sequence bucket); the steps they cannot take stay piecewise; false: every such step piecewise.
    # On since the serving benchmark on an H100 (2026-12-07, docs/perf.md): c64 6,483 -> 7,116 output tok/s,
    # Poisson ITL p99 21.8 -> 12.1 ms, for ~650 MiB more graph memory
    mixed_graphs: bool = True
    # tests: the whole-step graphs' path on the CPU (with mixed_graphs), the graph called where it would replay
    mixed_graphs_on_cpu: bool = False


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
        if not cuda and not (self.config.piecewise_on_cpu or self.config.mixed_graphs_on_cpu):
            return PassResult(0, "skipped: not on CUDA")
        memory_pool = torch.cuda.graph_pool_handle() if cuda else None
        decode, decode_detail = self._decode(ctx, memory_pool) if cuda else (None, "decode graphs: not on CUDA")
        piecewise, piecewise_detail = (self._piecewise(ctx, memory_pool) if cuda or self.config.piecewise_on_cpu
                                       else (None, "piecewise graphs: not on CUDA"))
        mixed, mixed_detail = self._mixed(ctx, memory_pool)
        ctx.artifacts["cuda_graphs"], ctx.artifacts["piecewise_graphs"] = decode, piecewise
        ctx.artifacts["mixed_graphs"] = mixed
        count = sum((len(decode.batch_sizes) if decode else 0, piecewise.num_captures if piecewise else 0,
                     mixed.num_captures if mixed else 0))
        return PassResult(count, f"{decode_detail}; {piecewise_detail}; {mixed_detail}")

    def _decode(self, ctx: CompileContext, memory_pool) -> tuple[CudaGraphRunner | None, str]:
        from autodeploy.kernels.precompile import threads_for

        if (why := _uncapturable(ctx)) is not None:
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
        if not (sizes := self._token_sizes(ctx)):
            return None, "piecewise graphs: none asked for"
        runner = PiecewiseRunner(ctx.gm, ctx.artifacts["kv_pool"], sizes, ctx.config.max_batch_size,
                                 ctx.artifacts["kv_capacity"].max_blocks_per_seq)
        runner.capture(threads_for(ctx.device), ctx.artifacts.get("compile_workers"), memory_pool)
        memory = f", {runner.memory_bytes / 2**20:.0f} MiB" if runner.memory_bytes else ""
        compiled = f", {runner.precompiled} kernels compiled on threads first" if runner.precompiled else ""
        return runner, (f"piecewise: {runner.describe()}, {runner.num_captures} captures in "
                        f"{runner.capture_seconds:.1f} s{memory}{compiled}")

    def _mixed(self, ctx: CompileContext, memory_pool) -> tuple[MixedGraphRunner | None, str]:
        from autodeploy.kernels.precompile import threads_for

        if (why := self._no_mixed_graphs(ctx)) is not None:
            return None, why
        runner = MixedGraphRunner(ctx.gm, ctx.artifacts["kv_pool"], self._token_sizes(ctx), ctx.config.max_batch_size,
                                  ctx.artifacts["kv_capacity"].max_blocks_per_seq)
        runner.capture(threads_for(ctx.device), ctx.artifacts.get("compile_workers"), memory_pool)
        memory = f", {runner.memory_bytes / 2**20:.0f} MiB" if ctx.device.type == "cuda" else ""
        compiled = f", {runner.precompiled} kernels compiled on threads first" if runner.precompiled else ""
        return runner, (f"whole-step graphs: {runner.describe()} captured in {runner.capture_seconds:.1f} s{memory}, "
                        f"metadata buffers {runner.buffer_bytes / 2**10:.0f} KiB{compiled}")

    def _no_mixed_graphs(self, ctx: CompileContext) -> str | None:
        """Why prefill and mixed steps get no whole-step graphs (None: they do)."""
        cuda = ctx.device.type == "cuda"
        if not self.config.mixed_graphs:
            return "whole-step graphs: off (passes.compile_cuda_graphs.mixed_graphs=false)"
        if not cuda and not self.config.mixed_graphs_on_cpu:
            return "whole-step graphs: not on CUDA"
        if (why := _uncapturable(ctx, capturable=())) is not None:
            return f"whole-step graphs skipped: {why}"
        if "state_is_kv_only" not in ctx.properties:
            return "whole-step graphs skipped: check_uncached_state did not prove padding rows stay apart"
        if not any(sequence_buckets(t, ctx.config.max_batch_size) for t in self._token_sizes(ctx)):
            return "whole-step graphs: no token bucket of more than one token asked for"
        return None

    def _token_sizes(self, ctx: CompileContext) -> list[int]:
        """The token buckets of piecewise and whole-step graphs, at most ``max_num_tokens``."""
        max_tokens = ctx.config.max_num_tokens
        wanted = default_piecewise_sizes(max_tokens) if self.config.piecewise_sizes is None else self.config.piecewise_sizes
        return sorted({min(s, max_tokens) for s in wanted if s >= 1})


def _uncapturable(ctx: CompileContext, capturable=DECODE_CAPTURABLE_OPS) -> str | None:
    """Why a whole step cannot be one CUDA graph: an attention backend that synchronizes with the host
    (on CUDA: the CPU stand-in calls any backend), or an op that does (see :func:`_host_sync`)."""
    backend = ctx.artifacts["attention_backend"]
    if ctx.device.type == "cuda" and not ATTENTION_BACKENDS.get(backend).capturable:
        return f"attention backend '{backend}' cannot be captured"
    return _host_sync(ctx, capturable)


def _host_sync(ctx: CompileContext, capturable=DECODE_CAPTURABLE_OPS) -> str | None:
    """Why a step cannot be captured whole: the first op that synchronizes with the host on it
    (``capturable``: the ops that do not on such a step; by default a decode step's)."""
    for node in ctx.gm.graph.nodes:
        if node.op == "call_function" and node.target in HOST_SYNC_OPS and node.target not in capturable:
            layers = layers_of([node])
            where = f" ({layers[0]})" if layers else ""
            return f"{node.target}{where} {HOST_SYNC_OPS[node.target]}"
    return None
