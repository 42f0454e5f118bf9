"""The tensor-core GEMM of decode batches (``skinny_gemm.py``, this folder) on one GPU, against cuBLAS.

1. Single projections of the Llama-3.1-8B shape (qkv, o, gate/up, down, LM head) at 8 and 64 rows, in
   CUDA graphs with the weights rotated past L2: cuBLAS (``F.linear``) and the skinny GEMM as
   ``SkinnyLaunch.choose`` launches it; relative error against fp32.
2. The chain: the linears of all 32 decoder layers of a decode step (add + RMSNorm kernel, qkv, o,
   add + RMSNorm, gate/up, SiLU-mul kernel, down; attention left out) in one CUDA graph, cuBLAS against
   the skinny GEMM under PDL (norm and activation kernels under PDL too), and a sweep of launch configs.
   Printed: ms per step and the share of the weight-stream floor (copy bandwidth measured in the run).

    python bench/skinny_gpu.py [--rows 8,64] [--sweep]
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass, replace

import kernels_only  # noqa: E402,F401  (autodeploy.kernels without transformers; this folder)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from gemv_gpu import SHAPES, make_layers  # noqa: E402  (this folder)
from gpu_harness import BF16_TOL, DEV, graph_us, rel_err, sets_for  # noqa: E402

import skinny_gemm as sg  # noqa: E402  (this folder: the experiment's kernel)
from autodeploy.kernels.activation import act_mul  # noqa: E402
from autodeploy.kernels.norm import add_rms_norm  # noqa: E402

BF16 = torch.bfloat16
PROJECTIONS = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336),
               "lm_head": (128256, 4096)}


def sm_count() -> int:
    return torch.cuda.get_device_properties(DEV).multi_processor_count if torch.cuda.is_available() else 8


def copy_tbps() -> float:
    from decode_bench import copy_bandwidth  # (a memcpy captured in a graph would run on a copy engine)

    return copy_bandwidth() / 1e12


@dataclass(frozen=True)
class Config:
    """A launch config for every projection: tiles, warps, stages, and K split until programs >= per_sm x
    SMs (``SkinnyLaunch.choose``)."""

    block_n: int = 128
    block_k: int = 64
    num_warps: int = 4
    num_stages: int = 4
    per_sm: float = 1.0

    def launch(self, m: int, n: int, k: int) -> sg.SkinnyLaunch:
        return sg.SkinnyLaunch.choose(m, n, k, sm_count(), self.block_n, self.block_k, self.per_sm,
                                      num_warps=self.num_warps, num_stages=self.num_stages)

    def __str__(self) -> str:
        return f"n{self.block_n} k{self.block_k} w{self.num_warps} s{self.num_stages} x{self.per_sm:g}"


def single(rows_list) -> None:
    print(f"{'proj':<8}{'M':>4}  {'cuBLAS us':>10}{'TB/s':>6}  {'skinny us':>10}{'TB/s':>6}  "
          "launch (choose)      err")
    for name, (n, k) in PROJECTIONS.items():
        ws = [torch.randn(n, k, device=DEV, dtype=BF16) / k**0.5 for _ in range(sets_for(2 * n * k, cap=8))]
        for m in rows_list:
            x = torch.randn(m, k, device=DEV, dtype=BF16)
            launch = sg.SkinnyLaunch.choose(m, n, k, sm_count())
            err = rel_err(sg.skinny_gemm(x, ws[0], launch=launch), F.linear(x.float(), ws[0].float()))
            cublas = graph_us([lambda w=w: F.linear(x, w) for w in ws])
            skinny = graph_us([lambda w=w: sg.skinny_gemm(x, w, launch=launch) for w in ws])
            tb = lambda us: 2 * n * k / (us * 1e-6) / 1e12  # noqa: E731
            print(f"{name:<8}{m:>4}  {cublas:>10.1f}{tb(cublas):>6.2f}  {skinny:>10.1f}{tb(skinny):>6.2f}  "
                  f"n{launch.block_n} k{launch.block_k} split {launch.split_k:<3}  {err:.1e} "
                  f"{'ok' if err < BF16_TOL else 'FAIL'}", flush=True)
        del ws


def step(layers, x, res, config: Config | None):
    """One decode step's linears; ``config`` None: cuBLAS."""
    hidden, inter = x.shape[1], layers[0].down.shape[1]

    def linear(a, w):
        if config is None:
            return F.linear(a, w)
        return sg.skinny_gemm(a, w, launch=config.launch(a.shape[0], *w.shape))

    for layer in layers:
        normed, res = add_rms_norm(x, res, layer.norm_in, 1e-5)
        attn = linear(normed, layer.qkv)[:, :hidden]
        normed, res = add_rms_norm(linear(attn, layer.o), res, layer.norm_post, 1e-5)
        gate_up = linear(normed, layer.gate_up)
        x = linear(act_mul(gate_up[:, :inter], gate_up[:, inter:], "silu"), layer.down)
    return x, res


