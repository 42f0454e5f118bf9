"""The quantized-linear kernels on one GPU: each checked against its reference, then timed at the
Llama-3.1-8B linear shapes, next to bf16 and the copy bandwidth measured in the same run (a probe since
2026-12-07: the quantized kernels' speed against bf16; their correctness on CUDA is
``tests/kernels/test_quant_gpu.py``, their sm_90 code ``tests/kernels/compile_sm90.py``).

Shapes (N x K): qkv 6144 x 4096, o 4096 x 4096, gate_up 28672 x 4096, down 4096 x 14336, lm_head
128256 x 4096; rows M = 1, 8, 64, 512 (``--rows``) and 8192 for the GEMMs (``--gemm-rows``). Each
implementation runs on weights of its format (random bf16 weights quantized on the GPU; NVFP4 random
codes and scales), the activation quantization included where the op quantizes (``fp8_gemm``):

- ``bf16 cuBLAS`` (F.linear) and ``bf16 GEMV`` (``kernels/gemv.py``, M <= 4);
- ``fp8_gemv channel`` / ``fp8_gemv block128`` / ``nvfp4_gemv`` (weight-only, CUDA cores, M <= 4; one row: the
  word kernel of ``kernels/nvfp4_gemv.py``) / ``nvfp4_gemv bytes`` (the byte kernel it replaced at one row,
  ``AUTODEPLOY_NVFP4_WORD_GEMV=0``: the A/B pair) and
  ``fp8 weight-only channel`` / ``block128`` (the same on the tensor cores, M <= 512);
- ``fp8_gemv tma channel`` (one row only): ``kernels/fp8_tma_gemv.py``, the weight tiles brought into shared
  memory by TMA through a multi-stage pipeline (opt-in in the runtime: ``AUTODEPLOY_FP8_TMA_GEMV=1``; with
  ``--sweep`` over ``FP8_TMA_SWEEP``; ``AUTODEPLOY_FP8_TMA_TILE`` replaces its default tile);
- ``scaled_mm tensor`` (static per-tensor input and weight scales, cuBLASLt) and ``scaled_mm
  rowwise`` (per-channel weight, dynamic per-token input) through ``fp8_gemm(backend="scaled_mm")``;
  ``fp8_gemm triton rowwise`` (M >= 8), the same on the Triton GEMM;
- ``fp8_gemm block triton`` and ``fp8_gemm block scaled_mm`` (128 x 128 weight blocks, 1 x 128
  activation groups; torch's blockwise ``_scaled_mm`` needs sm_90 and cuBLAS 12.9: where this torch
  refuses it, the row says why);
- ``nvfp4_gemm`` (weight-only, tensor cores).

``check``: ||out - reference|| / ||reference|| on the first 256 rows (below 1e-2 passes: bf16
outputs); ``us``: median time per call of a CUDA graph replaying the call over rotating weight sets
(more than 4x the L2 cache; ``gpu_harness.graph_us``); ``GB/s``: weight bytes (codes and scales) per
second, ``%copy`` of the device-to-device copy bandwidth; ``TFLOP/s``: 2 M N K per second. The
summary adds the batch-1 linears of a whole 8B decode step (32 layers x qkv, o, gate_up, down + the
LM head, which stays bf16 in the quantized rows) against the weight stream's floor.

    PYTHONPATH=bench python bench/probes/quant_kernels.py [--json PATH]   # < 4 minutes on an H100
    PYTHONPATH=bench python bench/probes/quant_kernels.py --shapes qkv,down --rows 1 --gemm-rows '' --sweep
    # NVFP4 at one row, the word kernel against the byte kernel and bf16, over their tiles (~2 minutes):
    PYTHONPATH=bench python bench/probes/quant_kernels.py --rows 1 --gemm-rows '' --sweep \
        --impls 'nvfp4_gemv,bf16 GEMV'
    PYTHONPATH=bench python bench/probes/quant_kernels.py --rows 1 --gemm-rows '' --steps   # + the steps before
    # one-row FP8 on TMA against the FP8 GEMV and bf16, over its tiles:
    PYTHONPATH=bench python bench/probes/quant_kernels.py --rows 1 --gemm-rows '' --sweep \
        --impls 'fp8_gemv channel,fp8_gemv tma channel,bf16 GEMV'
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import kernels_only  # noqa: F401  (autodeploy.kernels without transformers; this folder)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336),
          "lm_head": (128256, 4096)}
LAYERS = 32  # Llama-3.1-8B
CHECK_ROWS = 256
TOLERANCE = 1e-2
# --sweep: GEMV (features, bytes, warps[, FP8's fold]), tensor-core GEMM at 16 rows (features, K tile, stages).
# FP8's candidates hold more weight bytes in flight per SM than the old default 4/1024/4/1 (80 registers, 6
# programs of 2 x 4 KB tiles), by folding products into fewer accumulator lanes or by fewer features per
# program (sm_90 registers: tests/kernels/compile_sm90.py). On an H100 (2026-12-07) 4/1024/4/4 (58 registers)
# won: an 8B layer's one-row linears 101.5 -> 94.4 us; persistent programs taking feature groups in turn
# were slower everywhere (113-123 us)
FP8_GEMV_SWEEP = [(4, 1024, 4, 1), (4, 1024, 4, 4), (2, 2048, 4, 8), (1, 2048, 4, 16), (1, 4096, 4, 16),
                  (1, 4096, 2, 16), (4, 2048, 8, 8), (2, 1024, 2, 4), (8, 1024, 8, 4)]
GEMV_SWEEP = [(4, 512, 4), (4, 1024, 4), (8, 512, 4), (8, 1024, 8), (4, 2048, 8), (2, 1024, 4)]
# the one-row NVFP4 word kernel (features, bytes a feature, warps): 64 registers at 4 features, 128 at 8 (sm_90)
NVFP4_GEMV_SWEEP = [(4, 1024, 2), (4, 2048, 4), (4, 512, 1), (8, 1024, 2), (8, 512, 1), (2, 2048, 2), (2, 1024, 1)]
TC_SWEEP = [(32, 128, 4), (64, 128, 4), (128, 128, 4), (32, 256, 3), (64, 128, 6), (16, 128, 6)]
# the one-row FP8 GEMV on TMA (features, bytes a box, warps, stages; TMA boxes: at most 256 bytes along K). With
# every program resident each SM has N * (stages - 1) * bytes / 132 in flight (o at 16 x 256 x 8: 56 KB) in
# (stages - 1) * features * bytes of shared memory per program (32 KB at 16 x 256 x 8; sm_90: 40 registers,
# compile_sm90.py --only fp8_tma_gemv); the default (TmaGemvLaunch.choose) is the row without a tile
FP8_TMA_SWEEP = [(8, 256, 4, 4), (8, 256, 4, 8), (16, 256, 4, 3), (16, 256, 4, 4), (16, 256, 4, 6), (16, 256, 4, 8),
                 (32, 256, 4, 4), (32, 256, 4, 6), (16, 128, 4, 8), (32, 128, 4, 8)]


@dataclass(frozen=True)
class Impl:
    """One implementation: its weight format, the rows it takes, the call (x, weights) and its fp32
    reference (x, weights, a function returning the fp32 dequantized weight)."""

    name: str
    fmt: str  # a key of formats()
    call: Callable = field(compare=False)
    reference: Callable = field(compare=False)
    max_rows: int | None = None  # the GEMVs: at most 4; the weight-only FP8 GEMMs (decode batches): 512
    min_rows: int = 1
    shapes: tuple[str, ...] = ()  # only these shapes (a step's GEMV: quant_steps.py); empty: all

    def takes(self, rows: int, shape: str) -> bool:
        return self.min_rows <= rows <= (self.max_rows or rows) and shape in (self.shapes or (shape,))


@dataclass
class Result:
    shape: str
    n: int
    k: int
    rows: int
    impl: str
    fmt: str = "bf16"
    us: float | None = None
    err: float | None = None
    weight_bytes: float = 0.0
    note: str = ""

    @property
    def gbps(self) -> float | None:
        return self.weight_bytes / self.us / 1e3 if self.us else None

    @property
    def tflops(self) -> float | None:
        return 2 * self.rows * self.n * self.k / self.us / 1e6 if self.us else None

    @property
    def ok(self) -> bool:
        return self.err is None or (math.isfinite(self.err) and self.err < TOLERANCE)


def cases(shapes: list[str], rows: list[int], gemm_rows: list[int], impls: list[Impl]):
    """(shape, rows, impl) in the order they run: per shape, per row count, each impl that takes it;
    ``gemm_rows`` only for the implementations without a row limit."""
    for shape in shapes:
        for m in rows:
            yield from ((shape, m, impl) for impl in impls if impl.takes(m, shape))
        for m in gemm_rows:
            yield from ((shape, m, impl) for impl in impls if impl.max_rows is None and impl.takes(m, shape))


def table(results: list[Result], copy_bytes_per_s: float) -> str:
    fmt = lambda v, spec: "-" if v is None else format(v, spec)  # noqa: E731
    head = (f"{'shape':<8}{'M':>6}  {'impl':<26}{'check':>13}{'us':>10}{'GB/s':>8}{'%copy':>7}{'TFLOP/s':>9}"
            "  note")
    lines = [head, "-" * len(head)]
    for r in results:
        check = "-" if r.err is None else f"{r.err:.1e} {'ok' if r.ok else 'FAIL'}"
        share = r.gbps and 100 * r.gbps * 1e9 / copy_bytes_per_s
        lines.append(f"{r.shape:<8}{r.rows:>6}  {r.impl:<26}{check:>13}{fmt(r.us, '.1f'):>10}"
                     f"{fmt(r.gbps, '.0f'):>8}{fmt(share, '.0f'):>7}{fmt(r.tflops, '.1f'):>9}  {r.note}")
    return "\n".join(lines)


DECODE_STEPS = {  # the batch-1 linears of one 8B decode step: (layer impl, LM head impl)
    "bf16": ("bf16 GEMV", "bf16 GEMV"),
    "fp8 gemv": ("fp8_gemv channel", "bf16 GEMV"),
    "fp8 tma gemv": ("fp8_gemv tma channel", "bf16 GEMV"),
    "fp8 tc": ("fp8 weight-only channel", "bf16 GEMV"),
    "fp8 block gemv": ("fp8_gemv block128", "bf16 GEMV"),
    "fp8 block tc": ("fp8 weight-only block128", "bf16 GEMV"),
    "nvfp4 gemv": ("nvfp4_gemv", "bf16 GEMV"),
    "nvfp4 gemv bytes": ("nvfp4_gemv bytes", "bf16 GEMV"),
    "nvfp4 tc": ("nvfp4_gemm", "bf16 GEMV"),
}


def decode_steps(results: list[Result], copy_bytes_per_s: float) -> list[tuple[str, float, float]]:
    """(label, seconds, floor seconds) per format whose batch-1 rows were all measured: the step's
    linears, and their weight bytes at the copy bandwidth."""
    one = {(r.shape, r.impl): r for r in results if r.rows == 1 and r.us}
    steps = []
    for label, (layer_impl, head_impl) in DECODE_STEPS.items():
        parts = [(one.get((s, layer_impl)), LAYERS) for s in ("qkv", "o", "gate_up", "down")]
        parts.append((one.get(("lm_head", head_impl)), 1))
        if all(r is not None for r, _ in parts):
            seconds = sum(r.us * count for r, count in parts) / 1e6
            floor = sum(r.weight_bytes * count for r, count in parts) / copy_bytes_per_s
            steps.append((label, seconds, floor))
    return steps


def decode_summary(results: list[Result], copy_bytes_per_s: float) -> list[str]:
    return [f"8B decode linears, batch 1, {label:<15}{seconds * 1e3:7.3f} ms   floor {floor * 1e3:.3f} ms   "
            f"{100 * floor / seconds:.0f}% of it"
            for label, seconds, floor in decode_steps(results, copy_bytes_per_s)]


# ----------------------------------------------------------------------------- GPU side


def formats():
    """Weight makers of each format (from random bf16 weights; the keys are the kernels' argument
    names) and their fp32 dequantizers."""
    from autodeploy.kernels import quant_reference as ref

    def fp8(w, scale):  # scale broadcastable to w
        return (w.float() / scale).clamp(-448, 448).to(torch.float8_e4m3fn)

    def fp8_tensor(w):
        scale = w.float().abs().amax() / 448
        static = torch.tensor(0.02, device=w.device)
        return dict(weight_fp8=fp8(w, scale), weight_scale=scale, input_scale=static)

    def fp8_channel(w):
        scale = w.float().abs().amax(1) / 448
        return dict(weight_fp8=fp8(w, scale[:, None]), weight_scale=scale)

    def fp8_block(w):
        n, k = w.shape
        blocks = w.float().unflatten(0, (n // 128, 128)).unflatten(2, (k // 128, 128))
        scale = blocks.abs().amax((1, 3)) / 448
        weight = fp8(blocks, scale[:, None, :, None]).flatten(2).flatten(0, 1)
        return dict(weight_fp8=weight, weight_scale=scale, block_size=(128, 128))

    def nvfp4(w):
        n, k = w.shape
        scale = (torch.rand(n, k // 16, device=w.device) * 2 + 0.25).to(torch.float8_e4m3fn)
        packed = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, device=w.device)
        return dict(weight_packed=packed, weight_scale=scale,
                    weight_scale_2=torch.tensor(0.004, device=w.device))

    def fp8_dequantized(t):
        return ref.dequantize_fp8(t["weight_fp8"], t["weight_scale"], t.get("block_size"))

    return dict(bf16=(lambda w: dict(weight=w), lambda t: t["weight"].float()),
                fp8_tensor=(fp8_tensor, fp8_dequantized), fp8_channel=(fp8_channel, fp8_dequantized),
                fp8_block=(fp8_block, fp8_dequantized), nvfp4=(nvfp4, lambda t: ref.dequantize_nvfp4(**t)))


def weight_bytes(t: dict) -> int:
    return sum(v.numel() * v.element_size() for v in t.values() if isinstance(v, torch.Tensor))


def nvfp4_byte_kernel(x, t, launch=None):
    """``nvfp4_gemv`` with the one-row word kernel switched off (``quant_gemv.NVFP4_WORD_GEMV``) for the call."""
    return _nvfp4_gemv_with_words(False, x, t, launch)


def nvfp4_word_kernel(x, t, launch=None):
    """``nvfp4_gemv`` with the one-row word kernel switched on for the call, whatever the environment says."""
    return _nvfp4_gemv_with_words(True, x, t, launch)


def _nvfp4_gemv_with_words(words: bool, x, t, launch):
    from autodeploy.kernels import quant_gemv

    before, quant_gemv.NVFP4_WORD_GEMV = quant_gemv.NVFP4_WORD_GEMV, words
    try:
        return quant_gemv.nvfp4_gemv(x, **t, launch=launch)
    finally:
        quant_gemv.NVFP4_WORD_GEMV = before


def implementations() -> list[Impl]:
    from autodeploy.kernels import quant_reference as ref
    from autodeploy.kernels.fp8_tma_gemv import fp8_tma_gemv
    from autodeploy.kernels.gemv import gemv
    from autodeploy.kernels.quant_gemm import fp8_gemm, fp8_weight_only_gemm, nvfp4_gemm
    from autodeploy.kernels.quant_gemv import fp8_gemv

    def weight_only(x, t, dequantized):  # the GEMVs' and NVFP4's semantics: x times the fp32 weight
        return x.float() @ dequantized().t()

    def quantized(x, t, dequantized):  # fp8_gemm's: activations quantized first
        return ref.fp8_linear_reference(x, t["weight_fp8"], t["weight_scale"], t.get("input_scale"),
                                        t.get("block_size")).float()

    def on(kernel, **options):  # the kernel on x and a format's weights
        return lambda x, t: kernel(x, **t, **options)

    return [
        Impl("bf16 cuBLAS", "bf16", on(F.linear), weight_only),
        Impl("bf16 GEMV", "bf16", lambda x, t: gemv(x, t["weight"])[0], weight_only, max_rows=4),
        Impl("fp8_gemv channel", "fp8_channel", on(fp8_gemv), weight_only, max_rows=4),
        Impl("fp8_gemv block128", "fp8_block", on(fp8_gemv), weight_only, max_rows=4),
        Impl("fp8_gemv tma channel", "fp8_channel", on(fp8_tma_gemv), weight_only, max_rows=1),
        Impl("nvfp4_gemv", "nvfp4", nvfp4_word_kernel, weight_only, max_rows=4),
        Impl("nvfp4_gemv bytes", "nvfp4", nvfp4_byte_kernel, weight_only, max_rows=1),
        Impl("fp8 weight-only channel", "fp8_channel", on(fp8_weight_only_gemm), weight_only, max_rows=512),
        Impl("fp8 weight-only block128", "fp8_block", on(fp8_weight_only_gemm), weight_only, max_rows=512),
        Impl("scaled_mm tensor", "fp8_tensor", on(fp8_gemm, backend="scaled_mm"), quantized),
        Impl("scaled_mm rowwise", "fp8_channel", on(fp8_gemm, backend="scaled_mm"), quantized),
        Impl("fp8_gemm triton rowwise", "fp8_channel", on(fp8_gemm, backend="triton"), quantized, min_rows=8),
        Impl("fp8_gemm block triton", "fp8_block", on(fp8_gemm, backend="triton"), quantized),
        Impl("fp8_gemm block scaled_mm", "fp8_block", on(fp8_gemm, backend="scaled_mm"), quantized),
        Impl("nvfp4_gemm", "nvfp4", on(nvfp4_gemm), weight_only),
    ]


class ShapeWeights:
    """One shape's weights in every format, made on first use (copies enough to rotate past the L2
    cache), with each format's fp32 dequantized weight for the checks; dropped after the shape."""

    def __init__(self, n: int, k: int, makers: dict):
        self.n, self.k, self.makers, self.sets, self.dequantized = n, k, makers, {}, {}

    def of(self, fmt: str) -> list[dict]:
        from gpu_harness import sets_for

        if fmt not in self.sets:
            make = self.makers[fmt][0]
            self.sets[fmt] = [make(self._random())]
            copies = sets_for(weight_bytes(self.sets[fmt][0]))
            self.sets[fmt] += [make(self._random()) for _ in range(copies - 1)]
        return self.sets[fmt]

    def dequantized_of(self, fmt: str) -> torch.Tensor:
        if fmt not in self.dequantized:
            self.dequantized[fmt] = self.makers[fmt][1](self.of(fmt)[0])
        return self.dequantized[fmt]

    def _random(self) -> torch.Tensor:
        return torch.randn(self.n, self.k, device="cuda", dtype=torch.bfloat16) * 0.02


