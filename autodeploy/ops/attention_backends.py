"""Paged-attention backends: name -> a custom op with the schema of ``autodeploy::paged_attention``.

Every backend implements the same contract (write k/v into the shared pool layout, then causal
paged attention; see ``autodeploy.ops.paged_attention``), so ``insert_kv_cache`` only chooses which
op to insert (``CompileConfig.attention_backend``); nothing else in the graph changes. Entries are
lazy (``"module:attr"``), so an optional backend's dependency is imported only when it is chosen;
out-of-tree backends register through the ``autodeploy.attention_backends`` entry-point group.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from ..errors import ConfigError
from ..registry import Registry

FEATURES = ("sliding_window", "logit_softcap", "sinks", "chunk_size", "alibi_slopes")


def _always(device: torch.device) -> str | None:
    return None


@dataclass(frozen=True)
class AttentionBackend:
    """One implementation of paged attention.

    ``availability(device)`` returns why the backend cannot run there (None: it can);
    ``unsupported`` names features of ``FEATURES`` it lacks; ``head_dims`` limits head sizes;
    ``capturable``: the op never synchronises with the host, so a CUDA graph can capture it.
    """

    name: str
    op: Any  # torch OpOverload with the schema of autodeploy::paged_attention.default
    capturable: bool = False
    availability: Callable[[torch.device], str | None] = _always
    unsupported: frozenset[str] = field(default_factory=frozenset)
    head_dims: tuple[int, ...] | None = None

    def check_layer(self, head_dim: int, used: dict[str, Any], where: str) -> None:
        """Raise ConfigError if this backend cannot run a layer using the features in ``used``."""
        missing = [f for f in FEATURES if used.get(f) not in (None, 0, 0.0) and f in self.unsupported]
        if missing:
            raise ConfigError(f"{where}: attention backend '{self.name}' does not support {', '.join(missing)}; "
                              f"use attention_backend=triton or torch")
        if self.head_dims is not None and head_dim not in self.head_dims:
            raise ConfigError(f"{where}: attention backend '{self.name}' supports head dims {self.head_dims}, "
                              f"not {head_dim}; use attention_backend=triton or torch")


ATTENTION_BACKENDS: Registry[AttentionBackend] = Registry(
    "attention backend", entry_point_group="autodeploy.attention_backends"
)
for _name, _target in {
    "torch": "autodeploy.ops.paged_attention:TORCH_BACKEND",
    "triton": "autodeploy.ops.paged_attention_triton:TRITON_BACKEND",
    "flashinfer": "autodeploy.ops.paged_attention_flashinfer:FLASHINFER_BACKEND",
}.items():
    ATTENTION_BACKENDS.register_lazy(_name, _target)


def triton_runs_on(device: torch.device) -> str | None:
    """Why Triton kernels cannot run on ``device`` (None: they can)."""
    if importlib.util.find_spec("triton") is None:
        return "triton is not installed"
    if device.type == "cuda":
        return None
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1":
        return None  # the interpreter: slow, for tests
    return f"Triton kernels need a CUDA device (or TRITON_INTERPRET=1 on the CPU), not {device.type}"


def default_backend(device: torch.device) -> str:
    """``auto``: the Triton kernels on CUDA, the torch reference everywhere else."""
    return "triton" if device.type == "cuda" and triton_runs_on(device) is None else "torch"


def resolve_attention_backend(name: str, device: torch.device) -> AttentionBackend:
    """The backend called ``name`` (``auto``: :func:`default_backend`), checked to run on ``device``."""
    backend = ATTENTION_BACKENDS.get(default_backend(device) if name == "auto" else name)
    reason = backend.availability(device)
    if reason is not None:
        raise ConfigError(f"attention backend '{backend.name}' cannot run on {device}: {reason}")
    return backend
