"""Triton gated activation: ``out = act(gate) * up`` (SwiGLU / GeGLU), one fused elementwise pass.

Launched under PDL (``kernels/pdl.py``). ``gate`` and ``up`` are [rows, I] views with unit column
stride; they may be the two halves of one fused gate/up GEMM output (row stride 2I), so the split
costs no copy. Math in fp32, one rounding.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import pdl

ACTIVATION_IDS = {"silu": 0, "gelu": 1, "gelu_tanh": 2}
BLOCK = 1024


@triton.jit
def _tanh(x):
    return 1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)


@triton.jit
def _act_mul_kernel(gate_ptr, up_ptr, out_ptr, stride_g, stride_u, stride_o, n_cols,
                    ACTIVATION: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    pdl.allow_dependents(PDL)  # the next kernel (a GEMM's weight preload) may start meanwhile
    pdl.wait(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    gate = tl.load(gate_ptr + row * stride_g + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(up_ptr + row * stride_u + cols, mask=mask, other=0.0).to(tl.float32)
    out = activate(gate, ACTIVATION) * up
    tl.store(out_ptr + row * stride_o + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def activate(gate, ACTIVATION: tl.constexpr):
    """``act(gate)`` of an fp32 tensor; ``ACTIVATION`` is a value of ``ACTIVATION_IDS``."""
    if ACTIVATION == 0:
        return gate / (1.0 + tl.exp(-gate))
    elif ACTIVATION == 1:
        return 0.5 * gate * (1.0 + tl.math.erf(gate * 0.7071067811865476))
    else:
        return 0.5 * gate * (1.0 + _tanh(0.7978845608028654 * (gate + 0.044715 * gate * gate * gate)))


def act_mul(gate: torch.Tensor, up: torch.Tensor, activation: str = "silu") -> torch.Tensor:
    """``act(gate) * up`` for [..., I] tensors; returns a contiguous tensor of gate's dtype."""
    if activation not in ACTIVATION_IDS:
        raise ValueError(f"unknown activation '{activation}', known: {sorted(ACTIVATION_IDS)}")
    n_cols = gate.shape[-1]
    gate2, up2 = (t.reshape(-1, n_cols) for t in (gate, up))
    gate2, up2 = (t if t.stride(-1) == 1 else t.contiguous() for t in (gate2, up2))
    out = torch.empty(gate2.shape, dtype=gate.dtype, device=gate.device)
    if out.numel():
        grid = (gate2.shape[0], triton.cdiv(n_cols, BLOCK))
        _act_mul_kernel[grid](gate2, up2, out, gate2.stride(0), up2.stride(0), out.stride(0), n_cols,
                              ACTIVATION=ACTIVATION_IDS[activation], BLOCK=BLOCK, num_warps=4,
                              **pdl.launch_options(out.device))
    return out.view(*gate.shape)