def measure(shape: str, m: int, impl: Impl, weights: ShapeWeights, call=None,
            name: str | None = None) -> Result:
    """Check one implementation (or ``call``, a variant of it) at M rows, then time it."""
    from gpu_harness import graph_us, rel_err

    call = call or impl.call
    sets = weights.of(impl.fmt)
    x = torch.randn(m, weights.k, device="cuda", dtype=torch.bfloat16)
    result = Result(shape, weights.n, weights.k, m, name or impl.name, impl.fmt,
                    weight_bytes=weight_bytes(sets[0]))
    try:
        out = call(x, sets[0])
    except (RuntimeError, ValueError) as exc:  # e.g. a torch without blockwise scaling on this GPU
        result.note = "unsupported: " + str(exc).strip().splitlines()[0][:90]
        return result
    rows = min(m, CHECK_ROWS)
    want = impl.reference(x[:rows], sets[0], lambda: weights.dequantized_of(impl.fmt))
    result.err = rel_err(out[:rows].float(), want)
    result.us = graph_us([lambda t=t: call(x, t) for t in sets])
    return result


def launch_sweep(shape: str, impls: list[Impl], weights: ShapeWeights) -> list[Result]:
    """The batch-1 weight-only kernels over launch configs: the CUDA-core GEMVs over ``FP8_GEMV_SWEEP`` /
    ``GEMV_SWEEP`` (features x bytes / warps [/ fold]), the TMA one over ``FP8_TMA_SWEEP`` (features x bytes /
    warps / stages), the tensor-core GEMMs over ``TC_SWEEP`` (features, K tile, stages)."""
    from autodeploy.kernels.fp8_tma_gemv import TmaGemvLaunch, fp8_tma_gemv
    from autodeploy.kernels.quant_gemm import fp8_weight_only_gemm, nvfp4_gemm
    from autodeploy.kernels.quant_gemv import QuantGemvLaunch, fp8_gemv

    def fp8_launch(block_n, block_b, warps, fold):
        return QuantGemvLaunch(block_n, block_b, warps, fold=fold)

    kernels = {"fp8_gemv channel": (fp8_gemv, FP8_GEMV_SWEEP, fp8_launch),
               "fp8_gemv tma channel": (fp8_tma_gemv, FP8_TMA_SWEEP, TmaGemvLaunch),
               "nvfp4_gemv": (lambda x, launch, **t: nvfp4_word_kernel(x, t, launch), NVFP4_GEMV_SWEEP,
                              QuantGemvLaunch),
               "nvfp4_gemv bytes": (lambda x, launch, **t: nvfp4_byte_kernel(x, t, launch), GEMV_SWEEP,
                                    QuantGemvLaunch),
               "fp8 weight-only channel": (fp8_weight_only_gemm, TC_SWEEP, _tc_launch),
               "nvfp4_gemm": (nvfp4_gemm, TC_SWEEP, _tc_launch)}
    kernels.update({i.name: (lambda x, launch, i=i, **t: i.call(x, t, launch), FP8_GEMV_SWEEP, fp8_launch)
                    for i in impls if i.name.startswith("fp8_gemv channel") and i.name.endswith("+step")
                    and i.takes(1, shape)})  # --steps: the FP8 GEMV with its step folded in, as the plain one
    found = []
    for impl in (i for i in impls if i.name in kernels):
        kernel, configs, make = kernels[impl.name]
        for config in configs:
            def call(x, t, kernel=kernel, launch=make(*config)):
                return kernel(x, **t, launch=launch)

            found.append(measure(shape, 1, impl, weights, call, f"{impl.name} {'/'.join(map(str, config))}"))
    return found


