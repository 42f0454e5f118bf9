"""One-row FP8 weight-only GEMV whose weight tiles arrive by TMA through a multi-stage pipeline (opt-in).

``out[N] = x[K] @ (W[N, K] * scale).T (+ bias)`` for one row of x (bf16/fp16/fp32) and an e4m3 weight with
a per-tensor or per-channel fp32 scale, products accumulated in fp32: what ``quant_gemv.fp8_gemv``
computes at batch 1 (which sends such rows here where asked: below). ``bench/probes/quant_kernels.py`` times it
(``fp8_gemv tma channel``) against ``fp8_gemv channel`` and the bf16 GEMV.

Why: the CUDA-core FP8 GEMV streams its weights at ~65-80% of the copy bandwidth, and past measurements
put the limit on the bytes in flight, not on instruction issue. Its bytes in flight are registers: a
4 x 1024 tile loaded one iteration ahead, 8 programs per SM at 58 registers. Here the weight goes from
global to shared memory by TMA (``tl.range(..., num_stages=S)``: Triton's Hopper pipeliner keeps S - 1
tiles in flight on mbarriers, in S - 1 buffers), so the bytes in flight cost shared memory, not registers:
``(S - 1) * BLOCK_N * BLOCK_K`` bytes per program (and S - 1 slices of x by cp.async, where a thread's share
of a slice is 4 bytes or more: bf16 at 256). While every program of a launch is resident (N / BLOCK_N
programs over 132 SMs: 2-3 per SM for the 8B shapes' N of 4096-6144), the bytes in flight per SM are
``N * (S - 1) * BLOCK_K / 132`` whatever ``BLOCK_N`` is. sm_90 (``tests/kernels/compile_sm90.py --only
fp8_tma_gemv``): 40 registers at 16 x 256, 32 KB of shared memory at 8 stages, ~5.6 SASS instructions per weight
byte (per thread) in the loop.

Measured (H100, 2026-12-08, docs/perf.md): at the copy rate only where a launch keeps many programs per SM for long
(an LM-head shape 99%, gate_up 87% against the GEMV's 81%, qkv 71% against 66%); on o and down (4,096 features:
2-3 programs per SM, 5-25 µs) one launch's ramp and tail dominate and the CUDA-core GEMV is as fast. So
``quant_gemv.fp8_gemv`` sends a row here only from ``MIN_FEATURES`` features, and only where
``AUTODEPLOY_FP8_TMA_GEMV=1`` asks (off until the engine's step is measured with it).

Each program computes ``BLOCK_N`` features over the whole K (no split, no reduction kernel), as the other
GEMVs: products ``FOLD`` adjacent lanes summed in the thread into an fp32 accumulator [BLOCK_N,
BLOCK_K / FOLD] (quant_gemv's fold), reduced once after the loop, times the scale, plus the bias. TMA
zero-fills the boxes past N and K; x is loaded masked (zero past K).

The descriptor is built on the host (``triton.tools.tensor_descriptor.TensorDescriptor``): Triton encodes the
CUtensorMap at launch and passes it by value (a ``__grid_constant__`` parameter), so a CUDA graph captures it
with the launch and nothing is allocated. A device-side ``tl.make_tensor_descriptor`` needs
``triton.set_allocator`` scratch of 128 B per program at every launch; under capture that block returns to
the graph pool as the launch returns and the next allocation may reuse it, while under PDL the next kernel's
programs can write their descriptors there before this kernel's programs are done reading theirs. TMA needs
the weight's address and row stride in multiples of 16 bytes, boxes of at most 256 per dimension (``BLOCK_K <=
256`` bytes) and at least 16 bytes along K; inputs that do not fit are refused (the caller falls back).

PDL as the other GEMVs (``pdl.py``): no kernel of a step writes weights, so with PDL on each program asks the
pipeline's first S - 1 tiles into L2 before the wait (the GEMVs load their first tile before it); x is read
after the wait, and the next kernel may launch right after it (``Trigger.AFTER_WAIT``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from . import pdl
from . import quant_reference as ref
from .fp8_small_m import _prefetch_l2
from .gemv import unit_stride
from .quant_gemv import ScaleLayout, tile_from_env

WHAT = "fp8_tma_gemv"
FOLD = 4  # adjacent products summed in the thread: 16 x 256 on 4 warps keeps 8 accumulator registers
MAX_BOX = 256  # TMA: at most 256 elements per box dimension
# the weights the GEMV dispatch (quant_gemv.fp8_gemv, AUTODEPLOY_FP8_TMA_GEMV=1) sends here: on the H100 the TMA
# kernel won from qkv's 6,144 features (2-3 programs per SM and a short launch: o's and down's 4,096 lost or tied)
MIN_FEATURES = 6144
WIDE_FEATURES = 16384  # from here 8 features a program (gate_up 28,672)


@dataclass(frozen=True)
class TmaGemvLaunch:
    """``block_n`` features x ``block_k`` weight bytes per TMA box; ``num_stages``: the pipeline's depth, its
    ``num_stages - 1`` boxes per program in shared memory and in flight."""

    block_n: int = 16
    block_k: int = 256
    num_warps: int = 4
    num_stages: int = 4

    @classmethod
    def choose(cls, n: int, k: int) -> TmaGemvLaunch:
        """The best tiles of the H100 sweep (2026-12-08, ``bench/probes/quant_kernels.py --sweep``, docs/perf.md):
        8 x 256 bytes, 4 stages from ``WIDE_FEATURES`` features (gate_up 44.4 µs, 87% of the copy rate, against
        the GEMV's 47.9), 16 x 256, 4 stages below (qkv 11.6 against 12.5); 4 warps. Short K: the stages the K
        boxes need. ``AUTODEPLOY_FP8_TMA_TILE="block_n,block_k,warps,stages"`` replaces it (a measurement knob)."""
        if TMA_TILE is not None:
            return cls(*TMA_TILE)
        block_n = 8 if n >= WIDE_FEATURES else min(16, triton.next_power_of_2(max(n, 1)))
        block_k = min(MAX_BOX, max(16, triton.next_power_of_2(k)))
        return cls(block_n, block_k, 4, max(2, min(4, triton.cdiv(k, block_k) + 1)))

    def check(self) -> None:
        if not (_pow2(self.block_n) and _pow2(self.block_k) and self.block_n <= MAX_BOX
                and 16 <= self.block_k <= MAX_BOX):
            raise ValueError(f"{WHAT}: block_n and block_k must be powers of two of at most {MAX_BOX} (a TMA box), "
                             f"block_k at least 16 bytes; got {self}")
        if not _pow2(self.num_warps) or self.num_stages < 1:
            raise ValueError(f"{WHAT}: num_warps must be a power of two and num_stages at least 1; got {self}")


def _pow2(value: int) -> bool:
    return value > 0 and value & (value - 1) == 0


TMA_TILE = tile_from_env("AUTODEPLOY_FP8_TMA_TILE", "block_n,block_k,num_warps,num_stages")


@triton.jit
def _fp8_tma_gemv_kernel(
    x_ptr, w_ptr, w_desc, scale_ptr, bias_ptr, out_ptr, N, K, stride_wn, stride_s,
    HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NUM_STAGES: tl.constexpr,
    FOLD: tl.constexpr, PREFETCH: tl.constexpr, PDL: tl.constexpr,
):
    """``BLOCK_N`` features of the one row. ``w_desc``: a TMA descriptor over the weight's bytes [N, K] in boxes
    [BLOCK_N, BLOCK_K]; ``w_ptr``: the same bytes, for the L2 prefetch only (``PREFETCH`` bytes of each row)."""
    off_n = tl.program_id(0) * BLOCK_N
    cols = off_n + tl.arange(0, BLOCK_N)
    if PREFETCH:  # the pipeline's first tiles into L2 while the previous kernel runs (no kernel writes weights)
        _prefetch_l2(w_ptr, cols, N, stride_wn, 0, K, PREFETCH)
    pdl.wait(PDL)  # x is the previous kernel's output; every load of the loop comes after this
    pdl.allow_dependents(PDL)  # Trigger.AFTER_WAIT, as the GEMVs
    lanes = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_N, BLOCK_K // FOLD], dtype=tl.float32)
    for k0 in tl.range(0, K, BLOCK_K, num_stages=NUM_STAGES):
        w = w_desc.load([off_n, k0])  # uint8 [BLOCK_N, BLOCK_K], zeros past N and K (TMA's fill)
        ks = k0 + lanes
        x = tl.load(x_ptr + ks, mask=ks < K, other=0.0).to(tl.float32)
        products = w.to(tl.float8e4nv, bitcast=True).to(tl.float32) * x[None, :]
        acc += tl.sum(tl.reshape(products, [BLOCK_N, BLOCK_K // FOLD, FOLD]), 2)
    col_ok = cols < N
    out = tl.sum(acc, 1) * tl.load(scale_ptr + cols * stride_s, mask=col_ok, other=0.0)
    if HAS_BIAS:
        out += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + cols, out.to(out_ptr.dtype.element_ty), mask=col_ok)


def fp8_tma_gemv(x: torch.Tensor, weight_fp8: torch.Tensor, weight_scale: torch.Tensor,
                 bias: torch.Tensor | None = None, *, launch: TmaGemvLaunch | None = None) -> torch.Tensor:
    """``x @ (weight_fp8.float() * weight_scale).T + bias`` in x's dtype for x [..., K] of exactly one row.

    ``weight_fp8`` float8_e4m3fn [N, K] with unit column stride, its address and row stride multiples of 16
    bytes (TMA); ``weight_scale`` fp32, one value or one per channel ([N] or [N, 1]). A ValueError names what
    does not fit (block scales included: ``quant_gemv.fp8_gemv`` takes those)."""
    stride_s = _scale_stride(weight_fp8, weight_scale)
    n, k = weight_fp8.shape
    ref.check_activations(x, k, WHAT)
    ref.check_bias(bias, n, WHAT)
    row = x.reshape(-1, k)
    if row.shape[0] != 1:
        raise ValueError(f"{WHAT} takes exactly one row, got {row.shape[0]} (x of shape {tuple(x.shape)})")
    if (problem := _tma_problem(weight_fp8)) is not None:
        raise ValueError(f"{WHAT}: {problem}")
    launch = launch or TmaGemvLaunch.choose(n, k)
    launch.check()
    out = torch.empty(n, dtype=x.dtype, device=x.device)
    if n:
        _launch(unit_stride(row), weight_fp8.view(torch.uint8), weight_scale.reshape(-1), stride_s, bias, out,
                launch)
    return out.view(*x.shape[:-1], n)


def takes(weight: torch.Tensor, scales: ScaleLayout) -> bool:
    """Whether the dispatch sends this weight's one-row GEMV here (``scales``: the layout ``fp8_gemv`` read):
    ``MIN_FEATURES`` features or more, a per-tensor or per-channel scale, and what TMA needs."""
    return not scales.block_scaled and weight.shape[0] >= MIN_FEATURES and _tma_problem(weight) is None


def _scale_stride(weight: torch.Tensor, weight_scale: torch.Tensor) -> int:
    """The scale's stride per feature (``ScaleLayout``'s): 0 for one value (per tensor); block scales are refused."""
    n = weight.shape[0] if weight.dim() == 2 else -1
    if weight_scale.dim() == 2 and weight_scale.numel() > 1 and tuple(weight_scale.shape) != (n, 1):
        raise ValueError(f"{WHAT}: block scales (weight_scale of shape {tuple(weight_scale.shape)}) are not "
                         "supported, only per-tensor or per-channel ones (quant_gemv.fp8_gemv takes block scales)")
    return ScaleLayout.fp8(weight, weight_scale, None, WHAT).stride_out


def _tma_problem(weight: torch.Tensor) -> str | None:
    """What a TMA descriptor over the weight lacks (unit column stride, 16-byte address and row stride), or None."""
    n, k = weight.shape
    if k == 0 or weight.stride(1) != 1 or weight.stride(0) % 16 or (n > 1 and weight.stride(0) < k):
        return (f"TMA needs a row-major weight whose row stride (in bytes) is a multiple of 16; got shape {(n, k)} "
                f"and strides {weight.stride()}")
    if weight.data_ptr() % 16:
        return f"TMA needs the weight's address 16-byte aligned, got {weight.data_ptr():#x}"
    return None


def _launch(row, weight, scale, stride_s: int, bias, out, launch: TmaGemvLaunch) -> None:
    n, k = weight.shape
    # host-side descriptor (module doc: capturable, no allocation); the box may overhang N and K: zeros
    desc = TensorDescriptor(weight, [n, k], [weight.stride(0), 1], [launch.block_n, launch.block_k])
    options = pdl.launch_options(out.device)
    _fp8_tma_gemv_kernel[(triton.cdiv(n, launch.block_n),)](
        row, weight, desc, scale, bias if bias is not None else out, out, n, k, weight.stride(0), stride_s,
        HAS_BIAS=bias is not None, BLOCK_N=launch.block_n, BLOCK_K=launch.block_k, NUM_STAGES=launch.num_stages,
        FOLD=FOLD, PREFETCH=prefetch_bytes(launch) if options["PDL"] else 0,
        num_warps=launch.num_warps, num_stages=launch.num_stages, **options)


def prefetch_bytes(launch: TmaGemvLaunch) -> int:
    """Bytes of each weight row asked into L2 before the PDL wait: the pipeline's first ``num_stages - 1``
    tiles, rounded down to a power of two of at least one 128-byte line (``_prefetch_l2``'s arange)."""
    fill = max(128, (launch.num_stages - 1) * launch.block_k)
    return 1 << (fill.bit_length() - 1)
