"""Can the cuBLAS GEMMs of a captured decode step join the PDL chain of our kernels? (H200 probe)

Our Triton kernels overlap their launch and ramp with the kernel before them (``kernels/pdl.py``); the
cuBLAS GEMMs between them cannot be launched that way from torch, but the edges of a captured CUDA graph
can be made programmatic afterwards (driver API, ``torch.cuda.CUDAGraph(keep_graph=True)``). That is
only correct if the GEMM kernel executes ``griddepcontrol.wait`` before it reads its inputs, which
cuBLAS does not document for its ``nvjet`` kernels. Three measurements, at 64 rows of the 8B shape:

1. a slow writer (PDL, lets dependents launch at once, spins, then writes x) -> the GEMM reading x, the
   edge made programmatic: the GEMM's output is right only if it waited (each projection's kernel);
2. the GEMM -> a PDL kernel stamping its start and its wait's release: an early start means the GEMM
   lets dependents launch before it ends;
3. a 32-layer chain (norm -> qkv -> o -> add+norm -> gate/up -> SiLU -> down) with default edges, then
   with programmatic edges into the GEMMs (from the norms only, from every Triton kernel, from every
   kernel): replay time, and whether the output stays bitwise equal.

    python bench/cublas_pdl_probe.py
"""

from __future__ import annotations

import ctypes

import kernels_only  # noqa: F401  (autodeploy.kernels without transformers; this folder)

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from autodeploy.kernels.activation import act_mul  # noqa: E402
from autodeploy.kernels.norm import add_rms_norm, rms_norm  # noqa: E402

V = ctypes.c_void_p
_CUDA: list[ctypes.CDLL] = []


def _driver() -> ctypes.CDLL:
    if not _CUDA:
        _CUDA.append(ctypes.CDLL("libcuda.so.1"))
    return _CUDA[0]


class EdgeData(ctypes.Structure):
    """CUgraphEdgeData."""

    _fields_ = [("from_port", ctypes.c_ubyte), ("to_port", ctypes.c_ubyte), ("type", ctypes.c_ubyte),
                ("reserved", ctypes.c_ubyte * 5)]


