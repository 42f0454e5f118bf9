"""autodeploy's entry in transformers' ``ExpertsInterface``: MoE experts exported as ``autodeploy::moe``.

transformers dispatches every experts module decorated with ``@use_experts_implementation`` (Mixtral,
Qwen2/3-MoE, OLMoE, PhiMoE, gpt-oss, ...) to the function registered under
``config._experts_implementation``. We register ``"autodeploy"`` and build models with it. For the
layouts the canonical op computes (stacked gate/up and down weights, transposed or not, with or
without biases, and a gate function it knows: ``act(gate) * up`` on halves or alternating columns,
or gpt-oss's clamped SwiGLU) the function returns ``autodeploy::moe`` itself, so export records the
canonical op and no rule has to recognise transformers' experts code, whatever a release changes in
it. Any other layout runs transformers' ``batched_mm`` code, which the ``match_moe`` rule rewrites or
``canonicalize_moe`` refuses, naming the module. Each experts module is planned once, on the real
model before export (:func:`plan_experts`): its gate function (``_apply_gate``, transformers'
default or the model's own) is identified by evaluating it against the op's candidates, because
telling them apart needs real numbers.
"""

from __future__ import annotations

import logging
import weakref
from dataclasses import dataclass

import torch
from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS, ExpertsInterface

from .errors import ExportError
from .ops.mlp import ACTIVATIONS, CLAMPED_SWIGLU, expert_gate, split_gate_up

log = logging.getLogger("autodeploy.experts")

IMPLEMENTATION = "autodeploy"
FALLBACK = "batched_mm"  # transformers' static-shape experts code: what match_moe rewrites
_LAYOUT_FLAGS = ("has_gate", "is_concatenated", "is_transposed", "has_bias")


@dataclass(frozen=True)
class ExpertsPlan:
    """How one experts module is exported: ``autodeploy::moe`` with ``activation`` (its gate/up outputs
    ``interleaved`` or not; gpt-oss's ``swiglu_alpha`` / ``swiglu_limit``), or ``FALLBACK`` for the
    reason given."""

    activation: str | None
    fallback_reason: str | None = None
    interleaved: bool = False
    swiglu_alpha: float | None = None
    swiglu_limit: float | None = None


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
    if reason is not None:
        return ExpertsPlan(None, reason)
    for candidate in _gate_candidates(module):
        if _computes(module, candidate):
            return candidate
    return ExpertsPlan(None, f"its gate function ({type(module).__name__}._apply_gate with act_fn "
                             f"{type(getattr(module, 'act_fn', None)).__name__}) is none of "
                             f"{sorted([*ACTIVATIONS, CLAMPED_SWIGLU])} on halves or alternating columns")


def _layout_mismatch(module: torch.nn.Module) -> str | None:
    """Why ``autodeploy::moe`` cannot compute this module whatever its gate, or None."""
    if not module.has_gate:
        return "experts without a gate"
    if getattr(module, "has_post_expert_norm", False):
        return "a norm after each expert"
    if getattr(module, "_is_expert_parallel", False):
        return "expert parallelism"
    gate_up, down = tuple(module.gate_up_proj.shape), tuple(module.down_proj.shape)
    experts, rows, cols = gate_up
    hidden, inter2 = (rows, cols) if module.is_transposed else (cols, rows)
    want_down = (experts, inter2 // 2, hidden) if module.is_transposed else (experts, hidden, inter2 // 2)
    if down != want_down or inter2 % 2:
        return f"weights gate_up {gate_up} and down {down}"
    if module.has_bias:
        biases = (getattr(module, "gate_up_proj_bias", None), getattr(module, "down_proj_bias", None))
        if any(b is None for b in biases) or [tuple(b.shape) for b in biases] != [(experts, inter2), (experts, hidden)]:
            return "expert biases other than gate_up_proj_bias [E, 2I] and down_proj_bias [E, H]"
    return None


def _gate_candidates(module: torch.nn.Module):
    """The gates ``moe`` computes that this module could use: its ``act_fn`` gating halves or
    alternating columns, and gpt-oss's clamped SwiGLU with the module's ``alpha`` / ``limit``."""
    activation = activation_name(module.act_fn) if hasattr(module, "act_fn") else None
    alpha, limit = getattr(module, "alpha", None), getattr(module, "limit", None)
    for interleaved in (False, True):
        if activation is not None:
            yield ExpertsPlan(activation, interleaved=interleaved)
        if _is_number(alpha) and _is_number(limit):
            yield ExpertsPlan(CLAMPED_SWIGLU, interleaved=interleaved, swiglu_alpha=float(alpha),
                              swiglu_limit=float(limit))


def activation_name(act_fn) -> str | None:
    """The name in ``ACTIVATIONS`` of the function ``act_fn`` computes, found by evaluating both."""
    probe = torch.linspace(-8.0, 8.0, 257, dtype=torch.float64, device="cpu")
    with torch.no_grad():
        got = act_fn(probe)
        for name, reference in ACTIVATIONS.items():
            if torch.allclose(got, reference(probe), rtol=1e-6, atol=1e-9):
                return name
    return None


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _computes(module: torch.nn.Module, plan: ExpertsPlan) -> bool:
    """Whether the module's gate function equals ``plan``'s on probe projections (float64, values
    well past gpt-oss's clamp limit on both sides)."""
    probe = torch.linspace(-24.0, 24.0, 16 * 24, dtype=torch.float64).reshape(16, 24)
    probe = probe[torch.randperm(16, generator=torch.Generator().manual_seed(0))]
    with torch.no_grad():
        try:
            got = module._apply_gate(probe)
        except Exception:  # noqa: BLE001 (a gate we cannot evaluate is not ours)
            return False
        gate, up = split_gate_up(probe, plan.interleaved)
        want = expert_gate(gate, up, plan.activation, plan.swiglu_alpha, plan.swiglu_limit)
    return isinstance(got, torch.Tensor) and got.shape == want.shape and torch.allclose(got, want, rtol=1e-6, atol=1e-9)


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
    options = {"transposed": True} if module.is_transposed else {}
    if module.has_bias:
        options.update(b_gate_up=module.gate_up_proj_bias, b_down=module.down_proj_bias)
    if plan.interleaved:
        options["interleaved"] = True
    if plan.activation == CLAMPED_SWIGLU:
        options.update(swiglu_alpha=plan.swiglu_alpha, swiglu_limit=plan.swiglu_limit)
    return torch.ops.autodeploy.moe(
        hidden_states, top_k_index, top_k_weights, module.gate_up_proj, module.down_proj, plan.activation, **options
    )


def _check_operands(module, hidden_states, top_k_index, top_k_weights) -> None:
    """The interface's contract as this function was written against; a change fails the export."""
    hidden = module.gate_up_proj.shape[1 if module.is_transposed else 2]
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
