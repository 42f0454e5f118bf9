"""Programmatic dependent launch (PDL): a kernel may start while the kernel before it finishes.

On sm_90+ a launch with the programmatic-serialization attribute may begin once every program of
the previous kernel has called ``griddepcontrol.launch_dependents`` (or exited). Its programs must
execute ``griddepcontrol.wait`` before they read anything an earlier kernel wrote: the wait returns
when the previous grid has completed and its memory is visible. What may come before the wait is
what no kernel of the step writes: weights; the step's metadata, which one host-to-device copy
puts in place before the step's first kernel (a copy is never launched early, and every later
kernel starts after it); and the KV pool below each sequence's context length, written by earlier
steps (a step writes only its new keys' slots). In a decode step of a few tokens, where a kernel
streams its weights in a few microseconds, this hides the launch and ramp of one kernel behind the
tail of the one before it (the GEMV loads its first weight tile, the attention finds its sequence
and loads its first block of cached keys); CUDA graphs keep the attribute as programmatic edges.

The contract every kernel launched with :func:`launch_options` keeps:

- every program calls :func:`wait` (unconditionally, before its first read of activations or
  metadata and before any store): then a kernel completes only after its predecessor did, so a
  later kernel that waits for it, PDL or not, sees everything before it too;
- it calls :func:`allow_dependents` early, so the next kernel's programs can be placed on free SMs
  while this one streams (they hold their SM slots while they wait).

The Triton interpreter has no inline assembly: kernels take ``PDL`` as a constexpr and are
launched without PDL there and on GPUs before sm_90. ``AUTODEPLOY_PDL=0`` turns it off.
"""

from __future__ import annotations

import functools
import os
from enum import IntEnum

import torch
import triton
import triton.language as tl


class Trigger(IntEnum):
    """Where a program lets the next kernel launch (the next kernel launches once every program of
    this one got there or exited)."""

    START = 0  # before the wait: the next kernel may launch before this one's inputs are ready
    AFTER_WAIT = 1  # after the wait: at most one kernel ahead waits for SM slots
    AFTER_LOOP = 2  # after the main loop (GEMV: the weight loop; attention: at exit): only the ends overlap


_START, _AFTER_WAIT = tl.constexpr(Trigger.START.value), tl.constexpr(Trigger.AFTER_WAIT.value)


@functools.cache
def _device_supports_pdl(index: int) -> bool:
    return torch.cuda.get_device_capability(index) >= (9, 0)


def enabled(device: torch.device) -> bool:
    """Whether kernels on ``device`` are launched with PDL."""
    if device.type != "cuda" or os.environ.get("TRITON_INTERPRET") == "1":
        return False
    if os.environ.get("AUTODEPLOY_PDL", "1") == "0":
        return False
    return _device_supports_pdl(device.index if device.index is not None else torch.cuda.current_device())


def launch_options(device: torch.device) -> dict:
    """The ``PDL`` constexpr and the launch option of a kernel that keeps the contract above."""
    on = enabled(device)
    return {"PDL": True, "launch_pdl": True} if on else {"PDL": False}


@triton.jit
def allow_dependents(PDL: tl.constexpr):
    """Let the next kernel launch once every program of this one has got here (or exited)."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def wait(PDL: tl.constexpr):
    """Block until the previous kernel has completed and its writes are visible."""
    if PDL:
        tl.extra.cuda.gdc_wait()


@triton.jit
def load_around_wait(ptrs, mask, empty, PDL: tl.constexpr, TRIGGER: tl.constexpr, PRELOAD: tl.constexpr):
    """A kernel's first weight tile (``empty``: zeros of its shape and type), loaded before the wait where
    ``PRELOAD`` (no kernel of the step writes weights) or after it, with the trigger where ``TRIGGER`` says
    (``Trigger.START`` / ``AFTER_WAIT``; ``AFTER_LOOP`` is the caller's)."""
    tile = empty
    if PRELOAD:
        tile = tl.load(ptrs, mask=mask, other=0)
    if TRIGGER == _START:
        allow_dependents(PDL)
    wait(PDL)
    if TRIGGER == _AFTER_WAIT:
        allow_dependents(PDL)
    if not PRELOAD:
        tile = tl.load(ptrs, mask=mask, other=0)
    return tile
