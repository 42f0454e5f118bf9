"""Every cuBLASLt algorithm its heuristic offers for the 8B decode GEMMs, each timed (needs a GPU).

torch runs a GEMM with cuBLAS, or with cuBLASLt's first heuristic answer (``blas_choice`` picks
between the two per shape). TensorRT-LLM's GEMM plugin asks cuBLASLt for many candidate algorithms
per row bucket and keeps the fastest. This probe does that through ctypes (no extra package): for
each linear of the Llama-3.1-8B shape at a few row counts it lists up to ``--algos`` heuristic
answers, checks each against ``F.linear`` and times it in a CUDA graph over rotating weight copies
(past the L2), next to torch's cuBLAS and cuBLASLt, and prints the best algorithm's tile, split-K
and stages. The per-layer sums say what a per-shape algorithm choice could take off a decode step.

    python bench/cublaslt_algos.py --rows 64,256,512
"""

from __future__ import annotations

import argparse
import ctypes
import math
import sys

import torch
import torch.nn.functional as F

from decode_bench import copy_bandwidth  # timed eagerly: a graph's memcpy node runs on a copy engine (~2.7 TB/s)
from gpu_harness import graph_us, rel_err, sets_for  # this folder

CUDA_R_32F, CUDA_R_16F, CUDA_R_16BF = 0, 2, 14
CUBLAS_COMPUTE_32F = 68
DESC_TRANSA, DESC_TRANSB = 3, 4
PREF_MAX_WORKSPACE_BYTES = 1
OP_N, OP_T = 0, 1
ALGO_ID, TILE_ID, SPLITK_NUM, REDUCTION_SCHEME, CTA_SWIZZLING, CUSTOM_OPTION, STAGES_ID = range(7)
CLUSTER_SHAPE_ID = 13
WORKSPACE_BYTES = 32 << 20
SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}


class Algo(ctypes.Structure):
    _fields_ = [("data", ctypes.c_uint64 * 8)]


class HeuristicResult(ctypes.Structure):
    _fields_ = [("algo", Algo), ("workspace_size", ctypes.c_size_t), ("state", ctypes.c_int),
                ("waves_count", ctypes.c_float), ("reserved", ctypes.c_int * 4)]


def _library() -> ctypes.CDLL:
    """The libcublasLt torch loaded (found in this process's memory map after a GEMM ran)."""
    a = torch.ones(16, 16, device="cuda", dtype=torch.bfloat16)
    torch.backends.cuda.preferred_blas_library("cublaslt")
    a @ a
    torch.backends.cuda.preferred_blas_library("cublas")
    torch.cuda.synchronize()
    with open("/proc/self/maps") as maps:
        paths = sorted({line.split()[-1] for line in maps if "libcublasLt.so" in line})
    return ctypes.CDLL(paths[0] if paths else "libcublasLt.so.13")


class Lt:
    """A cuBLASLt handle and the GEMM ``out[M, N] = x[M, K] @ w[N, K].T`` with a chosen algorithm."""

    def __init__(self):
        self.lib = _library()
        self.handle = ctypes.c_void_p()
        self._check(self.lib.cublasLtCreate(ctypes.byref(self.handle)), "cublasLtCreate")
        self.workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device="cuda")
        self.alpha, self.beta = ctypes.c_float(1.0), ctypes.c_float(0.0)

    @staticmethod
    def _check(status: int, what: str) -> None:
        if status != 0:
            raise RuntimeError(f"{what} failed with cuBLAS status {status}")

    def plan(self, m: int, n: int, k: int, dtype: torch.dtype) -> tuple:
        """(desc, layouts of w, x, out) in cuBLAS's column-major terms: out^T = w^T^T @ x^T."""
        lib, dt = self.lib, {torch.bfloat16: CUDA_R_16BF, torch.float16: CUDA_R_16F}[dtype]
        desc = ctypes.c_void_p()
        self._check(lib.cublasLtMatmulDescCreate(ctypes.byref(desc), CUBLAS_COMPUTE_32F, CUDA_R_32F), "desc")
        for attr, op in ((DESC_TRANSA, OP_T), (DESC_TRANSB, OP_N)):
            value = ctypes.c_int32(op)
            self._check(lib.cublasLtMatmulDescSetAttribute(desc, attr, ctypes.byref(value), 4), "desc attr")
        layouts = []
        for rows, cols, ld in ((k, n, k), (k, m, k), (n, m, n)):
            layout = ctypes.c_void_p()
            self._check(lib.cublasLtMatrixLayoutCreate(ctypes.byref(layout), dt, ctypes.c_uint64(rows),
                                                       ctypes.c_uint64(cols), ctypes.c_int64(ld)), "layout")
            layouts.append(layout)
        return desc, *layouts

    def algorithms(self, plan: tuple, count: int) -> list[HeuristicResult]:
        desc, a, b, c = plan
        pref = ctypes.c_void_p()
        self._check(self.lib.cublasLtMatmulPreferenceCreate(ctypes.byref(pref)), "preference")
        size = ctypes.c_uint64(WORKSPACE_BYTES)
        self._check(self.lib.cublasLtMatmulPreferenceSetAttribute(pref, PREF_MAX_WORKSPACE_BYTES, ctypes.byref(size),
                                                                   8), "preference attr")
        results, found = (HeuristicResult * count)(), ctypes.c_int(0)
        self._check(self.lib.cublasLtMatmulAlgoGetHeuristic(self.handle, desc, a, b, c, c, pref, count, results,
                                                            ctypes.byref(found)), "heuristic")
        return [results[i] for i in range(found.value) if results[i].state == 0]

    def matmul(self, plan: tuple, algo: HeuristicResult, x: torch.Tensor, w: torch.Tensor, out: torch.Tensor) -> None:
        desc, a, b, c = plan
        stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
        self._check(self.lib.cublasLtMatmul(
            self.handle, desc, ctypes.byref(self.alpha), ctypes.c_void_p(w.data_ptr()), a,
            ctypes.c_void_p(x.data_ptr()), b, ctypes.byref(self.beta), ctypes.c_void_p(out.data_ptr()), c,
            ctypes.c_void_p(out.data_ptr()), c, ctypes.byref(algo.algo), ctypes.c_void_p(self.workspace.data_ptr()),
            ctypes.c_size_t(WORKSPACE_BYTES), stream), "cublasLtMatmul")

    def describe(self, algo: HeuristicResult) -> str:
        fields = []
        for name, attr in (("id", ALGO_ID), ("tile", TILE_ID), ("splitK", SPLITK_NUM), ("red", REDUCTION_SCHEME),
                           ("swz", CTA_SWIZZLING), ("stages", STAGES_ID), ("cluster", CLUSTER_SHAPE_ID)):
            value, written = ctypes.c_uint32(0), ctypes.c_size_t(0)
            status = self.lib.cublasLtMatmulAlgoConfigGetAttribute(ctypes.byref(algo.algo), attr, ctypes.byref(value),
                                                                   4, ctypes.byref(written))
            fields.append(f"{name}={value.value if status == 0 else '?'}")
        return " ".join(fields) + f" ws={algo.workspace_size >> 10}K waves={algo.waves_count:.2f}"