def _tc_launch(block_n: int, block_k: int, stages: int):
    from autodeploy.kernels.quant_gemm import GemmLaunch

    return GemmLaunch(16, block_n, block_k, num_warps=4, num_stages=stages)


def measure_all(args, impls: list[Impl]) -> list[Result]:
    makers = formats()
    results = []
    for shape in args.shapes:
        weights = ShapeWeights(*SHAPES[shape], makers)
        for _, m, impl in cases([shape], args.rows, args.gemm_rows, impls):
            results.append(measure(shape, m, impl, weights))
            print(f"  {shape} M={m} {impl.name}: {results[-1].us or results[-1].note}", flush=True)
        if args.sweep:
            results += launch_sweep(shape, impls, weights)
        del weights
        torch.cuda.empty_cache()
    return results


# ----------------------------------------------------------------------------- a section of full_table.py

# ----------------------------------------------------------------------------- entry point


def _ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v.strip()]


def parse(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default=",".join(SHAPES), help="of " + ", ".join(SHAPES))
    parser.add_argument("--rows", type=_ints, default=[1, 8, 64, 512])
    parser.add_argument("--gemm-rows", type=_ints, default=[8192], help="rows only the GEMMs run at")
    parser.add_argument("--sweep", action="store_true",
                        help="also the batch-1 weight-only kernels over launch configs")
    parser.add_argument("--impls", default="", metavar="A,B",
                        help="only the implementations whose name contains one of these (default: all)")
    parser.add_argument("--steps", action="store_true", help="also the GEMVs with the step before them, "
                        "folded into the GEMV and apart (quant_steps.py)")
    parser.add_argument("--json", default=None, help="also write the header and rows here")
    args = parser.parse_args(argv)
    args.shapes = _shapes(args.shapes, parser.error)
    return args


