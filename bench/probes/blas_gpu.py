"""cuBLAS against cuBLASLt for every linear of a model shape, by rows: the table behind ``ops/blas_choice.py``.

Each GEMM runs alone in a CUDA graph over rotating weight copies (no L2 reuse), once through each
library (``torch.backends.cuda.preferred_blas_library``), and once through ``blas_choice.linear``
with the choice it times (``chosen``). Printed: us per GEMM and the choice, then per layer.

    python bench/blas_gpu.py [--shape llama8b] [--rows 8,16,32,64,128,256,512,8192]
"""

from __future__ import annotations

import argparse

import kernels_only  # noqa: F401  (autodeploy.ops without transformers; this folder)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from gpu_harness import DEV, graph_us, sets_for  # noqa: E402

from autodeploy.ops import blas_choice  # noqa: E402

SHAPES = {  # name -> {linear: (N, K)}
    "llama8b": {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336),
                "lm_head": (128256, 4096)},
    "smollm2": {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536),
                "lm_head": (49152, 576)},
}
LAYER_LINEARS = ("qkv", "o", "gate_up", "down")


def time_gemm(x: torch.Tensor, weights: list[torch.Tensor], library: str | None) -> float:
    """us per GEMM; ``library`` None: through blas_choice.linear."""
    if library is None:
        return graph_us([(lambda w: lambda: blas_choice.linear(x, w))(w) for w in weights])
    with blas_choice.preferred_blas(library):
        return graph_us([(lambda w: lambda: F.linear(x, w))(w) for w in weights])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="llama8b", choices=sorted(SHAPES))
    parser.add_argument("--rows", default="8,16,32,64,128,256,512,8192")
    args = parser.parse_args()
    rows_list = [int(r) for r in args.rows.split(",")]
    print(f"torch {torch.__version__} | {torch.cuda.get_device_name(0)} | {args.shape}", flush=True)
    print(f"{'linear':<8}{'rows':>6}{'cublas us':>11}{'cublaslt us':>13}{'chosen us':>11}  choice", flush=True)
    per_layer: dict[int, list[float]] = {}
    for name, (n, k) in SHAPES[args.shape].items():
        weights = [torch.randn(n, k, device=DEV, dtype=torch.bfloat16) / k**0.5
                   for _ in range(sets_for(2 * n * k, cap=16))]
        for rows in rows_list:
            x = torch.randn(rows, k, device=DEV, dtype=torch.bfloat16)
            times = [time_gemm(x, weights, lib) for lib in (blas_choice.CUBLAS, blas_choice.CUBLASLT, None)]
            choice = blas_choice.CHOOSER.backend(x, weights[0], None) or "torch default"
            print(f"{name:<8}{rows:>6}{times[0]:>11.1f}{times[1]:>13.1f}{times[2]:>11.1f}  {choice}", flush=True)
            if name in LAYER_LINEARS:
                per_layer[rows] = [a + b for a, b in zip(per_layer.get(rows, [0.0] * 3), times)]
        del weights
    for rows, (cublas, lt, chosen) in per_layer.items():
        print(f"per layer, {rows} rows: cuBLAS {cublas:.1f} us, cuBLASLt {lt:.1f}, chosen {chosen:.1f}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
