"""GPU check of the quantized linears once the kernels (``autodeploy/kernels/quant_gemv.py``,
``quant_gemm.py``) are in: every format through the op's CUDA dispatch against the torch reference,
at the GEMV's and the GEMM's row counts, then every producer fixture through the canary on CUDA.

    python bench/quant_gpu.py            # prints one table; exit 1 on a failed row

The GEMV (<= 4 rows) does not round activations to FP8 (the reference does): its rows are compared
with the weight-only reference; GEMM rows with the full reference. bf16 inputs; tolerance 2% of the
output's largest magnitude. On a machine without CUDA it runs the reference against itself (a smoke
test of the script).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

import autodeploy.ops  # noqa: F401  (registers the ops)
from autodeploy.ops import quant_linear as ql
from autodeploy.quantization import numerics as nm

FIXTURES = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "quant"
ROWS = (1, 4, 5, 64, 300)
N, K = (4096, 4096) if torch.cuda.is_available() else (256, 256)  # the CPU smoke run stays small


def fp8_cases(device):
    w = torch.randn(N, K, device=device) * 0.02
    tensor, channel, block = nm.quantize_fp8_per_tensor(w), nm.quantize_fp8_per_channel(w), nm.quantize_fp8_blocks(
        w, (128, 128))
    return {
        "fp8 tensor static": (*tensor, torch.tensor(0.05, device=device), None, "static"),
        "fp8 channel token": (*channel, None, None, "token"),
        "fp8 channel weight-only": (*channel, None, None, "none"),
        "fp8 block group": (*block, None, [128, 128], "group"),
    }


def nvfp4_cases(device):
    packed, scale, scale_2 = nm.quantize_nvfp4(torch.randn(N, K, device=device) * 0.02)
    return {"nvfp4": (packed, scale, scale_2), "nvfp4 per-row scale_2": (packed, scale, scale_2.expand(N).clone())}


def check(name: str, rows: int, got: torch.Tensor, want: torch.Tensor) -> tuple[str, bool]:
    err = (got.float() - want.float()).abs().max().item() / max(want.float().abs().max().item(), 1e-6)
    ok = bool(torch.isfinite(got).all()) and err <= 0.02
    return f"{name:<24}{rows:>6}{err:>12.2e}  {'ok' if ok else 'FAIL'}", ok


def captured(call, eager: torch.Tensor) -> str:
    """Whether ``call`` (already run eagerly) captures into a CUDA graph whose replay gives ``eager``
    (the engine captures every decode step)."""
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = call()
        graph.replay()
        torch.cuda.synchronize()
        return "graph ok" if torch.equal(out, eager) else "graph FAIL: replay differs"
    except Exception as exc:  # noqa: BLE001 (the row reports it)
        return f"graph FAIL: {type(exc).__name__}: {str(exc).splitlines()[0][:120]}"


def op_row(name: str, rows: int, call, want: torch.Tensor, device) -> tuple[str, bool]:
    got = call()
    line, ok = check(name, rows, got, want)
    if device.type == "cuda":
        graph = captured(call, got)
        line, ok = f"{line}  {graph}", ok and graph == "graph ok"
    print(line, flush=True)
    return line, ok


def op_rows(device) -> list[tuple[str, bool]]:
    out = []
    for rows in ROWS:
        x = torch.randn(rows, K, device=device, dtype=torch.bfloat16)
        gemv = ql.quant_kernel(rows, device.type == "cuda", "fp8", "token") == "gemv"
        for name, (w, s, xs, block, acts) in fp8_cases(device).items():
            want = ql.fp8_linear_reference(x, w, s, xs, None, block, "none" if gemv else acts)
            out.append(op_row(name, rows, lambda: ql._fp8(x, w, s, xs, None, block, acts), want, device))
        for name, (packed, scale, scale_2) in nvfp4_cases(device).items():
            want = ql.nvfp4_linear_reference(x, packed, scale, scale_2, None)
            out.append(op_row(name, rows, lambda: ql._nvfp4(x, packed, scale, scale_2, None), want, device))
    return out


def canary_rows(device) -> list[tuple[str, bool]]:
    from autodeploy.check import run_check

    out = []
    for path in sorted(p for p in FIXTURES.iterdir() if p.is_dir()):
        try:
            result = run_check(path, device=device.type, dtype="bfloat16", steps=16, rel_tol=0.05)
        except Exception as exc:  # noqa: BLE001 (one fixture's failure must not hide the others)
            out.append((f"canary {path.name:<32} FAIL: {type(exc).__name__}: {str(exc)[:300]}", False))
        else:
            line = f"canary {path.name:<32} max rel {result.max_rel_err:.2e}, tokens {result.tokens_agreed}/" \
                   f"{result.tokens_compared}"
            out.append((line, result.max_rel_err <= 0.05 and result.token_agreement >= 0.9))
        print(out[-1][0], flush=True)
    return out


def main() -> int:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    print(f"{'op':<24}{'rows':>6}{'rel err':>12}  (device {device}, N = K = {N})")
    rows = op_rows(device) + canary_rows(device)
    failed = [line for line, ok in rows if not ok]
    print(f"{len(rows) - len(failed)} passed, {len(failed)} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