def selected(impls: list[Impl], patterns: str) -> list[Impl]:
    """The implementations whose name contains one of the comma-separated ``patterns`` (all for none)."""
    wanted = [p.strip() for p in patterns.split(",") if p.strip()]
    return [i for i in impls if not wanted or any(p in i.name for p in wanted)]


def _shapes(text: str, error) -> list[str]:
    shapes = [s for s in text.split(",") if s]
    unknown = [s for s in shapes if s not in SHAPES]
    if unknown:
        error(f"unknown --shapes {unknown}; known: {list(SHAPES)}")
    return shapes


def copy_bandwidth() -> float:
    from decode_bench import copy_bandwidth as measured

    return measured()


def main(argv=None) -> int:
    args = parse(argv)
    if not torch.cuda.is_available():
        print("bench/quant_kernels.py needs a CUDA device", file=sys.stderr)
        return 2
    import triton

    bandwidth = copy_bandwidth()
    header = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                  copy_bytes_per_s=bandwidth)
    print(f"{header['device']}, torch {header['torch']}, triton {header['triton']}, "
          f"copy {bandwidth / 1e12:.2f} TB/s")
    import quant_steps

    impls = implementations() + (quant_steps.implementations(Impl) if args.steps else [])
    results = measure_all(args, selected(impls, args.impls))
    print(table(results, bandwidth))
    print("\n".join(decode_summary(results, bandwidth) + quant_steps.summary(results, LAYERS)))
    if args.json:
        with open(args.json, "w") as handle:
            rows = [asdict(r) | {"gbps": r.gbps, "tflops": r.tflops} for r in results]
            json.dump({"header": header, "rows": rows}, handle, indent=1)
    return 0 if all(r.ok for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
