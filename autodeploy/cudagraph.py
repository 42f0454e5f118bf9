"""CUDA graphs: the capture primitives every step graph uses, and the graphs of decode steps.

:class:`CudaStepGraph` captures a graph module's launches at fixed input addresses into one memory
pool shared by every graph of a model (decode and piecewise, replayed one at a time, in capture
order within a step); :class:`DirectStepGraph` is its stand-in on the CPU (the same contract, the
module called again on every replay), so the code around captures runs in CPU tests. A capture that
fails names the op it failed at (:class:`CaptureError`); every capture is announced to the
listeners of :func:`on_capture` (a server counts those after it said it is ready: none expected).

Decode steps (one token per sequence): launch overhead dominates small decode steps, so each decode
batch size in ``batch_sizes`` is captured once (largest first) and replayed: a step of ``B``
sequences runs the graph of the smallest captured size ``>= B``, padded (padding tokens write no
cache slot, padding sequences have no tokens). Static inputs live in one device buffer per graph,
refilled by a single host-to-device copy. Other steps run piecewise (``autodeploy.piecewise``) or
eagerly.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator

import torch
from torch import fx

from .errors import AutoDeployError
from .graph.modules import layers_of
from .kvcache.metadata import BatchMetadata, DeferredTokens, Padding, SequenceChunk, StepBuffers
from .kvcache.pool import KVPool

log = logging.getLogger("autodeploy.cudagraph")

_listeners: list[Callable[[str], None]] = []


def on_capture(listener: Callable[[str], None]) -> Callable[[], None]:
    """Call ``listener(what)`` at every capture from now on (any thread); returns the unsubscribe."""
    _listeners.append(listener)
    return lambda: _listeners.remove(listener)


@contextlib.contextmanager
def counting_captures() -> Iterator[list[str]]:
    """Inside, what every capture captured is appended to the yielded list."""
    seen: list[str] = []
    unsubscribe = on_capture(seen.append)
    try:
        yield seen
    finally:
        unsubscribe()


def _announce(what: str) -> None:
    for listener in list(_listeners):
        listener(what)


class CaptureError(AutoDeployError):
    """An op cannot run inside a CUDA graph; the message names it, its layer and the switch that
    leaves those steps eager."""

    def __init__(self, node: fx.Node, what: str, switch: str, cause: BaseException):
        layers = layers_of([node])
        weights = [a.name for a in node.all_input_nodes if a.op in ("get_attr", "placeholder") and "weight" in a.name]
        where = f" in {layers[0]}" if layers else f" reading {', '.join(weights)}" if weights else ""
        super().__init__(
            f"{node.target} (node {node.name}{where}) cannot be captured in a CUDA graph while capturing {what}: "
            f"{type(cause).__name__}: {cause}; compile with --set passes.compile_cuda_graphs.{switch} to run "
            "these steps eagerly")


class _NamingFailures(fx.Interpreter):
    """Runs a graph node by node; a node that raises is named in a :class:`CaptureError`."""

    def __init__(self, module: fx.GraphModule, what: str, switch: str):
        super().__init__(module)
        self.extra_traceback, self.what, self.switch = False, what, switch

    def run_node(self, node: fx.Node):
        try:
            return super().run_node(node)
        except CaptureError:
            raise
        except Exception as exc:
            raise CaptureError(node, self.what, self.switch, exc) from exc


class CudaStepGraph:
    """One CUDA graph of ``module(*args)`` in ``pool``: a replay reads the captured input tensors
    and writes the captured outputs. ``weak_outputs``: the outputs' memory goes back to the pool
    once the caller drops them (later captures reuse it: valid only while graphs replay in capture
    order and the outputs are consumed before the next replay); else they stay allocated."""

    def __init__(self, pool, stream: torch.cuda.Stream, weak_outputs: bool):
        self.pool, self.stream, self.weak_outputs = pool, stream, weak_outputs
        self.graph = torch.cuda.CUDAGraph()
        self.outputs = None

    def capture(self, module: fx.GraphModule, args: tuple, what: str, switch: str):
        """Warm up (lazy initialisation, BLAS choices: outside the capture), capture, replay once (the
        outputs hold values, as a direct call's would), return the outputs (owned by the caller until
        it drops them)."""
        self.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.stream):
            module(*args)
            self.graph.capture_begin(pool=self.pool)
            try:
                outputs = _NamingFailures(module, what, switch).run(*args)
            except BaseException:
                with contextlib.suppress(Exception):  # the capture is broken: the op's error is the one to see
                    self.graph.capture_end()
                raise
            self.graph.capture_end()
            self.graph.replay()
        torch.cuda.current_stream().wait_stream(self.stream)
        self.outputs = weak(outputs) if self.weak_outputs else outputs
        _announce(what)
        return outputs

    def replay(self):
        self.graph.replay()
        return self.outputs


class DirectStepGraph:
    """The CPU stand-in of :class:`CudaStepGraph`: a replay calls the module again on the captured
    input tensors and writes the results into the captured outputs, as a graph would."""

    def __init__(self, *_):
        self.module, self.args, self.outputs = None, (), None

    def capture(self, module: fx.GraphModule, args: tuple, what: str, switch: str):
        self.module, self.args = module, args
        self.outputs = _NamingFailures(module, what, switch).run(*args)
        _announce(what)
        return self.outputs

    def replay(self):
        _write_into(self.outputs, self.module(*self.args))
        return self.outputs


def _write_into(static, fresh) -> None:
    if isinstance(static, torch.Tensor):
        static.copy_(fresh)
    elif isinstance(static, (tuple, list)):
        for s, f in zip(static, fresh):
            _write_into(s, f)
    elif static != fresh:
        raise RuntimeError(f"a replayed graph computed {fresh} where its capture computed {static}")


def weak(value):
    """``value`` with every tensor replaced by a view of its memory that does not keep it allocated."""
    if isinstance(value, torch.Tensor):
        storage = value.untyped_storage()
        alias = torch._C._construct_storage_from_data_pointer(storage.data_ptr(), value.device, storage.nbytes())
        return torch.empty(0, dtype=value.dtype, device=value.device).set_(
            alias, value.storage_offset(), value.size(), value.stride())
    if isinstance(value, (tuple, list)):
        return type(value)(weak(v) for v in value)
    return value


def graph_inputs(gm: fx.GraphModule, inputs: dict[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """``inputs`` in the order of ``gm``'s placeholders."""
    return tuple(inputs[node.name] for node in gm.graph.find_nodes(op="placeholder"))


