"""FP8 decode linears of 1-16 rows: the swap-AB FP8 x FP8 kernel (``kernels/fp8_small_m.py``) against today's
paths and bf16, one Llama-3.1-8B layer at a time, next to the FP8 bytes floor (issue 35, 2026-12-07).

Each linear runs as its op in the decode graph, the step before it included: qkv and gate_up are
``[fp8_]add_rms_norm_linear`` (6144 x 4096, 28672 x 4096), o is ``[fp8_]linear`` (4096 x 4096), down is
``[fp8_]swiglu_down`` (4096 x 14336); FP8 weights per channel, activations per token (as ``--quantization fp8``
and llm-compressor's FP8_DYNAMIC). The LM head (bf16 128256 x 4096, the same in every row) completes a
step's linears. Paths (``ops/quant_linear.py``'s module constants set for the call):

- ``bf16``: the bf16 ops (the GEMV with the norm fused at one row; norm kernel + cuBLAS beyond);
- ``fp8 gemv`` (rows <= 4, today's default there): the CUDA-core GEMV with the norm / SiLU*mul folded into
  its operand loads (one launch); ``fp8 gemv, step apart``: the step's kernel, then the GEMV (before 2026-12-07,
  ``AUTODEPLOY_QUANT_GEMV_PROLOGUE=0``);
- ``fp8 weight-only`` (today's default at 5-16): the same step, then the weight-only tensor-core GEMM;
- ``fp8 gemm``: ``norm_quantize`` (the quantizer fused into the step; o: ``fp8_quantize``), then the split-K
  Triton FP8 GEMM (today's 17-64 rows);
- ``fp8 small-m``: the same step, then the swap-AB kernel (``AUTODEPLOY_FP8_SMALL_M_MAX_ROWS``);
- ``small-m kernel`` / ``... no prefetch`` / ``... 128 features``: the swap-AB GEMM alone on activations
  quantized beforehand (its default launch; without the L2 prefetch; 128-feature tiles).

``check``: ||out - reference|| / ||reference|| against the op's torch reference (activations rounded to FP8
per token for the FP8 x FP8 paths, not for the weight-only ones: what each computes), 1e-2 passes. Times: the
median per call of a CUDA graph replaying the call over weight sets rotating past the L2 cache
(``gpu_harness.graph_us``). ``%floor``: the FP8 layer's weight bytes (bf16's for bf16) at the copy bandwidth
measured in this run, over the time. ``step``: 32 layers + the LM head, against the step's linears' floor.

    PYTHONPATH=bench python bench/probes/fp8_small_m.py            # ~1 minute on an H100
    PYTHONPATH=bench python bench/probes/fp8_small_m.py --sweep    # + the swap-AB kernel per K split
    python bench/probes/fp8_small_m.py --sass   # no GPU: SASS instructions per weight byte in each loop (sm_90)
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import sys
from dataclasses import dataclass, replace
from pathlib import Path

import kernels_only  # noqa: F401  (autodeploy.kernels and ops without transformers; this folder)

import torch  # noqa: E402

import autodeploy.ops  # noqa: E402,F401  (registers torch.ops.autodeploy.*)

LINEARS = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
LM_HEAD = (128256, 4096)
LAYERS = 32
DEVICE, DTYPE = "cuda", torch.bfloat16  # (a CPU smoke run of the probe's logic sets cpu / float32)
TOLERANCE = 1e-2
# the module constants of ops/quant_linear.py that put each FP8 path on every row count it is measured at
PATHS = {"fp8 gemv": dict(QUANT_GEMV_MAX_ROWS=4, FP8_WEIGHT_ONLY_MAX_ROWS=16, FP8_SMALL_M_MAX_ROWS=0),
         "fp8 gemv, step apart": dict(QUANT_GEMV_MAX_ROWS=4, FP8_WEIGHT_ONLY_MAX_ROWS=16, FP8_SMALL_M_MAX_ROWS=0,
                                      QUANT_GEMV_PROLOGUE=frozenset()),  # (no step folded)
         "fp8 weight-only": dict(QUANT_GEMV_MAX_ROWS=0, FP8_WEIGHT_ONLY_MAX_ROWS=16, FP8_SMALL_M_MAX_ROWS=0),
         "fp8 gemm": dict(QUANT_GEMV_MAX_ROWS=0, FP8_WEIGHT_ONLY_MAX_ROWS=0, FP8_SMALL_M_MAX_ROWS=0),
         "fp8 small-m": dict(FP8_SMALL_M_MAX_ROWS=64)}


@dataclass
class Cell:
    us: float | None = None
    err: float | None = None

    @property
    def ok(self) -> bool:
        return self.err is None or self.err < TOLERANCE


# ----------------------------------------------------------------------------- inputs and ops


class Layer:
    """One layer's weights (bf16 and FP8 per channel) in enough copies to stream past L2, and the
    activations of each linear at ``rows`` rows."""

    def __init__(self):
        from gpu_harness import sets_for

        from autodeploy.quantization.numerics import quantize_fp8_per_channel

        def random(n, k):
            return torch.randn(n, k, device=DEVICE, dtype=DTYPE) * 0.02

        self.bf16 = {name: [random(n, k) for _ in range(max(2, sets_for(2 * n * k)))]
                     for name, (n, k) in LINEARS.items()}
        self.fp8 = {name: [quantize_fp8_per_channel(random(n, k)) for _ in range(max(2, sets_for(n * k)))]
                    for name, (n, k) in LINEARS.items()}
        self.norm_weight = torch.rand(LINEARS["o"][1], device=DEVICE, dtype=DTYPE) + 0.5

    def inputs(self, name: str, rows: int) -> tuple[torch.Tensor, ...]:
        n, k = LINEARS[name]
        if name == "down":  # gate_up's output: [rows, 2 x 14336]
            return (torch.randn(rows, 2 * k, device=DEVICE, dtype=DTYPE),)
        x = torch.randn(rows, k, device=DEVICE, dtype=DTYPE)
        return (x,) if name == "o" else (x, torch.randn_like(x))

    def bytes(self, name: str, fmt: str) -> int:
        tensors = self.bf16[name][:1] if fmt == "bf16" else self.fp8[name][0]
        return sum(t.numel() * t.element_size() for t in tensors)


def fp8_op(name: str, layer: Layer, inputs, weight, scale, activations: str = "token"):
    """The decode graph's FP8 op of this linear on one weight set."""
    ops = torch.ops.autodeploy
    lin = (weight, scale, None, None, None, activations)
    if name == "o":
        return ops.fp8_linear(inputs[0], *lin)
    if name == "down":
        return ops.fp8_swiglu_down(inputs[0], *lin, "silu")
    return ops.fp8_add_rms_norm_linear(inputs[0], inputs[1], layer.norm_weight, 1e-5, *lin)[0]


