"""Canonical RMSNorm: ``rms_norm(x, weight, eps) = (x / sqrt(mean(x^2) + eps)) * weight``.

Computed in fp32, returned in x's dtype. Model spellings that differ only in where the cast to the
input dtype happens (Llama casts before the weight multiply, Gemma after, Gemma adds 1 to the
weight) all map here; the weight argument is whatever tensor the model multiplies with.

``fused_add_rms_norm(x, residual, weight, eps)`` returns ``(rms_norm(x + residual), x + residual)``:
the residual add of a decoder layer and the norm after it in one pass (``fuse_add_rms_norm``).
On CUDA both run Triton kernels (``autodeploy.kernels.norm``).
"""

from __future__ import annotations

import torch

from ._triton import use_triton


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (normed * weight.float()).to(x.dtype)


@torch.library.custom_op("autodeploy::rms_norm", mutates_args=())
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if use_triton(x):
        from ..kernels.norm import rms_norm as rms_norm_triton

        return rms_norm_triton(x, weight, eps)
    return rms_norm_reference(x, weight, eps)


@rms_norm.register_fake
def _(x, weight, eps):
    return torch.empty_like(x)


@torch.library.custom_op("autodeploy::fused_add_rms_norm", mutates_args=())
def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    if use_triton(x):
        from ..kernels.norm import add_rms_norm

        return add_rms_norm(x, residual, weight, eps)
    summed = x + residual
    return rms_norm_reference(summed, weight, eps), summed


@fused_add_rms_norm.register_fake
def _(x, residual, weight, eps):
    summed = torch.empty_like(x, dtype=torch.promote_types(x.dtype, residual.dtype))
    return torch.empty_like(summed), summed.clone()