def time_chain(layers, m: int, config: Config | None, pdl: bool) -> tuple[float, torch.Tensor]:
    os.environ["AUTODEPLOY_PDL"] = "1" if pdl else "0"
    torch.manual_seed(1)
    x = torch.randn(m, layers[0].o.shape[0], device=DEV, dtype=BF16)
    res = torch.randn_like(x)
    out = step(layers, x, res, config)[0].float()
    return graph_us([lambda: step(layers, x, res, config)], reps=20), out


def chain(layers, rows_list, configs, copy: float) -> None:
    weights = sum(layer.bytes for layer in layers)
    floor_us = weights / (copy * 1e12) * 1e6
    print(f"chain: {len(layers)} layers, {weights / 1e9:.2f} GB of linear weights, "
          f"floor {floor_us / 1e3:.3f} ms")
    for m in rows_list:
        base = None
        runs = [("cublas", None, False), ("cublas, norms under PDL", None, True)]
        runs += [(f"skinny {c}", c, True) for c in configs]
        runs.append((f"skinny {configs[0]}, no PDL", configs[0], False))
        for label, config, pdl in runs:
            try:
                us, out = time_chain(layers, m, config, pdl)
            except Exception as exc:  # e.g. out of shared memory for this config
                print(f"  M={m:<3} {label:<40} {type(exc).__name__}: {str(exc)[:90]}", flush=True)
                continue
            base = out if base is None else base
            print(f"  M={m:<3} {label:<40}{us / 1e3:>8.3f} ms {us / len(layers):>7.1f} us/layer "
                  f"{floor_us / us:>5.0%} of floor  out vs cublas {rel_err(out, base):.1e}", flush=True)


SWEEP = [Config(), Config(num_stages=3), Config(num_stages=5), Config(per_sm=2),
         Config(block_k=128, num_warps=8),
         Config(block_k=128, num_warps=8, num_stages=3), Config(block_n=64), Config(block_n=64, per_sm=2),
         Config(block_n=256, num_warps=8, num_stages=3), Config(num_warps=8)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="8,64")
    parser.add_argument("--sweep", action="store_true", help="chain over launch configs too")
    parser.add_argument("--no-single", action="store_true")
    args = parser.parse_args()
    rows_list = [int(r) for r in args.rows.split(",")]
    print(f"{torch.cuda.get_device_name()}, {sm_count()} SMs; torch {torch.__version__}")
    copy = copy_tbps()
    print(f"copy bandwidth {copy:.2f} TB/s")
    if not args.no_single:
        single(rows_list)
    layers = make_layers(SHAPES["llama8b"], SHAPES["llama8b"]["layers"])
    chain(layers, rows_list, SWEEP if args.sweep else [Config()], copy)
    return 0


if __name__ == "__main__":
    sys.exit(main())