class KernelParams(ctypes.Structure):
    """CUDA_KERNEL_NODE_PARAMS_v2."""

    _fields_ = [("func", V), ("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3),
                ("shmem", ctypes.c_uint), ("params", V), ("extra", V), ("kern", V), ("ctx", V)]


def check(rc, what=""):
    if rc != 0:
        s = ctypes.c_char_p()
        _driver().cuGetErrorString(rc, ctypes.byref(s))
        raise RuntimeError(f"{what}: CUDA error {rc} {s.value}")


def edges(graph) -> list[tuple[int, int, EdgeData]]:
    """(from node, to node, edge data) of every edge of a cudaGraph_t."""
    n = ctypes.c_size_t(0)
    check(_driver().cuGraphGetEdges_v2(V(graph), None, None, None, ctypes.byref(n)), "edges")
    frm, to, data = (V * n.value)(), (V * n.value)(), (EdgeData * n.value)()
    check(_driver().cuGraphGetEdges_v2(V(graph), frm, to, data, ctypes.byref(n)), "edges")
    return [(frm[i], to[i], data[i]) for i in range(n.value)]


def name(node) -> str:
    """The kernel's name of a kernel node, ``<node type N>`` for other nodes."""
    kind = ctypes.c_int()
    check(_driver().cuGraphNodeGetType(V(node), ctypes.byref(kind)), "node type")
    if kind.value != 0:  # CU_GRAPH_NODE_TYPE_KERNEL
        return f"<node type {kind.value}>"
    params = KernelParams()
    check(_driver().cuGraphKernelNodeGetParams_v2(V(node), ctypes.byref(params)), "kernel params")
    text = ctypes.c_char_p()
    if params.func:
        rc = _driver().cuFuncGetName(ctypes.byref(text), V(params.func))
    else:
        rc = _driver().cuKernelGetName(ctypes.byref(text), V(params.kern))
    return text.value.decode() if rc == 0 and text.value else f"<kernel rc {rc}>"


def is_ours(kernel: str) -> bool:
    """Triton kernels keep their Python names (ours start with an underscore)."""
    return kernel.startswith("_") or kernel in ("slow_writer", "stamp_probe")


def is_gemm(kernel: str) -> bool:
    return not kernel.startswith("<") and not is_ours(kernel)


PROGRAMMATIC_PORT, PROGRAMMATIC_TYPE = 1, 1  # what stream capture gives a Triton launch with launch_pdl


def make_programmatic(graph, into, from_ours_only: bool = True,
                      sources: tuple[str, ...] | None = None) -> int:
    """Turn the default edges into kernel nodes that ``into`` accepts into programmatic ones; how many."""
    count = 0
    for frm, to, data in edges(graph):
        source = name(frm)
        if data.type != 0 or not into(name(to)) or (from_ours_only and not is_ours(source)):
            continue
        if sources is not None and source not in sources:
            continue
        f, t = V(frm), V(to)
        check(_driver().cuGraphRemoveDependencies_v2(V(graph), ctypes.byref(f), ctypes.byref(t),
                                                     ctypes.byref(data), 1), "remove edge")
        new = EdgeData(PROGRAMMATIC_PORT, 0, PROGRAMMATIC_TYPE)
        check(_driver().cuGraphAddDependencies_v2(V(graph), ctypes.byref(f), ctypes.byref(t),
                                                  ctypes.byref(new), 1), "add edge")
        count += 1
    return count


def capture(fn):
    """A CUDA graph of ``fn`` kept un-instantiated (its edges can still change), and fn's output."""
    graph = torch.cuda.CUDAGraph(keep_graph=True)
    fn()
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out


@triton.jit
def _now(dep):
    return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l,r", [dep], dtype=tl.int64,
                                     is_pure=False, pack=1)


@triton.jit
def slow_writer(x_ptr, n, spin_ns):
    """Lets the next kernel launch at once, then writes x only after ``spin_ns``."""
    tl.extra.cuda.gdc_launch_dependents()
    tl.extra.cuda.gdc_wait()
    t0 = _now(n)
    t = t0
    while t - t0 < spin_ns:
        t = _now(n)
    offs = tl.program_id(0) * 1024 + tl.arange(0, 1024)
    tl.store(x_ptr + offs, (offs % 7 + 1).to(tl.bfloat16), mask=offs < n)


@triton.jit
def stamp_probe(out_ptr, src_ptr):
    """Each program's start and the release of its PDL wait, on the global clock."""
    t0 = _now(tl.program_id(0))
    tl.extra.cuda.gdc_wait()
    t1 = _now(tl.load(src_ptr + tl.program_id(0)).to(tl.int32))
    tl.store(out_ptr + tl.program_id(0) * 2, t0)
    tl.store(out_ptr + tl.program_id(0) * 2 + 1, t1)


SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}  # (N, K)
ROWS = 64