def bf16_op(name: str, layer: Layer, inputs, weight):
    ops = torch.ops.autodeploy
    if name == "o":
        return ops.linear(inputs[0], weight)
    if name == "down":
        return ops.swiglu_down(inputs[0], weight, "silu")
    return ops.add_rms_norm_linear(inputs[0], inputs[1], layer.norm_weight, 1e-5, weight)[0]


@contextlib.contextmanager
def patched(**constants):
    """ops/quant_linear.py's module constants set for the block (read at each call: capture included)."""
    from autodeploy.ops import quant_linear as ql

    saved = {k: getattr(ql, k) for k in constants}
    for key, value in constants.items():
        setattr(ql, key, value)
    try:
        yield
    finally:
        for key, value in saved.items():
            setattr(ql, key, value)


@contextlib.contextmanager
def torch_reference():
    """Every op on its torch reference (AUTODEPLOY_TRITON_KERNELS=0 is read per call)."""
    saved = os.environ.get("AUTODEPLOY_TRITON_KERNELS")
    os.environ["AUTODEPLOY_TRITON_KERNELS"] = "0"
    try:
        yield
    finally:
        if saved is None:
            del os.environ["AUTODEPLOY_TRITON_KERNELS"]
        else:
            os.environ["AUTODEPLOY_TRITON_KERNELS"] = saved


# ----------------------------------------------------------------------------- measurement


def kernel_calls(name: str, layer: Layer, rows: int, launch_of):
    """The swap-AB GEMM alone (activations quantized beforehand) on each weight set, and its reference."""
    from autodeploy.kernels.fp8_quantize import fp8_quantize
    from autodeploy.kernels.fp8_small_m import SmallMLaunch, fp8_small_m_gemm
    from autodeploy.kernels.quant_reference import fp8_linear_reference

    n, k = LINEARS[name]
    x = torch.randn(rows, k, device=DEVICE, dtype=DTYPE)
    x_fp8, x_scale = fp8_quantize(x)
    launch = launch_of(SmallMLaunch.choose(rows, n, k), rows, n, k)
    calls = [lambda w=w, s=s: fp8_small_m_gemm(x_fp8, x_scale, w, s, out_dtype=DTYPE, launch=launch)
             for w, s in layer.fp8[name]]
    return calls, lambda: fp8_linear_reference(x, *layer.fp8[name][0])