def dummy_step_inputs(gm: fx.GraphModule, pool: KVPool, pad: Padding, buffers: StepBuffers) -> tuple[torch.Tensor, ...]:
    """The inputs of a step captured at ``pad``, staged in ``buffers``: one real dummy sequence writing slot 0
    of block 0 (overwritten before anyone reads it), the rest padding; in ``gm``'s placeholder order."""
    static = BatchMetadata.build([SequenceChunk((0,), 0, (0,))], pool.block_size, buffers.device, pad=pad,
                                 buffers=buffers)
    return graph_inputs(gm, {**static.as_kwargs(), **pool.as_kwargs()})


def default_batch_sizes(max_batch_size: int) -> list[int]:
    """1, 2, 4, 8, 16, 32, then every 32 up to max_batch_size (vLLM/TRT-LLM use similar ladders)."""
    sizes = {s for s in (1, 2, 4, 8, 16, 32) if s <= max_batch_size}
    sizes.update(range(64, max_batch_size + 1, 32))
    sizes.add(max_batch_size)
    return sorted(sizes)


class _Captured:
    def __init__(self, graph: CudaStepGraph, buffers: StepBuffers, pad: Padding, output: torch.Tensor):
        self.graph, self.buffers, self.pad, self.output = graph, buffers, pad, output