def probe_wait(lib: str, spin_ns: int) -> None:
    """1: the GEMM after a slow writer, on a programmatic edge: right only if the GEMM waited."""
    torch.backends.cuda.preferred_blas_library(lib)
    for label, (n, k) in SHAPES.items():
        x = torch.zeros(ROWS, k, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / 64
        grid = (triton.cdiv(x.numel(), 1024),)

        def step(x=x, w=w, grid=grid):
            x.zero_()
            slow_writer[grid](x, x.numel(), spin_ns, launch_pdl=True)
            return x @ w.T

        graph, out = capture(step)
        kernels = [name(t) for _, t, _ in edges(graph.raw_cuda_graph())]
        made = make_programmatic(graph.raw_cuda_graph(), is_gemm)
        graph.instantiate()
        graph.replay()
        torch.cuda.synchronize()
        slow_writer[grid](x, x.numel(), 0)
        want = (x @ w.T).float()
        err = ((out.float() - want).norm() / want.norm()).item()
        verdict = "waits" if err < 1e-3 else "READ EARLY"
        print(f"  [{lib}] {label}, writer spins {spin_ns // 1000} us: {made} edge(s) made programmatic; "
              f"rel err {err:.2e} ({verdict}); kernels {kernels}")


def probe_trigger(lib: str) -> None:
    """2: how long the next PDL kernel's programs wait for the GEMM (0: it launched only at the end)."""
    torch.backends.cuda.preferred_blas_library(lib)
    for label, (n, k) in SHAPES.items():
        x = torch.randn(ROWS, k, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        stamps = torch.zeros(132 * 2, dtype=torch.int64, device="cuda")

        def step(x=x, w=w, stamps=stamps):
            y = x @ w.T
            stamp_probe[(132,)](stamps, y, launch_pdl=True)
            return y

        graph, _ = capture(step)
        graph.instantiate()
        for _ in range(3):
            graph.replay()
        torch.cuda.synchronize()
        s = stamps.view(132, 2).double()
        waited = (s[:, 1] - s[:, 0]) / 1e3
        quantiles = f"{waited.min():.2f} / {waited.median():.2f} / {waited.max():.2f}"
        print(f"  [{lib}] {label}: the next kernel's programs waited {quantiles} us (min / median / max) "
              "for the GEMM")


def probe_chain(lib: str, layers: int = 32) -> None:
    """3: the linears and norms of ``layers`` layers at 64 rows, default vs programmatic edges into GEMMs."""
    torch.backends.cuda.preferred_blas_library(lib)
    torch.manual_seed(0)
    weights = [{key: torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5
                for key, (n, k) in SHAPES.items()} for _ in range(layers)]
    norm_w = torch.ones(4096, device="cuda", dtype=torch.bfloat16)
    h0 = torch.randn(ROWS, 4096, device="cuda", dtype=torch.bfloat16)

    def step():
        h = residual = h0
        for layer in weights:
            qkv = rms_norm(h, norm_w, 1e-5) @ layer["qkv"].T
            x, residual = add_rms_norm(qkv[:, :4096] @ layer["o"].T, residual, norm_w, 1e-5)
            gate_up = x @ layer["gate_up"].T
            h = act_mul(gate_up[:, :14336], gate_up[:, 14336:]) @ layer["down"].T
        return h

    results = {}
    for mode in ("default", "norm->gemm", "ours->gemm", "all->gemm"):
        graph, out = capture(step)
        made = 0
        if mode != "default":
            made = make_programmatic(graph.raw_cuda_graph(), is_gemm, from_ours_only=mode != "all->gemm",
                                     sources=("_rms_norm_kernel",) if mode == "norm->gemm" else None)
        graph.instantiate()
        for _ in range(5):
            graph.replay()
        times = []
        for _ in range(30):
            start, end = torch.cuda.Event(True), torch.cuda.Event(True)
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        results[mode] = (sorted(times)[len(times) // 2], out.clone(), made)
    base = results["default"][1]
    for mode, (ms, out, made) in results.items():
        same = "bitwise equal" if torch.equal(out, base) else "DIFFERS"
        print(f"  [{lib}] {layers} layers x {ROWS} rows, {mode:<11}: {ms * 1e3:8.1f} us per replay "
              f"({made} edges made programmatic), output {same}")


def main() -> None:
    print(torch.__version__, triton.__version__, torch.cuda.get_device_name())
    for lib in ("cublas", "cublaslt"):
        probe_trigger(lib)
        for spin_ns in (30_000, 200_000):
            probe_wait(lib, spin_ns)
    for lib in ("cublas", "cublaslt"):
        probe_chain(lib)


if __name__ == "__main__":
    main()
