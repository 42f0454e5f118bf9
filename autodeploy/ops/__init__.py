"""Canonical ops: ``torch.ops.autodeploy.*``.

Each op is a ``torch.library.custom_op`` with a pure-torch reference implementation (runs on CPU)
and a fake implementation for shape propagation. Later passes match only these ops. Paged-attention
backends (torch, Triton, FlashInfer) are ops with one schema, listed in ``attention_backends`` and
chosen by configuration; the Triton kernels they call live in ``autodeploy.kernels``.
"""

from . import (  # noqa: F401  (registers the ops)
    attention,
    collectives,
    fused_linear,
    mla,
    mlp,
    norm,
    paged_attention,
    paged_attention_flashinfer,
    paged_attention_triton,
    quant_linear,
    rope,
    state_ops,
)

__all__ = ["attention", "collectives", "fused_linear", "mla", "mlp", "norm", "paged_attention", "paged_attention_flashinfer", "paged_attention_triton", "quant_linear", "rope", "state_ops"]