KERNEL_VARIANTS = {  # label: the launch from the default one
    "small-m kernel": lambda default, m, n, k: default,
    "small-m kernel, no prefetch": lambda default, m, n, k: replace(default, prefetch=0),
    "small-m kernel, 128 features": lambda default, m, n, k: type(default).choose(m, n, k, block_n=128),
}


def op_calls(label: str, name: str, layer: Layer, rows: int):
    """One path's op on each weight set, and its reference (module doc)."""
    inputs = layer.inputs(name, rows)
    if label == "bf16":
        return ([lambda w=w: bf16_op(name, layer, inputs, w) for w in layer.bf16[name]],
                lambda: bf16_op(name, layer, inputs, layer.bf16[name][0]))
    reference_acts = "none" if label.startswith(("fp8 gemv", "fp8 weight-only")) else "token"
    return ([lambda w=w, s=s: fp8_op(name, layer, inputs, w, s) for w, s in layer.fp8[name]],
            lambda: fp8_op(name, layer, inputs, *layer.fp8[name][0], reference_acts))


def measure(label: str, name: str, layer: Layer, rows: int) -> Cell:
    from gpu_harness import graph_us, rel_err

    if label in KERNEL_VARIANTS:
        calls, reference = kernel_calls(name, layer, rows, KERNEL_VARIANTS[label])
        constants = {}
    else:
        calls, reference = op_calls(label, name, layer, rows)
        constants = PATHS.get(label, {})
    with patched(**constants):
        got = calls[0]()
        with torch_reference():
            want = reference()
        return Cell(graph_us(calls), rel_err(got.float(), want.float()))


def lm_head_us(rows: int) -> float:
    from gpu_harness import graph_us

    weight = torch.randn(*LM_HEAD, device=DEVICE, dtype=DTYPE) * 0.02
    x = torch.randn(rows, LM_HEAD[1], device=DEVICE, dtype=DTYPE)
    us = graph_us([lambda: torch.ops.autodeploy.linear(x, weight)])  # 1.05 GB: past L2 alone
    del weight
    return us


def labels(rows: int, sweep: bool) -> list[str]:
    found = ["bf16"] + [p for p in PATHS if not p.startswith("fp8 gemv") or rows <= 4] + list(KERNEL_VARIANTS)
    return found + ([f"small-m kernel, split {s}" for s in (1, 2, 4, 8, 16)] if sweep else [])


def add_split_variants() -> None:
    for split in (1, 2, 4, 8, 16):
        KERNEL_VARIANTS[f"small-m kernel, split {split}"] = (
            lambda default, m, n, k, split=split: replace(default, split_k=split))


# ----------------------------------------------------------------------------- report


def report(results: dict, head: dict, layer: Layer, bandwidth: float) -> list[str]:
    """One line per (rows, path): each linear's us, the layer's, its share of the floor, the check; then
    the step's linears (32 layers + the LM head) per path."""
    names = list(LINEARS)
    line = f"{'rows':>4}  {'path':<30}" + "".join(f"{n:>9}" for n in names) + f"{'layer':>9}{'%floor':>8}  check"
    out = [line, "-" * len(line)]
    steps = []
    for (rows, label), cells in results.items():
        layer_bytes = sum(layer.bytes(n, "bf16" if label == "bf16" else "fp8") for n in names)
        floor_us = layer_bytes / bandwidth * 1e6
        total = sum(c.us for c in cells.values())
        worst = max(c.err for c in cells.values())
        check = f"{worst:.1e} {'ok' if worst < TOLERANCE else 'FAIL'}"
        out.append(f"{rows:>4}  {label:<30}" + "".join(f"{cells[n].us:>9.1f}" for n in names)
                   + f"{total:>9.1f}{100 * floor_us / total:>7.0f}%  {check}")
        if label == "bf16" or label in PATHS:
            floor = (LAYERS * layer_bytes + 2 * LM_HEAD[0] * LM_HEAD[1]) / bandwidth * 1e3
            step = (LAYERS * total + head[rows]) / 1e3
            steps.append(f"{rows:>4}  {label:<30} step linears {step:7.3f} ms   floor {floor:.3f} ms   "
                         f"{100 * floor / step:.0f}%")
    return out + ["", f"LM head (bf16, the same in every FP8 step), us: "
                      + ", ".join(f"{r} rows {us:.1f}" for r, us in head.items()), ""] + steps


