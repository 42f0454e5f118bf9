"""Canonical rotary position embedding, applied to one tensor.

``rope(x, cos, sin, interleaved)``: cos/sin broadcast against ``x[..., :R]`` where R = cos.shape[-1]
(R < head_dim is partial rotary; the remaining dims pass through unchanged). cos/sin are the values
the model multiplies with, in the model's own layout:
- half-rotate (NeoX / Llama):   x*cos + cat(-x2, x1)*sin      with x1, x2 the two halves
- interleaved (GPT-J / Cohere): x*cos + stack(-x_odd, x_even)*sin  pairwise
On CUDA one Triton kernel computes it (``autodeploy.kernels.rope``).
"""

from __future__ import annotations

import torch

from ._triton import use_triton


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rotate_interleaved(x: torch.Tensor) -> torch.Tensor:
    even, odd = x[..., ::2], x[..., 1::2]
    return torch.stack((-odd, even), dim=-1).flatten(-2)


def rope_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> torch.Tensor:
    rot = cos.shape[-1]
    x_rot, x_pass = x[..., :rot], x[..., rot:]
    rotate = rotate_interleaved if interleaved else rotate_half
    out = x_rot * cos + rotate(x_rot) * sin
    if x_pass.shape[-1] == 0:
        return out
    return torch.cat((out, x_pass), dim=-1)


@torch.library.custom_op("autodeploy::rope", mutates_args=())
def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool = False) -> torch.Tensor:
    if use_triton(x):
        from ..kernels.rope import rope as rope_triton

        return rope_triton(x, cos, sin, interleaved)
    return rope_reference(x, cos, sin, interleaved).contiguous()


@rope.register_fake
def _(x, cos, sin, interleaved=False):
    out_dtype = torch.promote_types(x.dtype, cos.dtype)
    shape = torch.broadcast_shapes(x[..., : cos.shape[-1]].shape, cos.shape)
    return x.new_empty(*shape[:-1], x.shape[-1], dtype=out_dtype)


@torch.library.custom_op("autodeploy::rope_qk", mutates_args=())
def rope_qk(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rope(q, cos, sin), rope(k, cos, sin))``: one launch on CUDA (``fuse_rope_qk``)."""
    if use_triton(q):
        from ..kernels.rope import rope_qk as rope_qk_triton

        return rope_qk_triton(q, k, cos, sin, interleaved)
    return rope_reference(q, cos, sin, interleaved).contiguous(), rope_reference(k, cos, sin, interleaved).contiguous()


@rope_qk.register_fake
def _(q, k, cos, sin, interleaved=False):
    return _rope_fake(q, cos), _rope_fake(k, cos)


def _rope_fake(x: torch.Tensor, cos: torch.Tensor) -> torch.Tensor:
    out_dtype = torch.promote_types(x.dtype, cos.dtype)
    shape = torch.broadcast_shapes(x[..., : cos.shape[-1]].shape, cos.shape)
    return x.new_empty(*shape[:-1], x.shape[-1], dtype=out_dtype)