class CudaGraphRunner:
    def __init__(self, gm: fx.GraphModule, pool: KVPool, batch_sizes: list[int], max_blocks: int):
        self.gm, self.pool, self.max_blocks = gm, pool, max_blocks
        self.batch_sizes = sorted(batch_sizes)
        self.graphs: dict[int, _Captured] = {}
        self.capture_seconds = 0.0
        self.precompiled = 0  # kernels compiled on threads before the captures

    def capture(self, compile_threads: int = 1, compile_workers=None, memory_pool=None) -> None:
        """Capture every batch size, largest first, into ``memory_pool`` (default: a new one). With
        ``compile_threads`` > 1 the Triton kernels the warm-up forwards would compile one at a time (a
        fresh host: 1-3 s each) compile on that many threads first (``kernels/precompile.py``; with
        ``compile_workers``, in those processes first)."""
        from .kernels.precompile import precompile

        start = time.perf_counter()
        sizes = sorted(self.batch_sizes, reverse=True)
        statics = {size: self._static_step(size) for size in sizes}

        def forwards():
            with torch.inference_mode():
                for _, _, inputs in statics.values():
                    self.gm(*inputs)

        self.precompiled = precompile(forwards, self.pool.caches[0].device, compile_threads, compile_workers)
        memory_pool = memory_pool if memory_pool is not None else torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream()
        with torch.inference_mode():
            for size in sizes:
                buffers, pad, inputs = statics[size]
                graph = CudaStepGraph(memory_pool, stream, weak_outputs=False)
                output = graph.capture(self.gm, inputs, f"the decode step of {size} sequences", "batch_sizes=[]")
                self.graphs[size] = _Captured(graph, buffers, pad, output)
        torch.cuda.synchronize()
        self.capture_seconds = time.perf_counter() - start
        log.info("captured CUDA graphs for decode batch sizes %s in %.1f s", self.batch_sizes, self.capture_seconds)

    def _static_step(self, size: int) -> tuple[StepBuffers, Padding, tuple[torch.Tensor, ...]]:
        """The captured step's own input buffers, its padding and the graph's inputs (``dummy_step_inputs``)."""
        pad = Padding(num_tokens=size, num_seqs=size, max_blocks=self.max_blocks)
        buffers = StepBuffers(pad.metadata_size, self.pool.caches[0].device)
        return buffers, pad, dummy_step_inputs(self.gm, self.pool, pad, buffers)

    def fits(self, chunks: list[SequenceChunk]) -> bool:
        return (
            bool(self.graphs)
            and len(chunks) <= self.batch_sizes[-1]
            and all(len(c.token_ids) == 1 and c.num_logits == 1 for c in chunks)
            and max(len(c.block_ids) for c in chunks) <= self.max_blocks
        )

    def run(self, chunks: list[SequenceChunk], deferred: DeferredTokens | None = None, publisher=None) -> torch.Tensor:
        """Logits of a decode step; valid until the next replay of the same graph. ``publisher``
        (tensor parallel, rank 0) sends the staged inputs to the other ranks before the replay."""
        size = next(s for s in self.batch_sizes if s >= len(chunks))
        captured = self.graphs[size]
        BatchMetadata.refill(chunks, self.pool.block_size, captured.pad, captured.buffers)
        if deferred is not None:
            deferred.write(captured.buffers.input_ids(captured.pad.num_tokens))
        if publisher is not None:
            publisher.graph(size, self.staged_input(size))
        captured.graph.replay()
        return captured.output[: len(chunks)]

    def staged_input(self, size: int) -> torch.Tensor:
        """The device buffer the graph of ``size`` sequences reads its metadata from."""
        captured = self.graphs[size]
        return captured.buffers.dev[: captured.pad.metadata_size]

    def replay(self, size: int) -> torch.Tensor:
        """Replay the graph of ``size`` sequences on whatever its staged input holds (the other
        tensor-parallel ranks receive rank 0's staged input, then replay)."""
        captured = self.graphs[size]
        captured.graph.replay()
        return captured.output
