"""cuBLAS or cuBLASLt for the GEMM of a linear layer in a decode batch, chosen by timing both once.

torch sends a GEMM to cuBLAS unless told otherwise (``torch.backends.cuda.preferred_blas_library``).
cuBLASLt chooses its kernels with a heuristic of its own, and for some decode-batch shapes it
chooses better. H200, Llama-3.1-8B linears, one GEMM at a time in a CUDA graph (2026-12-04,
``docs/perf.md``): the down projection at 64 rows 36.5 us (cuBLAS) against 32.1 (cuBLASLt), at 32
rows 34.1 against 31.4; at 8 and 16 rows cuBLAS is faster (33.8 against 36.4), and at 8,192 rows
(prefill) cuBLAS is faster on every projection (5.10 against 5.46 ms per layer). No one rule fits,
so each (rows bucket, N, K, dtype, bias) of at most ``MAX_TUNED_ROWS`` rows is timed the first
time it runs outside a CUDA-graph capture, as TensorRT-LLM's GEMM plugin profiles its algorithms
per row bucket. The decode graphs' warm-up forward, one per captured batch size, meets every
bucket before its capture does.

cuBLASLt must win by ``MARGIN``, so that timing noise does not flip a close call (and a shape's
numerics) between runs. Each library is timed twice, alternating, and keeps its faster round: timed once
each, cuBLAS first on a GPU whose clock was still ramping up, the choice sent the 8B qkv GEMM at 16 rows to
cuBLASLt (17.2 us against cuBLAS's 16.2), and a 3% margin then made the batch-16 step slower (5.353
against 5.228 ms), which an 8% margin hid. With the alternating rounds (H200, 2026-12-04, one machine,
two rounds each): 3% picks cuBLASLt for the down and gate/up GEMMs at 64 rows only, and the engine step
takes 6.094 / 6.104 ms at batch 64 against 6.149 / 6.140 with 8%, 5.222 / 5.216 against 5.236 / 5.212 at
batch 16, 5.596 / 5.569 against 5.622 / 5.564 at 32.

The library is torch's process-wide setting, set around each call and restored after it: the engine
runs its model on one thread.

``AUTODEPLOY_BLAS`` = ``auto`` (default), ``cublas`` or ``cublaslt`` forces every tuned shape.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F

log = logging.getLogger("autodeploy.blas")

CUBLAS, CUBLASLT = "cublas", "cublaslt"
# Larger GEMMs stay on cuBLAS: at 8,192 rows it won every projection, and eager prefill steps meet
# many row counts (timing each new bucket there would stall a step).
MAX_TUNED_ROWS = 512
MARGIN = 0.03  # cuBLASLt must be this much faster (see the module docstring)
TIMED_CALLS = 16
ROUNDS = 2  # timings of each library, alternating (see BlasChooser._choose)
# GPU cycles of the sleep kernel queued before the timed calls: ~0.5 ms, longer than the host takes to
# queue 16 small GEMMs (~15 us each), so the GPU never waits for the host inside the timed span
HEAD_START_CYCLES = 1_000_000


@dataclass(frozen=True)
class GemmKey:
    """A linear layer's GEMM as the choice sees it: rows rounded up to a power of two."""

    device: int
    dtype: torch.dtype
    rows_bucket: int
    n: int
    k: int
    bias: bool


def rows_bucket(rows: int) -> int:
    return 1 << max(0, (rows - 1).bit_length())


# (backend, call) -> ms per call; replaced in tests. ``call(i)`` runs the GEMM on weight copy i.
Timer = Callable[[str, Callable[[int], object]], float]


