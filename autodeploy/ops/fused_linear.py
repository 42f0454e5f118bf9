"""Linear layers with the step before them fused in (``fuse_norm_linear``, ``fuse_gate_up``).

- ``rms_norm_linear(x, norm_weight, eps, weight, bias)`` =
  ``linear(rms_norm(x, norm_weight, eps), weight, bias)``;
- ``add_rms_norm_linear(x, residual, norm_weight, eps, weight, bias)`` =
  ``(linear(rms_norm(x + residual, ...), weight, bias), x + residual)``;
- ``swiglu_down(gate_up, w_down, activation)`` = ``linear(act(gate) * up, w_down)`` where ``gate`` and
  ``up`` are the two halves of ``gate_up`` (gate first): the down projection of a gated MLP whose gate
  and up GEMMs are one;
- ``linear(x, weight, bias)`` = ``F.linear``: the linears no norm or activation precedes (attention
  output, LM head), so that they too run as the GEMV (``decode_linear``).

On CUDA a call of at most ``GEMV_MAX_ROWS`` rows on a weight of at most ``GEMV_MAX_WEIGHT_BYTES``
is one Triton GEMV with the norm or the activation fused into its operand loads
(``autodeploy.kernels.gemv``): one launch instead of two. Other calls, and the CPU, run the pieces:
the norm or activation op (its Triton kernel on CUDA), then the GEMM, through cuBLAS or cuBLASLt as
timed for its shape (``blas_choice``). Each op is exactly its composition on the CPU.
"""

from __future__ import annotations

import os

import torch

from ._triton import use_triton
from .blas_choice import linear as _gemm
from .mlp import gated_activation
from .norm import fused_add_rms_norm, rms_norm

# Where the GEMV beats norm/activation kernel + cuBLAS on the H200 (docs/perf.md, 2026-12-03): one
# row. All linears of a SmolLM2-135M step (1-3.5 MB weights): 0.249 ms against 0.660; of a
# Llama-3.1-8B step (34-235 MB): 3.47 ms against 3.98 (4 x 1024 tiles, the first one loaded before
# the PDL wait). The 8B LM head (1.05 GB, the final norm folded in): engine step 3.932 / 3.938 ms
# against 3.943 / 3.940 with the head on cuBLAS after a norm kernel (2026-12-04, one machine, two
# rounds). Larger weights were not measured: they stay on cuBLAS. At 4 rows it lost on both
# shapes (each program applies the prologue to every row).
# AUTODEPLOY_GEMV_MAX_ROWS=0 turns the GEMV off, AUTODEPLOY_GEMV_MAX_WEIGHT_MB sets the weight cap
# (read once: the check sits on every linear's path).
GEMV_MAX_ROWS = int(os.environ.get("AUTODEPLOY_GEMV_MAX_ROWS", "1"))
GEMV_MAX_WEIGHT_BYTES = int(float(os.environ.get("AUTODEPLOY_GEMV_MAX_WEIGHT_MB", "2048")) * (1 << 20))


def _gemv_kernels(x: torch.Tensor, weight: torch.Tensor):
    """The GEMV kernel module when this call should use it, else None."""
    if not use_triton(x):
        return None
    from ..kernels import gemv

    small = weight.numel() * weight.element_size() <= GEMV_MAX_WEIGHT_BYTES
    return gemv if small and gemv.gemv_rows_ok(x, weight, GEMV_MAX_ROWS) else None


def _linear_fake(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], weight.shape[0])


@torch.library.custom_op("autodeploy::rms_norm_linear", mutates_args=())
def rms_norm_linear(
    x: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    gemv = _gemv_kernels(x, weight)
    if gemv is not None:
        prologue = gemv.Prologue.RMS_NORM
        return gemv.gemv(x, weight, bias, prologue=prologue, norm_weight=norm_weight, eps=eps)[0]
    return _gemm(rms_norm(x, norm_weight, eps), weight, bias)


@rms_norm_linear.register_fake
def _(x, norm_weight, eps, weight, bias=None):
    return _linear_fake(x, weight)


@torch.library.custom_op("autodeploy::add_rms_norm_linear", mutates_args=())
def add_rms_norm_linear(
    x: torch.Tensor,
    residual: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    gemv = _gemv_kernels(x, weight)
    if gemv is not None and residual.shape == x.shape and residual.dtype == x.dtype:
        return gemv.gemv(x, weight, bias, prologue=gemv.Prologue.ADD_RMS_NORM, residual=residual,
                         norm_weight=norm_weight, eps=eps)
    normed, summed = fused_add_rms_norm(x, residual, norm_weight, eps)
    return _gemm(normed, weight, bias), summed


@add_rms_norm_linear.register_fake
def _(x, residual, norm_weight, eps, weight, bias=None):
    summed = torch.empty_like(x, dtype=torch.promote_types(x.dtype, residual.dtype))
    return _linear_fake(summed, weight), summed


@torch.library.custom_op("autodeploy::swiglu_down", mutates_args=())
def swiglu_down(gate_up: torch.Tensor, w_down: torch.Tensor, activation: str = "silu") -> torch.Tensor:
    gemv = _gemv_kernels(gate_up, w_down)
    if gemv is not None:
        return gemv.gemv(gate_up, w_down, prologue=gemv.Prologue.GATED, activation=activation)[0]
    gate, up = gate_up.chunk(2, dim=-1)
    return _gemm(gated_activation(gate, up, activation), w_down)


@swiglu_down.register_fake
def _(gate_up, w_down, activation="silu"):
    return _linear_fake(gate_up, w_down)


@torch.library.custom_op("autodeploy::linear", mutates_args=())
def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    gemv = _gemv_kernels(x, weight)
    if gemv is not None:
        return gemv.gemv(x, weight, bias)[0]
    return _gemm(x, weight, bias)


@linear.register_fake
def _(x, weight, bias=None):
    return _linear_fake(x, weight)
