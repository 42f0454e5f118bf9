"""The decode GEMV (``autodeploy/kernels/gemv.py``) on one GPU: checks, then every linear of a decode step.

1. Checks: each fused prologue (RMSNorm, add + RMSNorm, gated activation; with a bias) against the
   composition it replaces, computed in fp32 from the same bf16 inputs, for the
   Llama-3.1-8B and SmolLM2-135M projections (bf16 passes below 1e-2), at 1, 2 and 4 rows.
2. The chain: the linear layers of all decoder layers of one decode step (attention left out: the
   o projection reads the q slice of the qkv output), distinct random weights per layer, captured in
   one CUDA graph and replayed. Variants:
   - ``cublas``: what ran before the fused GEMV: add+RMSNorm kernel, cuBLAS qkv, cuBLAS o, add+RMSNorm,
     cuBLAS gate/up, SiLU-mul kernel, cuBLAS down (7 launches per layer);
   - ``gemv``: add+norm+qkv GEMV, cuBLAS o, add+norm+gate/up GEMV, gated down GEMV (4 launches);
   - ``+pdl``: the GEMVs launched with programmatic dependent launch (``late``: the next kernel may
     launch only after each program's weight loop, not at its start; ``after wait``: once each
     program has waited for the previous kernel); ``k512``: K blocks of 512; ``preload``: the first
     weight tile loaded before the PDL wait; ``n8``: 8 output features per program;
     ``+o gemv``: the o projection as a GEMV too.
   Printed: ms per step, us per layer, and TB/s of the weights streamed (the floor is weights / copy
   bandwidth, measured in the same run).
3. ``--sweep``: GEMV launch configs (BLOCK_N, BLOCK_K, warps) on the 8B chain at one row;
   ``--single``: one projection at a time, cuBLAS against the GEMV.

    python bench/gemv_gpu.py [--sweep]
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass, replace

import kernels_only  # noqa: E402,F401  (autodeploy.kernels without transformers; this folder)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from gpu_harness import BF16_TOL, DEV, graph_us, rel_err  # noqa: E402  (this folder)

import autodeploy.ops  # noqa: E402,F401  (registers the reference ops)
from autodeploy.kernels.activation import act_mul  # noqa: E402
from autodeploy.kernels.gemv import GemvLaunch, Prologue, Trigger, gemv  # noqa: E402
from autodeploy.kernels.norm import add_rms_norm  # noqa: E402
from autodeploy.ops.norm import rms_norm_reference  # noqa: E402

BF16 = torch.bfloat16
SHAPES = {"llama8b": dict(hidden=4096, qkv=6144, inter=14336, layers=32),
          "smollm2": dict(hidden=576, qkv=960, inter=1536, layers=30)}


@dataclass
class Layer:
    qkv: torch.Tensor
    o: torch.Tensor
    gate_up: torch.Tensor
    down: torch.Tensor
    norm_in: torch.Tensor
    norm_post: torch.Tensor

    @property
    def bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.qkv, self.o, self.gate_up, self.down))


def make_layers(shape: dict, count: int) -> list[Layer]:
    h, q, i = shape["hidden"], shape["qkv"], shape["inter"]
    w = lambda n, k: torch.randn(n, k, device=DEV, dtype=BF16) / k**0.5  # noqa: E731
    norm = lambda: (1 + 0.1 * torch.randn(h, device=DEV)).to(BF16)  # noqa: E731
    return [Layer(w(q, h), w(h, h), w(2 * i, h), w(h, i), norm(), norm()) for _ in range(count)]


# ----------------------------------------------------------------------------- checks


def check_ops(shape_name: str, layer: Layer, shape: dict) -> list[tuple[str, float]]:
    h, i = shape["hidden"], shape["inter"]
    results = []
    for m in (1, 2, 4):
        x, res = torch.randn(m, h, device=DEV, dtype=BF16), torch.randn(m, h, device=DEV, dtype=BF16)
        bias = torch.randn(layer.qkv.shape[0], device=DEV, dtype=BF16)
        out, _ = gemv(x, layer.qkv, bias, prologue=Prologue.RMS_NORM, norm_weight=layer.norm_in, eps=1e-5)
        want = F.linear(rms_norm_reference(x, layer.norm_in, 1e-5).float(), layer.qkv.float(), bias.float())
        results.append((f"{shape_name} M={m} norm -> qkv (+bias)", rel_err(out, want)))
        out, summed = gemv(x, layer.gate_up, prologue=Prologue.ADD_RMS_NORM, residual=res,
                           norm_weight=layer.norm_post, eps=1e-5)
        want = F.linear(rms_norm_reference(x + res, layer.norm_post, 1e-5).float(), layer.gate_up.float())
        results.append((f"{shape_name} M={m} add+norm -> gate_up", max(rel_err(out, want), rel_err(summed, x + res))))
        gate_up = torch.randn(m, 2 * i, device=DEV, dtype=BF16)
        out, _ = gemv(gate_up, layer.down, prologue=Prologue.GATED)
        hidden = act_mul(gate_up[:, :i], gate_up[:, i:], "silu")
        results.append((f"{shape_name} M={m} silu*up -> down", rel_err(out, F.linear(hidden.float(), layer.down.float()))))
        out, _ = gemv(x, layer.o)
        results.append((f"{shape_name} M={m} plain -> o", rel_err(out, F.linear(x.float(), layer.o.float()))))
    return results


# ----------------------------------------------------------------------------- the chain


@dataclass(frozen=True)
class Variant:
    name: str
    fused: bool = True
    pdl: bool = False
    o_gemv: bool = False
    block_k: int | None = None  # None: GemvLaunch.choose's
    block_n: int | None = None
    trigger: Trigger | None = Trigger.START  # PDL: where the next kernel may launch; None: choose's
    preload: bool = True

    def launch(self, weight: torch.Tensor, forced: GemvLaunch | None) -> GemvLaunch:
        launch = forced or GemvLaunch.choose(*weight.shape)
        return replace(launch, block_k=self.block_k or launch.block_k, block_n=self.block_n or launch.block_n,
                       trigger=launch.trigger if self.trigger is None else self.trigger, preload=self.preload)


LATE, AFTER_WAIT = Trigger.AFTER_LOOP, Trigger.AFTER_WAIT
VARIANTS = [Variant("cublas", fused=False), Variant("gemv", trigger=None),
            Variant("gemv+pdl", pdl=True, trigger=None),
            Variant("gemv+pdl start", pdl=True, trigger=Trigger.START),
            Variant("gemv+pdl late", pdl=True, trigger=LATE),
            Variant("gemv+pdl no preload", pdl=True, trigger=None, preload=False),
            Variant("gemv+pdl+o gemv", pdl=True, trigger=None, o_gemv=True),
            Variant("gemv n16 k512+pdl start, no preload", pdl=True, block_n=16, block_k=512, trigger=Trigger.START,
                    preload=False)]


def step(layers: list[Layer], x: torch.Tensor, res: torch.Tensor, variant: Variant, launch: GemvLaunch | None):
    """One decode step's linears; returns the last layer's output and residual."""
    hidden = x.shape[1]
    inter = layers[0].down.shape[1]
    for layer in layers:
        if not variant.fused:
            normed, res = add_rms_norm(x, res, layer.norm_in, 1e-5)
            attn = F.linear(normed, layer.qkv)[:, :hidden]
            normed, res = add_rms_norm(F.linear(attn, layer.o), res, layer.norm_post, 1e-5)
            gate_up = F.linear(normed, layer.gate_up)
            x = F.linear(act_mul(gate_up[:, :inter], gate_up[:, inter:], "silu"), layer.down)
            continue
        pick = lambda w: variant.launch(w, launch)  # noqa: E731
        qkv, res = gemv(x, layer.qkv, prologue=Prologue.ADD_RMS_NORM, residual=res, norm_weight=layer.norm_in,
                        eps=1e-5, launch=pick(layer.qkv))
        attn = qkv[:, :hidden]
        o = gemv(attn, layer.o, launch=pick(layer.o))[0] if variant.o_gemv else F.linear(attn, layer.o)
        gate_up, res = gemv(o, layer.gate_up, prologue=Prologue.ADD_RMS_NORM, residual=res,
                            norm_weight=layer.norm_post, eps=1e-5, launch=pick(layer.gate_up))
        x = gemv(gate_up, layer.down, prologue=Prologue.GATED, launch=pick(layer.down))[0]
    return x, res


def time_chain(layers, m: int, variant: Variant, launch: GemvLaunch | None = None) -> tuple[float, torch.Tensor]:
    os.environ["AUTODEPLOY_PDL"] = "1" if variant.pdl else "0"
    torch.manual_seed(1)
    x = torch.randn(m, layers[0].o.shape[0], device=DEV, dtype=BF16)
    res = torch.randn_like(x)
    out = step(layers, x, res, variant, launch)[0].float()
    us = graph_us([lambda: step(layers, x, res, variant, launch)], reps=20)
    return us, out


def chain_table(shape_name: str, layers: list[Layer], rows_list, copy: float) -> list[str]:
    weights = sum(layer.bytes for layer in layers)
    floor_us = weights / (copy * 1e12) * 1e6
    lines = [f"{shape_name}: {len(layers)} layers, {weights / 1e9:.2f} GB of linear weights, floor {floor_us / 1e3:.3f} ms"]
    for m in rows_list:
        base = None
        for variant in VARIANTS:
            us, out = time_chain(layers, m, variant)
            base = out if base is None else base
            drift = rel_err(out, base)
            lines.append(f"  M={m:<3} {variant.name:<27}{us / 1e3:>8.3f} ms {us / len(layers):>8.1f} us/layer "
                         f"{weights / (us * 1e-6) / 1e12:>6.2f} TB/s  {floor_us / us:>5.0%} of floor  "
                         f"out vs cublas {drift:.1e}")
            print(lines[-1], flush=True)
    return lines


def sweep(shape_name: str, layers: list[Layer]) -> list[str]:
    lines = [f"sweep ({shape_name}, M=1, PDL, trigger after wait, preload, o gemv): BLOCK_N, BLOCK_K, warps"]
    configs = [(8, 1024, 4), (4, 1024, 4), (4, 2048, 4), (8, 2048, 8), (8, 1024, 8), (2, 2048, 4), (16, 512, 4),
               (8, 512, 4), (4, 512, 4)]
    variant = Variant("sweep", pdl=True, trigger=AFTER_WAIT, o_gemv=True)
    for bn, bk, warps in configs:
        launch = GemvLaunch(block_n=bn, block_k=bk, num_warps=warps, trigger=AFTER_WAIT, preload=True)
        try:
            us, _ = time_chain(layers, 1, variant, launch)
        except Exception as exc:  # e.g. out of registers for this config
            lines.append(f"  n{bn} k{bk} w{warps}: {type(exc).__name__}: {str(exc)[:80]}")
            continue
        lines.append(f"  n{bn:<3} k{bk:<4} w{warps} {us / 1e3:8.3f} ms  {us / len(layers):7.1f} us/layer")
        print(lines[-1], flush=True)
    return lines


def single_kernels() -> None:
    """One projection at a time (weights rotated past L2): cuBLAS, gemm_sweep's skinny GEMM, the GEMV."""
    import gemm_sweep
    from gpu_harness import sets_for

    for n, k in ((6144, 4096), (28672, 4096), (4096, 14336)):
        ws = [torch.randn(n, k, device=DEV, dtype=BF16) / k**0.5 for _ in range(sets_for(2 * n * k, cap=8))]
        x = torch.randn(1, k, device=DEV, dtype=BF16)
        out = torch.empty(1, n, device=DEV, dtype=BF16)
        norm_w = torch.ones(k, device=DEV, dtype=BF16)
        cases = {
            "cublas": lambda i: lambda: F.linear(x, ws[i]),
            "skinny n16 k128 s4": lambda i: lambda: gemm_sweep.skinny_gemm(x, ws[i], out, 16, 128, 4, 4),
            "gemv plain": lambda i: lambda: gemv(x, ws[i], launch=GemvLaunch(16, 256)),
            "gemv plain k512": lambda i: lambda: gemv(x, ws[i], launch=GemvLaunch(16, 512)),
            "gemv norm": lambda i: lambda: gemv(x, ws[i], prologue=Prologue.RMS_NORM, norm_weight=norm_w,
                                                launch=GemvLaunch(16, 256)),
        }
        for name, make in cases.items():
            us = graph_us([make(i) for i in range(len(ws))], reps=20)
            print(f"  {n}x{k} M=1 {name:<22}{us:>8.1f} us {2 * n * k / (us * 1e-6) / 1e12:>6.2f} TB/s", flush=True)
        del ws


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument("--single", action="store_true", help="only single-projection timings")
    args = parser.parse_args()
    print("torch", torch.__version__, "|", torch.cuda.get_device_name(0), flush=True)
    os.environ["AUTODEPLOY_PDL"] = "0"
    if args.single:
        single_kernels()
        return 0
    from decode_bench import copy_bandwidth  # the same measurement as the decode table's roofline

    copy = copy_bandwidth() / 1e12
    checks, tables = [], []
    for name, shape in SHAPES.items():
        layers = make_layers(shape, shape["layers"])
        checks += check_ops(name, layers[0], shape)
        tables += chain_table(name, layers, (1,), copy)  # 4 rows lost on both shapes (2026-12-03)
        if args.sweep:
            tables += sweep(name, layers)
        del layers
        torch.cuda.empty_cache()
    failed = [(n, e) for n, e in checks if not e < BF16_TOL]
    print(f"\ncopy bandwidth {copy:.2f} TB/s")
    for name, err in checks:
        print(f"  check {name:<40} {err:.1e} {'ok' if err < BF16_TOL else 'FAIL'}")
    print("\n".join(tables))
    print(f"\n{len(checks) - len(failed)}/{len(checks)} checks pass")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