class BlasChooser:
    """Remembers, per ``GemmKey``, which library ran it faster; times both on first use."""

    def __init__(self, timer: Timer | None = None, margin: float = MARGIN, mode: str | None = None):
        self._timer = timer or time_backend
        self.margin = margin
        self.mode = mode or os.environ.get("AUTODEPLOY_BLAS", "auto")
        if self.mode not in ("auto", CUBLAS, CUBLASLT):
            raise ValueError(f"AUTODEPLOY_BLAS must be auto, {CUBLAS} or {CUBLASLT}, got {self.mode!r}")
        self.choices: dict[GemmKey, str] = {}

    def backend(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> str | None:
        """The library for ``F.linear(x, weight, bias)``, or None to leave torch's."""
        rows = x.numel() // max(x.shape[-1], 1)
        if not x.is_cuda or rows == 0 or rows > MAX_TUNED_ROWS:
            return None
        if self.mode != "auto":
            return self.mode
        key = GemmKey(x.device.index or 0, x.dtype, rows_bucket(rows), weight.shape[0], weight.shape[1],
                      bias is not None)
        choice = self.choices.get(key)  # the common case: no capture query on every eager call
        if choice is not None:
            return choice
        capturing = torch.cuda.is_current_stream_capturing()
        return self.lookup(key, lambda: _timed_call(x, weight, bias), capturing=capturing)

    def lookup(self, key: GemmKey, make_call: Callable[[], Callable[[int], object]],
               capturing: bool = False) -> str | None:
        """The remembered choice for ``key``; else both timed now on ``make_call()``, unless a capture is
        under way (then None: torch's default, not remembered)."""
        choice = self.choices.get(key)
        if choice is None and not capturing:
            choice = self.choices[key] = self._choose(make_call())
            log.debug("GEMM %s: %s", key, choice)
        return choice

    def _choose(self, run: Callable[[int], object]) -> str:
        """Each library timed ``ROUNDS`` times, alternating, and its fastest round kept: a GPU whose
        clock is still ramping up after idling makes whichever library goes first look slower."""
        cublas = lt = float("inf")
        for _ in range(ROUNDS):
            cublas = min(cublas, self._timer(CUBLAS, run))
            try:
                lt = min(lt, self._timer(CUBLASLT, run))
            except RuntimeError as exc:  # e.g. no cuBLASLt algorithm for this shape or alignment
                log.debug("cuBLASLt cannot run this GEMM (%s): cuBLAS", exc)
                return CUBLAS
        return CUBLASLT if lt < cublas * (1 - self.margin) else CUBLAS


@contextlib.contextmanager
def preferred_blas(backend: str | None) -> Iterator[None]:
    """torch's BLAS library set to ``backend`` for the calls inside (None: unchanged)."""
    if backend is None:
        yield
        return
    previous = torch.backends.cuda.preferred_blas_library()
    torch.backends.cuda.preferred_blas_library(backend)
    try:
        yield
    finally:
        torch.backends.cuda.preferred_blas_library(previous)


def _timed_call(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> Callable[[int], object]:
    """``call(i)``: the linear on weight copy ``i % copies``. A decode step streams each weight from
    DRAM once; timing one weight over and over would time it from L2 (50 MB on the H200), so weights
    under twice the L2 size are copied until the copies exceed it (temporarily)."""
    l2 = getattr(torch.cuda.get_device_properties(x.device), "L2_cache_size", 50 << 20)
    copies = -(-2 * l2 // (weight.numel() * weight.element_size()))
    weights = [weight] + [weight.clone() for _ in range(min(copies, 64) - 1)]
    return lambda i: F.linear(x, weights[i % len(weights)], bias)


def time_backend(backend: str, run: Callable[[int], object], calls: int = TIMED_CALLS) -> float:
    """ms per call of ``run`` under ``backend``, on the current stream. A sleep kernel queued first keeps
    the GPU busy while the host launches the timed calls, so launch overhead is not measured."""
    with preferred_blas(backend):
        for i in range(2):
            run(i)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(HEAD_START_CYCLES)
        start.record()
        for i in range(calls):
            run(i)
        end.record()
        end.synchronize()
    return start.elapsed_time(end) / calls


CHOOSER = BlasChooser()


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear`` through the library ``CHOOSER`` picked for this shape (CUDA, at most 512 rows)."""
    backend = CHOOSER.backend(x, weight, bias)
    with preferred_blas(backend):
        return F.linear(x, weight, bias)
