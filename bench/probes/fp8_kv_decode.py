"""Is the FP8 (e4m3) KV cache's decode faster than bf16's? The Triton paged attention at the 8B attention shape
(32 q heads, 8 KV heads, head 128, page 16) over a bf16 pool and over the same pool quantized to e4m3 (per-tensor
k_scale / v_scale, as a calibrated checkpoint's), at 64 x 4096, 1 x 4096 and 64 x 512 decode, without and with
the RoPE folded in (``fuse_rope_attention``, the engine's default): each timed in a CUDA graph (``gpu_harness``:
rotating input sets past the L2) and checked against the reference op on the same pool (rel err < 1e-2), and
the FP8/bf16 time ratio. ``--sweep``: the FP8 decode's pipeline stages and register cap
(``paged_attention.FP8_DECODE_STAGES`` / ``FP8_DECODE_MAX_REGISTERS``, with RoPE ``FP8_ROPE_DECODE_MAX_REGISTERS``;
0 = uncapped) but the defaults, and the other key-block width (32 / 64 keys), at each shape.

Asked 2026-12-07 (issue 35: "FP8 KV cache at batch 64 x context 4096 faster than bf16 KV"); before the kernel
widened e4m3 to fp16 for the dots it was 0.93x / 0.51x / 0.50x bf16 (docs/perf.md).

    PYTHONPATH=bench python bench/probes/fp8_kv_decode.py [--sweep]           # GPU, < 1 minute
    TRITON_INTERPRET=1 PYTHONPATH=bench python bench/probes/fp8_kv_decode.py --cpu   # the checks, tiny, fp16
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace

import torch

import kernel_bench as kb
from gpu_harness import BF16_TOL, graph_us, rel_err, sets_for

from autodeploy.kernels import paged_attention as pa
from autodeploy.kernels.attention_config import AttentionLaunch

# (batch, context, pages shuffled): the engine's sequences own consecutive pages until the pool fragments; the
# 8B step at 64 x 4096 measured level FP8 and bf16 pools where the shuffled probe measured 1.18x (docs/perf.md)
GPU_CASES = ((64, 4096, True), (64, 4096, False), (1, 4096, True), (64, 512, True))
CPU_CASES = ((4, 40, True), (4, 40, False), (1, 40, True), (4, 20, True))
SWEEP = ((2, 0), (2, 128), (3, 0), (3, 128))  # (stages, register cap: 0 none) of the FP8 decode


class Case:
    """One decode shape's input sets over a bf16 pool and its e4m3 copy, with RoPE rows."""

    def __init__(self, batch: int, context: int, shuffled: bool, device: torch.device, dtype: torch.dtype,
                 small: bool):
        self.seqs = [(context - 1, 1)] * batch
        heads = dict(heads=4, kv_heads=2, head_dim=16) if small else {}
        count = 1 if small else sets_for(kb.attention_cost(self.seqs, kv_bytes=1)[0], cap=16)
        self.batches = [kb.paged_batch(self.seqs, device=device, dtype=dtype, shuffled=shuffled, **heads)
                        for _ in range(count)]
        self.fp8 = [kb.fp8_pool(batch.cache) for batch in self.batches]
        width = heads.get("head_dim", kb.D)
        cos, sin = (t[:, :width].to(dtype) for t in kb.rotary_rows(self.seqs, device=device))
        self.rope = dict(rope_cos=cos, rope_sin=sin)

    def features(self, i: int, fp8: bool, rope: bool) -> dict:
        """The kernel's keyword arguments of input set ``i``: the pool, its scales, the rotary rows."""
        pool, (k_scale, v_scale) = self.fp8[i] if fp8 else (self.batches[i].cache, (1.0, 1.0))
        return dict(cache=pool, k_scale=k_scale, v_scale=v_scale, **(self.rope if rope else {}))

    def check(self, fp8: bool, rope: bool) -> float:
        """rel err of the kernel against the reference op, each on its own copy of set 0's pool."""
        features = self.features(0, fp8, rope)
        want = self.batches[0].reference(**dict(features, cache=features["cache"].clone()))
        got = self.batches[0].triton(**dict(features, cache=features["cache"].clone()))
        return rel_err(got, want)

    def time_us(self, fp8: bool, rope: bool, launch: AttentionLaunch | None = None) -> float:
        calls = [(lambda b=b, f=self.features(i, fp8, rope): b.triton(launch, **f)) for i, b in enumerate(self.batches)]
        return graph_us(calls)

    def launch(self) -> AttentionLaunch:
        """The launch the kernel chooses for this shape."""
        first = self.batches[0]
        return AttentionLaunch.choose(first.q.shape[0], len(self.seqs), first.q.shape[1], first.k.shape[1],
                                      first.q.shape[2], first.block_table.shape[1] * kb.PAGE, first.q.device)


