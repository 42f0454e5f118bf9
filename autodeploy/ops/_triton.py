"""When a canonical op runs its Triton kernel instead of the torch reference.

Ops with a Triton kernel use it for CUDA tensors; everything else (the CPU) runs the reference.
``AUTODEPLOY_TRITON_KERNELS=0`` sends CUDA tensors to the reference too (to bisect a numerical
difference). Paged attention is not switched here: it has backends chosen by config.
"""

from __future__ import annotations

import functools
import importlib.util
import os

import torch


@functools.cache
def _has_triton() -> bool:
    return importlib.util.find_spec("triton") is not None


def use_triton(t: torch.Tensor) -> bool:
    return t.is_cuda and os.environ.get("AUTODEPLOY_TRITON_KERNELS", "1") != "0" and _has_triton()
