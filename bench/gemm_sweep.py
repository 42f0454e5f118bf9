"""Skinny GEMMs of a decode step on one GPU: cuBLAS (both weight layouts) against a Triton GEMV sweep.

The batch-1 profile of the 8B shape shows cuBLAS reaching 4.2 TB/s on gate_up but only ~3.1 TB/s
on qkv and o_proj (split-K picks plus a reduce kernel). This prints, per projection and batch,
the time inside a CUDA graph (weights rotated through copies larger than L2) and TB/s for:

- ``linear``:  ``F.linear(x, w)`` with ``w`` [N, K] (what the compiled graph runs today)
- ``x @ wt``:  ``wt`` stored [K, N]
- ``triton``:  the best of a small sweep of a Triton skinny GEMM (BLOCK_N x BLOCK_K, stages)

    python bench/gemm_sweep.py
"""

from __future__ import annotations

import functools
import itertools

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

import gpu_harness  # the CUDA-graph timing harness (this folder)

SHAPES = {
    "llama8b": {"qkv": (4096, 6144), "o_proj": (4096, 4096), "gate_up": (4096, 28672), "down": (14336, 4096)},
    "smollm2": {"qkv": (576, 960), "o_proj": (576, 576), "gate_up": (576, 3072), "down": (1536, 576),
                "lm_head": (576, 49152)},
}
L2_BYTES = 60 << 20


@triton.jit
def _skinny_gemm(x_ptr, w_ptr, out_ptr, M, N, K, stride_xm, stride_wn, stride_om,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.arange(0, BLOCK_M)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        ks = k + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + rows[:, None] * stride_xm + ks[None, :], mask=(rows[:, None] < M) & (ks[None, :] < K), other=0.0)
        w = tl.load(w_ptr + cols[None, :] * stride_wn + ks[:, None], mask=(cols[None, :] < N) & (ks[:, None] < K), other=0.0)
        acc = tl.dot(x, w, acc)
    tl.store(out_ptr + rows[:, None] * stride_om + cols[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=(rows[:, None] < M) & (cols[None, :] < N))


def skinny_gemm(x, w, out, block_n, block_k, stages, warps):
    m, k = x.shape
    n = w.shape[0]
    _skinny_gemm[(triton.cdiv(n, block_n),)](x, w, out, m, n, k, x.stride(0), w.stride(0), out.stride(0),
                                            BLOCK_M=max(16, triton.next_power_of_2(m)), BLOCK_N=block_n,
                                            BLOCK_K=block_k, num_stages=stages, num_warps=warps)


def graph_us(fn_per_copy, copies: int, reps: int = 20) -> float:
    """Median time of one call inside a CUDA graph that cycles through ``copies`` weight copies."""
    return gpu_harness.graph_us([functools.partial(fn_per_copy, i) for i in range(copies)], reps)


def main() -> None:
    import argparse

    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", default="llama8b", choices=sorted(SHAPES))
    parser.add_argument("--batches", default="1,8,64")
    args = parser.parse_args()
    torch.manual_seed(0)
    print(f"{'proj':<8}{'M':>4} {'impl':<34}{'us':>8}{'TB/s':>7}{'rel err':>9}")
    for name, (k, n) in SHAPES[args.shape].items():
        wbytes = k * n * 2
        copies = max(2, -(-4 * L2_BYTES // wbytes))
        ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5 for _ in range(copies)]
        wts = [w.t().contiguous() for w in ws]
        for m in (int(b) for b in args.batches.split(",")):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
            ref = F.linear(x, ws[0]).float()
            rows = [("linear", graph_us(lambda i: F.linear(x, ws[i]), copies)),
                    ("x @ wt", graph_us(lambda i: torch.mm(x, wts[i]), copies))]
            best = None
            for bn, bk, st, wp in itertools.product((16, 32, 64), (128, 256), (3, 4), (4,)):
                if (m > 16 and bn < 32) or bk > triton.next_power_of_2(k):
                    continue
                try:
                    skinny_gemm(x, ws[0], out, bn, bk, st, wp)
                    err = ((out.float() - ref).norm() / ref.norm()).item()
                    us = graph_us(lambda i: skinny_gemm(x, ws[i], out, bn, bk, st, wp), copies, reps=7)
                except Exception as exc:  # out of shared memory for this config
                    print(f"  skip {bn}x{bk} s{st} w{wp}: {type(exc).__name__}")
                    continue
                if best is None or us < best[1]:
                    best = (f"triton n{bn} k{bk} s{st} w{wp}", us, err)
            for label, us in rows:
                print(f"{name:<8}{m:>4} {label:<34}{us:>8.1f}{wbytes / us / 1e6:>7.2f}{'':>9}", flush=True)
            if best:
                print(f"{name:<8}{m:>4} {best[0]:<34}{best[1]:>8.1f}{wbytes / best[1] / 1e6:>7.2f}{best[2]:>9.1e}",
                      flush=True)
        del ws, wts
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
