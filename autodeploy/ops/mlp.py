"""Canonical MLP ops: gated MLP (SwiGLU / GeGLU) and mixture of experts.

``swiglu(x, w_gate, w_up, w_down, activation)`` = ``(act(x @ w_gate.T) * (x @ w_up.T)) @ w_down.T``
with ``activation`` one of ``silu`` (SwiGLU), ``gelu`` or ``gelu_tanh`` (GeGLU).
``fuse_gate_up`` turns it into one GEMM on the gate and up rows stacked in one weight followed by
``swiglu_down`` (``ops/fused_linear.py``); on CUDA ``act(gate) * up`` is one Triton kernel
(``autodeploy.kernels.activation``) reading the two halves of that GEMM's output in place.

``moe(x[T, H], topk_ids[T, K], topk_weights[T, K], w_gate_up[E, 2I, H], w_down[E, H, I])``: each
token goes through its K experts (a gated MLP whose gate and up rows are stacked in ``w_gate_up``,
gate first) and the outputs are summed with the routing weights. Precision follows transformers'
``batched_mm`` experts: the expert GEMMs and the gating run in x's dtype, the routing-weighted sum
accumulates in fp32, and the result is rounded to x's dtype once. Routing itself (router linear,
softmax/top-k, renormalisation) stays in the graph as ordinary ops.

The layouts transformers' experts modules declare are options of the same op: ``b_gate_up[E, 2I]`` and
``b_down[E, H]`` add biases; ``transposed`` weights are stored ``[E, H, 2I]`` / ``[E, I, H]``
(``x @ w``); ``interleaved`` gate/up outputs alternate (gate 0, up 0, gate 1, ...). ``activation``
``clamped_swiglu`` is gpt-oss's gate: ``gate.clamp(max=limit)``, ``up.clamp(-limit, limit)``,
``(up + 1) * gate * sigmoid(alpha * gate)`` with ``swiglu_alpha`` / ``swiglu_limit``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ._triton import use_triton

ACTIVATIONS = {
    "silu": F.silu,
    "gelu": F.gelu,
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
}


def _activation(name: str):
    if name not in ACTIVATIONS:
        raise ValueError(f"unknown activation '{name}', known: {sorted(ACTIVATIONS)}")
    return ACTIVATIONS[name]


@torch.library.custom_op("autodeploy::swiglu", mutates_args=())
def swiglu(
    x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor, activation: str = "silu"
) -> torch.Tensor:
    return F.linear(gated_activation(F.linear(x, w_gate), F.linear(x, w_up), activation), w_down)


@swiglu.register_fake
def _(x, w_gate, w_up, w_down, activation="silu"):
    return x.new_empty(*x.shape[:-1], w_down.shape[0])


def gated_activation(gate: torch.Tensor, up: torch.Tensor, activation: str) -> torch.Tensor:
    """``act(gate) * up``: one Triton kernel on CUDA, the torch reference elsewhere."""
    if use_triton(gate):
        from ..kernels.activation import act_mul

        return act_mul(gate, up, activation)
    return _activation(activation)(gate) * up


CLAMPED_SWIGLU = "clamped_swiglu"
MOE_ACTIVATIONS = (*ACTIVATIONS, CLAMPED_SWIGLU)


def expert_gate(gate: torch.Tensor, up: torch.Tensor, activation: str, alpha: float | None = None,
                limit: float | None = None) -> torch.Tensor:
    """The gated activation of one expert's projections (``moe``'s ``activation``)."""
    if activation != CLAMPED_SWIGLU:
        return _activation(activation)(gate) * up
    if alpha is None or limit is None:
        raise ValueError(f"activation '{CLAMPED_SWIGLU}' needs swiglu_alpha and swiglu_limit")
    gate, up = gate.clamp(max=limit), up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


def split_gate_up(gate_up: torch.Tensor, interleaved: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(gate, up) of a projection output: halves, or alternating columns when ``interleaved``."""
    if interleaved:
        return gate_up[..., 0::2], gate_up[..., 1::2]
    return gate_up.chunk(2, dim=-1)


@torch.library.custom_op("autodeploy::moe", mutates_args=())
def moe(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    activation: str = "silu",
    b_gate_up: torch.Tensor | None = None,
    b_down: torch.Tensor | None = None,
    transposed: bool = False,
    interleaved: bool = False,
    swiglu_alpha: float | None = None,
    swiglu_limit: float | None = None,
) -> torch.Tensor:
    if activation not in MOE_ACTIVATIONS:
        raise ValueError(f"unknown activation '{activation}', known: {sorted(MOE_ACTIVATIONS)}")
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for expert in torch.unique(topk_ids).tolist():
        token_idx, slot = torch.where(topk_ids == expert)
        w1, w2 = (w[expert].t() if transposed else w[expert] for w in (w_gate_up, w_down))
        gate_up = F.linear(x[token_idx], w1, None if b_gate_up is None else b_gate_up[expert])
        hidden = expert_gate(*split_gate_up(gate_up, interleaved), activation, swiglu_alpha, swiglu_limit)
        expert_out = F.linear(hidden, w2, None if b_down is None else b_down[expert]).float()
        out.index_add_(0, token_idx, expert_out * topk_weights[token_idx, slot, None].float())
    return out.to(x.dtype)


@moe.register_fake
def _(x, topk_ids, topk_weights, w_gate_up, w_down, activation="silu", b_gate_up=None, b_down=None,
      transposed=False, interleaved=False, swiglu_alpha=None, swiglu_limit=None):
    return torch.empty_like(x)
