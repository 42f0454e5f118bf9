"""Canonical RMSNorm: ``rms_norm(x, weight, eps) = (x / sqrt(mean(x^2) + eps)) * weight``.

Computed in fp32, returned in x's dtype. Model spellings that differ only in where the cast to the
input dtype happens (Llama casts before the weight multiply, Gemma after, Gemma adds 1 to the
weight) all map here; the weight argument is whatever tensor the model multiplies with.
"""

from __future__ import annotations

import torch


@torch.library.custom_op("autodeploy::rms_norm", mutates_args=())
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (normed * weight.float()).to(x.dtype)


@rms_norm.register_fake
def _(x, weight, eps):
    return torch.empty_like(x)