def main_gpu(args) -> int:
    import triton
    from decode_bench import copy_bandwidth

    bandwidth = copy_bandwidth()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}, "
          f"copy {bandwidth / 1e12:.2f} TB/s", flush=True)
    if args.sweep:
        add_split_variants()
    layer = Layer()
    results = {}
    for rows in args.rows:
        for label in labels(rows, args.sweep):
            results[(rows, label)] = {name: measure(label, name, layer, rows) for name in LINEARS}
            print(f"  {rows} rows, {label}: {sum(c.us for c in results[(rows, label)].values()):.1f} us", flush=True)
    head = {rows: lm_head_us(rows) for rows in args.rows}
    print("\n".join(report(results, head, layer, bandwidth)))
    return 0 if all(c.ok for cells in results.values() for c in cells.values()) else 1


# ----------------------------------------------------------------------------- SASS (no GPU)

SASS_VARIANTS = ("fp8_gemv", "fp8 weight-only 1 rows", "fp8_gemm 1 rows",
                 "fp8_gemm 64 rows split 4", "fp8_small_m", "nvfp4_gemv")


def loop_body(cubin: bytes, cuobjdump) -> list[str]:
    """The SASS instructions of the kernel's longest loop (backward branch to its target): its main loop."""
    sass = cuobjdump(cubin, "-sass")
    code = [(int(m.group(1), 16), m.group(2)) for m in re.finditer(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", sass)]
    branch = re.compile(r"\bBRA\s+(?:`\(\S+\)\s*)?0x([0-9a-f]+)")
    loops = [(int(m.group(1), 16), addr) for addr, text in code
             if (m := branch.search(text)) and int(m.group(1), 16) <= addr]
    lo, hi = max(loops, key=lambda loop: loop[1] - loop[0], default=(1, 0))
    return [text for addr, text in code if lo <= addr <= hi]


def tile_bytes(const: dict) -> int:
    """The weight bytes one iteration of a variant's main loop reads (``BLOCK_G``: groups of 16 bytes)."""
    return const["BLOCK_N"] * const.get("BLOCK_B", const.get("BLOCK_K", 16 * const.get("BLOCK_G", 0)))


def main_sass() -> int:
    """Per sm_90 variant (as tests/kernels/compile_sm90.py compiles it): its main loop's instructions per
    weight byte (NVFP4: also per element), counted per thread (a warp instruction is 32), its barriers and
    shared-memory accesses: an H100 issues ~128 per SM-cycle against ~11 bytes of its copy bandwidth per SM-cycle
    (an H200: ~16), the ceiling of an issue-bound stream (NVFP4 at an H100's bandwidth: <= ~4.9 per element,
    an H200's: ~3.1)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests" / "kernels"))
    import compile_sm90 as c
    import triton
    from triton.compiler import ASTSource

    print(f"{'variant (sm_90)':<44}{'loop instr':>11}{'bytes/iter':>11}{'instr/byte':>11}{'per NVFP4 elem':>15}"
          f"{'bar.sync':>9}{'sts/lds':>8}{'regs':>5}")
    for name, kernel, pointers, const, warps, stages, *options in c.variants():
        if not name.startswith(SASS_VARIANTS):
            continue
        sig, attrs = c._signature(kernel, pointers, const)
        compiled = triton.compile(ASTSource(kernel, sig, constexprs=const, attrs=attrs), target=c.TARGET,
                                  options={"num_warps": warps, "num_stages": stages, **(options[0] if options else {})})
        per_iter = tile_bytes(const)
        body = loop_body(compiled.asm["cubin"], c._cuobjdump)
        per_byte = len(body) * warps * 32 / per_iter
        per_element = f"{per_byte / 2:.2f}" if "nvfp4" in name else "-"
        barriers = sum(bool(re.search(r"BAR\.SYNC", text)) for text in body)
        shared = sum(bool(re.search(r"\b(STS|LDS)", text)) for text in body)
        print(f"{name:<44}{len(body):>11}{per_iter:>11}{per_byte:>11.2f}{per_element:>15}{barriers:>9}"
              f"{shared:>8}{c._resources(compiled.asm['cubin'])[0]:>5}")
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=lambda t: [int(v) for v in t.split(",")], default=[1, 2, 4, 8, 16])
    parser.add_argument("--sweep", action="store_true", help="also the swap-AB kernel split 1-16 ways")
    parser.add_argument("--sass", action="store_true", help="no GPU: instructions per weight byte (sm_90 SASS)")
    args = parser.parse_args(argv)
    if args.sass:
        return main_sass()
    if not torch.cuda.is_available():
        print("bench/probes/fp8_small_m.py needs a CUDA device (or --sass)", file=sys.stderr)
        return 2
    return main_gpu(args)


if __name__ == "__main__":
    sys.exit(main())
