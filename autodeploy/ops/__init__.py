"""Canonical ops: ``torch.ops.autodeploy.*``.

Each op is a ``torch.library.custom_op`` with a pure-torch reference implementation (runs on CPU)
and a fake implementation for shape propagation. Later passes match only these ops. GPU backends
(Triton, FlashInfer) register against the same contracts in ``autodeploy.kernels`` and are chosen
by configuration, never by rewriting the graph differently.
"""

from . import attention, mlp, norm, paged_attention, rope  # noqa: F401  (registers the ops)

__all__ = ["attention", "mlp", "norm", "paged_attention", "rope"]