def bench_shape(lt: Lt, rows: int, name: str, n: int, k: int, count: int, bandwidth: float) -> dict:
    dtype = torch.bfloat16
    x = torch.randn(rows, k, device="cuda", dtype=dtype)
    weights = [torch.randn(n, k, device="cuda", dtype=dtype) * 0.02 for _ in range(sets_for(n * k * 2))]
    out = torch.empty(rows, n, device="cuda", dtype=dtype)
    want = F.linear(x, weights[0])

    def torch_us(library: str) -> float:
        torch.backends.cuda.preferred_blas_library(library)
        try:
            return graph_us([lambda w=w: F.linear(x, w) for w in weights])
        finally:
            torch.backends.cuda.preferred_blas_library("cublas")

    row = {"name": name, "cublas": torch_us("cublas"), "cublaslt": torch_us("cublaslt"),
           "floor": (n * k * 2 + rows * (n + k) * 2) / bandwidth * 1e6,
           "compute": 2 * rows * n * k / 800e12 * 1e6}
    plan = lt.plan(rows, n, k, dtype)
    timed = []
    for algo in lt.algorithms(plan, count):
        try:
            lt.matmul(plan, algo, x, weights[0], out)
            torch.cuda.synchronize()
            err = rel_err(out, want)
            if not math.isfinite(err) or err > 1e-2:
                print(f"    {name} rows {rows}: {lt.describe(algo)} wrong (rel err {err:.1e})")
                continue
            us = graph_us([lambda w=w, a=algo: lt.matmul(plan, a, x, w, out) for w in weights])
            timed.append((us, algo))
        except RuntimeError as exc:
            print(f"    {name} rows {rows}: {lt.describe(algo)} failed: {exc}")
    timed.sort(key=lambda item: item[0])
    row["algos"] = len(timed)
    row["best"], row["best_algo"] = (timed[0][0], lt.describe(timed[0][1])) if timed else (float("nan"), "-")
    row["heuristic_first"] = _first_us(lt, plan, count, x, weights, out)
    for us, algo in timed[:4]:
        print(f"    {name} rows {rows}: {us:7.1f} us  {lt.describe(algo)}", flush=True)
    return row


def _first_us(lt: Lt, plan: tuple, count: int, x, weights, out) -> float:
    first = lt.algorithms(plan, 1)
    return graph_us([lambda w=w: lt.matmul(plan, first[0], x, w, out) for w in weights]) if first else float("nan")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="64,256,512")
    parser.add_argument("--algos", type=int, default=32, help="heuristic answers to ask for per shape")
    args = parser.parse_args()
    torch.manual_seed(0)
    lt = Lt()
    bandwidth = copy_bandwidth()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, copy {bandwidth / 1e12:.2f} TB/s", flush=True)
    head = f"{'rows':>5} {'linear':<8}{'floor':>8}{'cuBLAS':>8}{'Lt':>8}{'Lt #1':>8}{'best':>8}{'algos':>6}  best algorithm"
    lines = [head]
    for rows in (int(r) for r in args.rows.split(",")):
        totals = dict.fromkeys(("floor", "cublas", "cublaslt", "heuristic_first", "best"), 0.0)
        for name, (n, k) in SHAPES.items():
            row = bench_shape(lt, rows, name, n, k, args.algos, bandwidth)
            floor = max(row["floor"], row["compute"])
            lines.append(f"{rows:>5} {name:<8}{floor:>8.1f}{row['cublas']:>8.1f}{row['cublaslt']:>8.1f}"
                         f"{row['heuristic_first']:>8.1f}{row['best']:>8.1f}{row['algos']:>6}  {row['best_algo']}")
            for key in totals:
                totals[key] += floor if key == "floor" else row[key]
        lines.append(f"{rows:>5} {'layer':<8}{totals['floor']:>8.1f}{totals['cublas']:>8.1f}{totals['cublaslt']:>8.1f}"
                     f"{totals['heuristic_first']:>8.1f}{totals['best']:>8.1f}")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
