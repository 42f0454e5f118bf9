"""Linear layers of a few rows with the elementwise step before them fused in (decode steps).

``out[M, N] = prologue(x) @ W[N, K].T (+ bias)`` for small M, where the prologue is one of

- ``NONE``: ``x``;
- ``RMS_NORM``: ``rms_norm(x, norm_weight, eps)``;
- ``ADD_RMS_NORM``: ``rms_norm(x + residual)``; ``x + residual`` is returned too (program 0 writes it);
- ``GATED``: ``act(x[:, :K]) * x[:, K:]``, the down projection of a gated MLP reading the output of
  the gate/up GEMM in place.

A decode step of a few sequences streams each weight once while its activations are a few KB, so a
linear layer costs its weight stream plus a launch: folding the norm or the activation into the
operand load of the GEMM removes a launch and a round trip through memory per layer. One program
computes ``BLOCK_N`` output features of every row over the whole K (no split-K: the epilogue needs
no reduction); each program reads all of x from L2 and applies the prologue to it, which is why this
is for few rows only (``MAX_ROWS``). The products are fp32 FMAs on the CUDA cores, accumulated per
(row, feature, k-lane) and reduced over k once at the end: padding the rows to the tensor cores' 16
made every program apply the prologue to 16 rows, and that arithmetic, not the weight stream, set
the pace (H200: 0.5 TB/s). The memory latency is hidden by the bytes each program has in flight
(a 4 x 1024 weight tile per iteration at one row) times the programs per SM (seven at 72 registers);
a weight tile carried across iterations cost a shared-memory layout conversion per tile.

RMSNorm's ``1/rms`` is a per-row factor of the dot product, so the kernel accumulates ``sum(x^2)``
alongside the dot and scales the accumulator once at the end: the norm costs no pass of its own.
The GEMM operand is then ``x * w`` rounded to x's dtype instead of ``x * w / rms`` (a rounding of
the same size, bf16 and fp32). fp16 could overflow on ``x * w`` where the reference does not: for
fp16 a first pass computes ``1/rms`` and the operand is exactly the reference's (``TWO_PASS``).

With PDL (``autodeploy.kernels.pdl``) the next kernel may launch while this one streams, and this
one waits for the previous kernel before it reads x. Weights are written by no kernel of a step, so
with ``preload`` each program loads its first weight tile before that wait: a program placed while
the previous kernel finishes streams its first tile in that kernel's tail. Where the next kernel may
launch (``Trigger``) decides how many of its programs wait on SM slots meanwhile. (An
L2 prefetch of the rest of the program's weight rows before the wait, for the attention output
projection while the attention leaves DRAM idle, made the 8B batch-1 step 0.11 ms slower on the
H200: removed.)
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum

import torch
import triton
import triton.language as tl

from . import pdl, trace
from .pdl import Trigger  # noqa: F401  (re-exported: GemvLaunch's trigger)
from .activation import ACTIVATION_IDS, activate


class Prologue(IntEnum):
    NONE = 0
    RMS_NORM = 1
    ADD_RMS_NORM = 2
    GATED = 3


# the kernel's spelling of the same values (a jit function reads only constexpr globals)
NONE, RMS_NORM, ADD_RMS_NORM, GATED = (tl.constexpr(p.value) for p in Prologue)
MAX_ROWS = 4  # every program applies the prologue to all rows: the GEMV is for a few rows only


START, AFTER_WAIT, AFTER_LOOP = (tl.constexpr(t.value) for t in Trigger)


@triton.jit
def _operand(x_ptr, res_ptr, norm_w_ptr, sum_ptr, rows, ks, mask, K, rstd, sumsq, write_sum,
             stride_xm, stride_rm, stride_sm,
             PROLOGUE: tl.constexpr, ACTIVATION: tl.constexpr, TWO_PASS: tl.constexpr):
    """The GEMM operand [BLOCK_M, BLOCK_K] of columns ``ks`` in x's dtype, and the running x^2 per
    (row, k-lane), summed over the lanes once after the loop."""
    x = tl.load(x_ptr + rows[:, None] * stride_xm + ks[None, :], mask=mask, other=0.0)
    dtype = x.dtype
    if PROLOGUE == GATED:
        up = tl.load(x_ptr + rows[:, None] * stride_xm + K + ks[None, :], mask=mask, other=0.0)
        return (activate(x.to(tl.float32), ACTIVATION) * up.to(tl.float32)).to(dtype), sumsq
    if PROLOGUE == ADD_RMS_NORM:
        residual = tl.load(res_ptr + rows[:, None] * stride_rm + ks[None, :], mask=mask, other=0.0)
        x = (x.to(tl.float32) + residual.to(tl.float32)).to(dtype)
        if write_sum:
            tl.store(sum_ptr + rows[:, None] * stride_sm + ks[None, :], x, mask=mask)
    if PROLOGUE == NONE:
        return x, sumsq
    xf = x.to(tl.float32)
    norm_w = tl.load(norm_w_ptr + ks, mask=ks < K, other=0.0).to(tl.float32)[None, :]
    if TWO_PASS:
        return (xf * rstd[:, None] * norm_w).to(dtype), sumsq
    return (xf * norm_w).to(dtype), _add_squares(sumsq, xf)


@triton.jit
def _add_squares(sumsq, xf):
    """sumsq + x^2, each lane of ``sumsq`` taking adjacent lanes of x where it has fewer (a smaller
    accumulator: the quantized GEMV's registers)."""
    if sumsq.shape[1] == xf.shape[1]:
        return sumsq + xf * xf
    fold: tl.constexpr = xf.shape[1] // sumsq.shape[1]
    return sumsq + tl.sum(tl.reshape(xf * xf, [xf.shape[0], sumsq.shape[1], fold]), 2)


@triton.jit
def _inverse_rms(x_ptr, res_ptr, rows, row_ok, K, eps, stride_xm, stride_rm,
                 PROLOGUE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    """1/rms of each row of x (or of x + residual, rounded as the kernel rounds it): the first pass."""
    sumsq = tl.zeros([BLOCK_M], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        mask = row_ok[:, None] & (ks < K)[None, :]
        x = tl.load(x_ptr + rows[:, None] * stride_xm + ks[None, :], mask=mask, other=0.0)
        if PROLOGUE == ADD_RMS_NORM:
            residual = tl.load(res_ptr + rows[:, None] * stride_rm + ks[None, :], mask=mask, other=0.0)
            x = (x.to(tl.float32) + residual.to(tl.float32)).to(x.dtype)
        xf = x.to(tl.float32)
        sumsq += tl.sum(xf * xf, 1)
    return tl.rsqrt(sumsq / K + eps)


@triton.jit
def _normalize_rows(out, sumsq, K, eps, PROLOGUE: tl.constexpr, TWO_PASS: tl.constexpr):
    """``out`` [BLOCK_M, features] times each row's 1/rms where the operand left it out (the one-pass
    norms: ``sumsq`` holds each row's x^2 per k-lane)."""
    if (PROLOGUE == RMS_NORM or PROLOGUE == ADD_RMS_NORM) and not TWO_PASS:
        out = out * tl.rsqrt(tl.sum(sumsq, 1) / K + eps)[:, None]
    return out


@triton.jit
def _accumulate(acc, w, a, BLOCK_M: tl.constexpr):
    """acc += the products of one weight tile [BLOCK_N, BLOCK_K] with the operand [BLOCK_M, BLOCK_K]."""
    if BLOCK_M == 1:
        acc += w.to(tl.float32) * tl.sum(a.to(tl.float32), 0)[None, :]
    else:
        acc += a.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :]
    return acc


@triton.jit(do_not_specialize=["M"])
def _gemv_kernel(
    x_ptr, res_ptr, norm_w_ptr, w_ptr, bias_ptr, out_ptr, sum_ptr, trace_ptr,
    M, N, K, stride_xm, stride_rm, stride_wn, stride_om, stride_sm, eps,
    PROLOGUE: tl.constexpr, ACTIVATION: tl.constexpr, TWO_PASS: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    PDL: tl.constexpr, TRIGGER: tl.constexpr, PRELOAD: tl.constexpr, TRACE: tl.constexpr = False,
):
    pid = tl.program_id(0)
    trace.stamp(trace_ptr, 1, pid, TRACE)  # (kernels/trace.py: start, after the wait, after the store)
    cols = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    rows = tl.arange(0, BLOCK_M)
    row_ok = rows < M
    lanes = tl.arange(0, BLOCK_K)
    w_rows = w_ptr + cols.to(tl.int64)[:, None] * stride_wn  # [BLOCK_N, 1]
    w_first = tl.zeros([BLOCK_N, BLOCK_K], dtype=w_ptr.dtype.element_ty)
    if PRELOAD:  # weights: no kernel of the step writes them, so before the wait
        w_first = tl.load(w_rows + lanes[None, :], mask=col_ok[:, None] & (lanes < K)[None, :], other=0.0)
    if TRIGGER == START:
        pdl.allow_dependents(PDL)
    pdl.wait(PDL)
    trace.stamp(trace_ptr, 2, pid, TRACE)
    if TRIGGER == AFTER_WAIT:
        pdl.allow_dependents(PDL)
    rstd = tl.zeros([BLOCK_M], dtype=tl.float32)
    if TWO_PASS:
        rstd = _inverse_rms(x_ptr, res_ptr, rows, row_ok, K, eps, stride_xm, stride_rm,
                            PROLOGUE, BLOCK_M, BLOCK_K)
    sumsq = tl.zeros([BLOCK_M, BLOCK_K], dtype=tl.float32)
    # products accumulate per k-lane and are summed over k once after the loop (a reduction per
    # iteration would cross warps); one row broadcasts x over the weight tile
    acc = tl.zeros([BLOCK_N, BLOCK_K] if BLOCK_M == 1 else [BLOCK_M, BLOCK_N, BLOCK_K], dtype=tl.float32)
    first_k = 0
    if PRELOAD:  # the first tile's products, then the loop over the rest
        a, sumsq = _operand(x_ptr, res_ptr, norm_w_ptr, sum_ptr, rows, lanes, row_ok[:, None] & (lanes < K)[None, :],
                            K, rstd, sumsq, pid == 0, stride_xm, stride_rm, stride_sm,
                            PROLOGUE, ACTIVATION, TWO_PASS)
        acc = _accumulate(acc, w_first, a, BLOCK_M)
        first_k = BLOCK_K
    for k0 in range(first_k, K, BLOCK_K):
        ks = k0 + lanes
        w = tl.load(w_rows + ks[None, :], mask=col_ok[:, None] & (ks < K)[None, :], other=0.0)
        a, sumsq = _operand(x_ptr, res_ptr, norm_w_ptr, sum_ptr, rows, ks, row_ok[:, None] & (ks < K)[None, :],
                            K, rstd, sumsq, pid == 0, stride_xm, stride_rm, stride_sm,
                            PROLOGUE, ACTIVATION, TWO_PASS)
        acc = _accumulate(acc, w, a, BLOCK_M)
    if TRIGGER == AFTER_LOOP:
        pdl.allow_dependents(PDL)
    out = _normalize_rows(tl.sum(acc, 1)[None, :] if BLOCK_M == 1 else tl.sum(acc, 2), sumsq, K, eps, PROLOGUE,
                          TWO_PASS)
    if HAS_BIAS:
        out += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    dst = out_ptr + rows[:, None] * stride_om + cols[None, :]
    tl.store(dst, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])
    trace.stamp(trace_ptr, 3, (tl.sum(out) != 0).to(tl.int32), TRACE)


@dataclass(frozen=True)
class GemvLaunch:
    """Block sizes of one GEMV launch (a function of the shapes only)."""

    block_n: int
    block_k: int
    num_warps: int = 4
    # PDL: where the next kernel may launch, and whether the first weight tile is loaded before the
    # wait. All linears of an 8B decode step but the o projection (bench/probes/gemv_gpu.py, H200,
    # 2026-12-03, 8 x 1024 tiles): after the wait + preload 3.68 ms, at the start 3.67, after the
    # weight loop 3.70, without the preload 3.75; SmolLM2 0.329 / 0.329 / 0.343 / 0.358 ms. Trigger
    # at the start cascades (the next kernel's programs trigger while they wait, so kernels further
    # down can claim SM slots); after the wait is as fast and launches at most one kernel early.
    trigger: Trigger = Trigger.AFTER_WAIT
    preload: bool = True

    @classmethod
    def choose(cls, n: int, k: int, rows: int = 1) -> "GemvLaunch":
        # One row: 4 output features x K blocks of 1024 per program (32 fp32 accumulator registers,
        # 72 in all: seven programs per SM, 8 KB of weights in flight each; every weight row is read
        # 2 KB at a time). All linears of a step incl. the o projection (H200, bench/probes/gemv_gpu.py
        # --sweep, 2026-12-03): 8B 3.47 ms (8 x 1024: 3.51; 16 x 512, 146 registers and three
        # programs per SM: 4.20; 4 x 512: 4.01), cuBLAS 3.98; SmolLM2 0.249 ms (0.254, 0.369,
        # 0.291), cuBLAS 0.660. Four rows: 16 x 128 (the accumulator is rows x features x K lanes).
        block_n, block_k = (4, 1024) if rows == 1 else (16, 128)
        return cls(block_n=block_n, block_k=min(block_k, max(16, triton.next_power_of_2(k))))


def gemv_rows_ok(x: torch.Tensor, weight: torch.Tensor, max_rows: int) -> bool:
    """Whether ``gemv`` handles this linear: few rows, a row-major weight, a float dtype."""
    rows = x.numel() // max(x.shape[-1], 1)
    return (rows <= min(max_rows, MAX_ROWS) and weight.dim() == 2 and weight.stride(-1) == 1
            and x.dtype == weight.dtype and x.dtype in (torch.float16, torch.bfloat16, torch.float32))


def gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    prologue: Prologue = Prologue.NONE,
    residual: torch.Tensor | None = None,
    norm_weight: torch.Tensor | None = None,
    eps: float = 0.0,
    activation: str = "silu",
    launch: GemvLaunch | None = None,
    trace_buffer: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(prologue(x) @ weight.T + bias, x + residual or None)`` for x [..., K] of at most 4 rows.

    ``GATED`` reads x [..., 2K] (gate then up); ``ADD_RMS_NORM`` also returns ``x + residual``.
    ``trace_buffer`` ([programs, trace.EVENTS] int64, GPU only) records each program's start, wait
    release and end (``kernels/trace.py``).
    """
    n, k = weight.shape
    rows = unit_stride(x.reshape(-1, x.shape[-1]))
    m = rows.shape[0]
    if m > MAX_ROWS:
        raise ValueError(f"gemv takes at most {MAX_ROWS} rows, got {m}")
    if rows.shape[1] != operand_columns(k, prologue):
        raise ValueError(f"x has {rows.shape[1]} columns, weight {tuple(weight.shape)} (prologue {prologue})")
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    res, norm_w, summed = GemvPrologue(prologue, residual, norm_weight, eps, activation).tensors(rows, k, "gemv")
    if m:
        _launch(rows, res, norm_w, weight, bias, out, summed, eps, prologue, activation,
                launch or GemvLaunch.choose(n, k, m), trace_buffer)
    shape = (*x.shape[:-1], n)
    return out.view(shape), (summed.view(x.shape) if prologue == Prologue.ADD_RMS_NORM else None)


def operand_columns(k: int, prologue: Prologue) -> int:
    """The columns of x a GEMV of K input features reads: gate and up (2K) for ``GATED``, else K."""
    return 2 * k if prologue == Prologue.GATED else k


def unit_stride(rows: torch.Tensor) -> torch.Tensor:
    return rows if rows.stride(-1) == 1 else rows.contiguous()


@dataclass(frozen=True)
class GemvPrologue:
    """A prologue and its inputs (the quantized GEMVs take it as one argument): ``RMS_NORM``
    ``rms_norm(x, norm_weight, eps)``, ``ADD_RMS_NORM`` the same of ``x + residual`` (also returned),
    ``GATED`` ``activation(x[:, :K]) * x[:, K:]``."""

    kind: Prologue = Prologue.NONE
    residual: torch.Tensor | None = None
    norm_weight: torch.Tensor | None = None
    eps: float = 0.0
    activation: str = "silu"

    def __post_init__(self):
        if self.activation not in ACTIVATION_IDS:
            raise ValueError(f"unknown activation '{self.activation}', known: {sorted(ACTIVATION_IDS)}")

    def tensors(self, rows: torch.Tensor, k: int, what: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(residual rows, norm weight, x + residual buffer)`` the kernels read and write for x's ``rows``
        [M, columns] (x's rows stand in for what the prologue does not use); a ValueError where they do not fit."""
        res = summed = norm_w = rows
        if self.kind in (Prologue.RMS_NORM, Prologue.ADD_RMS_NORM):
            if self.norm_weight is None or self.norm_weight.numel() != k:
                got = None if self.norm_weight is None else tuple(self.norm_weight.shape)
                raise ValueError(f"{what}: {self.kind.name} needs a norm weight of {k} elements, got {got}")
            norm_w = self.norm_weight
        if self.kind == Prologue.ADD_RMS_NORM:
            residual = self.residual
            if residual is None or residual.numel() != rows.numel() or residual.dtype != rows.dtype:
                got = None if residual is None else f"{residual.dtype} of shape {tuple(residual.shape)}"
                raise ValueError(f"{what}: ADD_RMS_NORM needs a residual shaped and typed as x "
                                 f"({rows.dtype}, {rows.numel()} elements), got {got}")
            res, summed = unit_stride(residual.reshape(-1, k)), torch.empty_like(rows)
        return res, norm_w, summed


NO_PROLOGUE = GemvPrologue()


def two_pass(dtype: torch.dtype, prologue: Prologue) -> bool:
    """Whether the norm's 1/rms is computed in a first pass (fp16: the module doc)."""
    return dtype == torch.float16 and prologue in (Prologue.RMS_NORM, Prologue.ADD_RMS_NORM)


def _launch(rows, res, norm_w, weight, bias, out, summed, eps, prologue, activation, launch: GemvLaunch,
            trace_buffer=None):
    m, n, k = rows.shape[0], *weight.shape
    options = pdl.launch_options(rows.device)
    programs = triton.cdiv(n, launch.block_n)
    _gemv_kernel[(programs,)](
        rows, res, norm_w, weight, bias if bias is not None else weight, out, summed,
        trace.kernel_pointer(trace_buffer, programs, out),
        m, n, k, rows.stride(0), res.stride(0), weight.stride(0), out.stride(0), summed.stride(0), float(eps),
        PROLOGUE=int(prologue), ACTIVATION=ACTIVATION_IDS[activation],
        TWO_PASS=two_pass(rows.dtype, prologue),
        HAS_BIAS=bias is not None, BLOCK_M=triton.next_power_of_2(m), BLOCK_N=launch.block_n,
        BLOCK_K=launch.block_k, TRIGGER=int(launch.trigger), PRELOAD=launch.preload,
        TRACE=trace_buffer is not None, num_warps=launch.num_warps, num_stages=1, **options,
    )
