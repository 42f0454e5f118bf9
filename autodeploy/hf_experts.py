"""autodeploy's entry in transformers' ``ExpertsInterface``: MoE experts exported as ``autodeploy::moe``.

transformers dispatches every experts module decorated with ``@use_experts_implementation`` (Mixtral,
Qwen2/3-MoE, OLMoE, PhiMoE, ...) to the function registered under ``config._experts_implementation``.
We register ``"autodeploy"`` and build models with it. For the layout the canonical op computes
(stacked ``gate_up_proj[E, 2I, H]`` with the gate rows first, ``down_proj[E, H, I]``, no biases, the
default gate ``act(gate) * up`` with an activation the op knows) the function returns
``autodeploy::moe`` itself, so export records the canonical op and no rule has to recognise
transformers' experts code, whatever a release changes in it. Any other layout runs transformers'
``batched_mm`` code, which the ``match_moe`` rule rewrites or ``canonicalize_moe`` refuses, naming
the module. Each experts module is planned once, on the real model before export
(:func:`plan_experts`), because telling its activation apart needs real numbers.
"""

from __future__ import annotations

import logging
import weakref
from dataclasses import dataclass

import torch
from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS, ExpertsInterface, _default_apply_gate

from .errors import ExportError
from .ops.mlp import ACTIVATIONS

log = logging.getLogger("autodeploy.experts")

IMPLEMENTATION = "autodeploy"
FALLBACK = "batched_mm"  # transformers' static-shape experts code: what match_moe rewrites
_LAYOUT_FLAGS = ("has_gate", "is_concatenated", "is_transposed", "has_bias")


@dataclass(frozen=True)
class ExpertsPlan:
    """How one experts module is exported: ``autodeploy::moe`` with ``activation``, or ``FALLBACK``
    for the reason given."""

    activation: str | None
    fallback_reason: str | None = None


_PLANS: weakref.WeakKeyDictionary[torch.nn.Module, ExpertsPlan] = weakref.WeakKeyDictionary()


def register() -> None:
    """Make ``experts_implementation="autodeploy"`` known to transformers (idempotent)."""
    if IMPLEMENTATION not in ALL_EXPERTS_FUNCTIONS:
        ExpertsInterface.register(IMPLEMENTATION, experts_forward)


def is_experts_module(module: torch.nn.Module) -> bool:
    """An experts module built by ``@use_experts_implementation`` (it sets these layout flags)."""
    return all(hasattr(module, flag) for flag in _LAYOUT_FLAGS)


def experts_module_paths(model: torch.nn.Module) -> tuple[str, ...]:
    """The module paths of ``model``'s experts modules (``model.layers.0.mlp.experts``, ...)."""
    return tuple(path for path, module in model.named_modules() if is_experts_module(module))


def plan_experts(model: torch.nn.Module) -> None:
    """Plan every experts module of ``model`` (logged where it falls back to ``FALLBACK``)."""
    for path in experts_module_paths(model):
        module = model.get_submodule(path)
        plan = _PLANS[module] = _plan(module)
        if plan.fallback_reason:
            log.warning("experts %s (%s): %s; exported through transformers' %s code for the match_moe rule",
                        path, type(module).__name__, plan.fallback_reason, FALLBACK)


def _plan(module: torch.nn.Module) -> ExpertsPlan:
    reason = _layout_mismatch(module)
    if reason is None:
        activation = activation_name(module.act_fn)
        if activation is not None:
            return ExpertsPlan(activation)
        reason = f"activation {type(module.act_fn).__name__} is none of {sorted(ACTIVATIONS)}"
    return ExpertsPlan(None, reason)


def _layout_mismatch(module: torch.nn.Module) -> str | None:
    """Why ``autodeploy::moe`` cannot compute this module, or None."""
    if not module.has_gate:
        return "experts without a gate"
    if not module.is_concatenated:
        return "gate and up rows interleaved"
    if module.is_transposed:
        return "transposed expert weights"
    if module.has_bias:
        return "expert biases"
    if getattr(module, "has_post_expert_norm", False):
        return "a norm after each expert"
    if getattr(module, "_is_expert_parallel", False):
        return "expert parallelism"
    if getattr(type(module), "_apply_gate", None) is not _default_apply_gate:
        return "its own gate function (_apply_gate)"
    experts, gate_up, hidden = module.gate_up_proj.shape
    if tuple(module.down_proj.shape) != (experts, hidden, gate_up // 2) or gate_up % 2:
        return f"weights gate_up {tuple(module.gate_up_proj.shape)} and down {tuple(module.down_proj.shape)}"
    return None


def activation_name(act_fn) -> str | None:
    """The name in ``ACTIVATIONS`` of the function ``act_fn`` computes, found by evaluating both."""
    probe = torch.linspace(-8.0, 8.0, 257, dtype=torch.float64, device="cpu")
    with torch.no_grad():
        got = act_fn(probe)
        for name, reference in ACTIVATIONS.items():
            if torch.allclose(got, reference(probe), rtol=1e-6, atol=1e-9):
                return name
    return None


def experts_forward(module, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
    """The ``ExpertsInterface`` function: ``out[T, H]`` from ``hidden_states[T, H]`` and each token's
    ``top_k_index[T, K]`` / ``top_k_weights[T, K]``."""
    plan = _PLANS.get(module)
    if plan is None:
        raise ExportError(
            f"experts module {type(module).__name__} reached autodeploy's experts implementation without a plan: "
            "build the model with autodeploy.model_loading.build_meta_model (it plans every experts module)"
        )
    if plan.activation is None:
        return ALL_EXPERTS_FUNCTIONS[FALLBACK](module, hidden_states, top_k_index, top_k_weights)
    _check_operands(module, hidden_states, top_k_index, top_k_weights)
    return torch.ops.autodeploy.moe(
        hidden_states, top_k_index, top_k_weights, module.gate_up_proj, module.down_proj, plan.activation
    )


def _check_operands(module, hidden_states, top_k_index, top_k_weights) -> None:
    """The interface's contract as this function was written against; a change fails the export."""
    hidden = module.gate_up_proj.shape[-1]
    ok = (hidden_states.dim() == 2 and hidden_states.shape[-1] == hidden and top_k_index.dim() == 2
          and tuple(top_k_weights.shape) == tuple(top_k_index.shape)
          and top_k_index.shape[0] == hidden_states.shape[0] and not top_k_index.is_floating_point())
    if not ok:
        raise ExportError(
            f"{type(module).__name__}.forward was called with hidden_states {tuple(hidden_states.shape)}, "
            f"top_k_index {tuple(top_k_index.shape)} ({top_k_index.dtype}), top_k_weights "
            f"{tuple(top_k_weights.shape)}; autodeploy's experts implementation expects [T, {hidden}], [T, K] "
            "integer ids and [T, K] weights (transformers' ExpertsInterface contract changed?)"
        )