def run(cases, device: torch.device, dtype: torch.dtype, timed: bool, sweep: bool) -> bool:
    """Print one line per shape x RoPE x pool (and sweep point); returns whether every check passed."""
    ok = True
    plain = "bf16" if dtype == torch.bfloat16 else "fp16"
    print(f"{'case':<34}{'rel err':>10}{'us':>10}{'speedup':>10}  check")
    for batch, context, shuffled in cases:
        case = Case(batch, context, shuffled, device, dtype, small=not timed)
        for rope in (False, True):
            base = None
            for fp8 in (False, True):
                err = case.check(fp8, rope)
                ok &= err < BF16_TOL
                us = case.time_us(fp8, rope) if timed else None
                base = us if not fp8 else base
                pages = "" if shuffled else " consecutive"
                name = f"b={batch} ctx={context}{pages}{' +rope' if rope else ''} {'fp8' if fp8 else plain}"
                ratio = f"{base / us:.2f}x" if fp8 and us else "-"
                shown = f"{us:.1f}" if us else "-"
                print(f"{name:<34}{err:>10.1e}{shown:>10}{ratio:>10}  {'ok' if err < BF16_TOL else 'FAIL'}", flush=True)
            if sweep and timed:
                _sweep(case, rope, base)
        del case
    return ok


def _sweep(case: Case, rope: bool, bf16_us: float) -> None:
    """The FP8 decode at each (stages, register cap) of SWEEP but the default one, then with the other key-block
    width (32 / 64) at the defaults."""
    cap_name = "FP8_ROPE_DECODE_MAX_REGISTERS" if rope else "FP8_DECODE_MAX_REGISTERS"
    defaults = pa.FP8_DECODE_STAGES, getattr(pa, cap_name)
    try:
        for stages, cap in (point for point in SWEEP if point != defaults):
            pa.FP8_DECODE_STAGES = stages  # (both read by decode_tuning at each launch)
            setattr(pa, cap_name, cap)
            _sweep_line(f"stages {stages} maxnreg {cap or 'none'}", case.time_us(True, rope), bf16_us)
    finally:
        pa.FP8_DECODE_STAGES = defaults[0]
        setattr(pa, cap_name, defaults[1])
    launch = case.launch()
    other = replace(launch, block_n=96 - launch.block_n)
    _sweep_line(f"{other.block_n} keys a block", case.time_us(True, rope, other), bf16_us)


def _sweep_line(label: str, us: float, bf16_us: float) -> None:
    print(f"{'  fp8 ' + label:<34}{'':>10}{us:>10.1f}{bf16_us / us:>9.2f}x", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu", action="store_true", help="the checks only, at tiny shapes in fp16 (interpreter)")
    parser.add_argument("--sweep", action="store_true", help="also the FP8 decode's stages x register cap")
    args = parser.parse_args()
    torch.manual_seed(0)
    if args.cpu:
        ok = run(CPU_CASES, torch.device("cpu"), torch.float16, timed=False, sweep=False)
    else:
        props = torch.cuda.get_device_properties(0)
        print(f"{props.name}, {props.multi_processor_count} SMs; torch {torch.__version__}")
        ok = run(GPU_CASES, torch.device("cuda"), torch.bfloat16, timed=True, sweep=args.sweep)
    print("all checks ok" if ok else "A CHECK FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
