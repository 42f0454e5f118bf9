"""Timeline probes inside kernels: when each program reached which point, on the GPU's global clock.

A kernel compiled with ``TRACE`` stores ``EVENTS`` int64 slots per program into a ``[programs,
EVENTS]`` buffer: slot 0 holds the SM the program ran on, slots 1.. the ``%globaltimer`` (ns) at the
kernel's numbered events. Without ``TRACE`` the probes compile to nothing, so the production kernels
carry them at no cost; ``bench/probes/layer_chain.py --timeline`` reads them to see where a decode step's
microseconds go between kernels, which no profiler shows under PDL (the kernels overlap).

A probe reads the clock only once ``dep`` is computed (it is an input of the timer's inline asm), so
"after the loads" means after a value that needed them, not after their issue.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

EVENTS = 10  # slot 0: the SM; slots 1..9: events
UNSET = -1
_ROW = tl.constexpr(EVENTS)  # the kernels' spelling (a jit function reads only constexpr globals)


@triton.jit
def program_index():
    """The program's linear index over a grid of up to three dimensions."""
    return (tl.program_id(2) * tl.num_programs(1) + tl.program_id(1)) * tl.num_programs(0) + tl.program_id(0)


@triton.jit
def stamp(trace_ptr, event: tl.constexpr, dep, TRACE: tl.constexpr):
    """Store the global clock at ``event`` (1..EVENTS-1) once ``dep`` (an int32 scalar) is known; event 1
    also stores the SM."""
    if TRACE:
        now = tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l,r", [dep], dtype=tl.int64,
                                        is_pure=False, pack=1)
        row = trace_ptr + program_index().to(tl.int64) * _ROW
        tl.store(row + event, now)
        if event == 1:
            tl.store(row, tl.extra.cuda.smid().to(tl.int64))


def buffer(programs: int, device: torch.device) -> torch.Tensor:
    """A trace buffer for ``programs`` programs, every slot UNSET (events a program never reached)."""
    return torch.full((programs, EVENTS), UNSET, dtype=torch.int64, device=device)


def kernel_pointer(buffer: torch.Tensor | None, programs: int, unused: torch.Tensor) -> torch.Tensor:
    """What a kernel's ``trace_ptr`` gets: ``buffer``, checked to hold ``programs`` rows, or (no tracing)
    ``unused``, any tensor of the launch."""
    if buffer is None:
        return unused
    if tuple(buffer.shape) != (programs, EVENTS) or buffer.dtype != torch.int64:
        raise ValueError(f"trace buffer must be int64 [{programs}, {EVENTS}], got {buffer.dtype} {tuple(buffer.shape)}")
    return buffer
