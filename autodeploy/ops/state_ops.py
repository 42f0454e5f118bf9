"""Canonical ops of layers with recurrent or convolution state (Mamba-2, Gated DeltaNet, lightning).

Flattened token layout, like attention: every token of a step is a row of T. Each op comes twice:

- the plain op (``causal_conv1d``, ``ssm_scan``, ``gated_delta_rule``, ``lightning_attention``) treats all T rows as ONE
  sequence starting from a zero state: what canonicalization produces from the HF code (which runs
  without a cache when exported);
- the ``*_cached`` op, which ``insert_state_cache`` puts in its place: the rows are the sequences of
  a step (``cu_seqlens`` [B + 1]), each starts from the state in its slot of the layer's state
  tensor (``state_slots`` [B]; a sequence with ``context_lens == 0`` starts from zeros, and slot -1
  marks padding: zeros, nothing written) and writes its final state back to that slot.

The math (torch references) is in ``state_reference`` (lightning attention's in ``lightning_reference``).
A decode step (one token per sequence: ``T == B``) runs ``state_decode``'s batched one-token update
(Triton kernels on CUDA for the conv and SSM ops, batched torch for the delta rule and lightning
attention): no host loop, so ``compile_cuda_graphs`` captures decode graphs of models with state ops
(``DECODE_CAPTURABLE_OPS``). Any other step runs the references sequence by sequence (a host loop over
``cu_seqlens``: it synchronizes, so piecewise graphs run these ops eagerly between the pieces, as
``graph.split.HOST_SYNC_OPS`` says). SSM, delta-rule and lightning outputs are fp32 (the
state's precision); the convolution keeps its input's dtype. Rows of padding tokens (no sequence) are zero.
"""

from __future__ import annotations

import torch

from . import state_decode as decode
from . import state_reference as ref
from .lightning_reference import lightning_chunked, lightning_recurrent

# ---- one sequence, zero initial state (canonicalization) ------------------------------------------


@torch.library.custom_op("autodeploy::causal_conv1d", mutates_args=())
def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """Causal depthwise convolution over the rows of x [T, C] with weight [C, K] (no activation)."""
    zeros = x.new_zeros(x.shape[1], weight.shape[1] - 1)
    return ref.conv_sequence(x, weight, bias, zeros)[0]


@causal_conv1d.register_fake
def _(x, weight, bias):
    return torch.empty_like(x)


@torch.library.custom_op("autodeploy::ssm_scan", mutates_args=())
def ssm_scan(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor) -> torch.Tensor:
    """Mamba-2 SSD over the rows as one sequence: x [T, H, P], dt [T, H] (after softplus/clamp),
    A [H], B/C [T, G, N] -> y [T, H, P] fp32 (no D skip, no gate)."""
    state = x.new_zeros(x.shape[1], x.shape[2], B.shape[2], dtype=torch.float32)
    return ref.ssm_chunked(x, dt, A, B, C, state)[0]


@ssm_scan.register_fake
def _(x, dt, A, B, C):
    return torch.empty_like(x, dtype=torch.float32)


@torch.library.custom_op("autodeploy::gated_delta_rule", mutates_args=())
def gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                     beta: torch.Tensor) -> torch.Tensor:
    """Gated delta rule over the rows as one sequence: q/k [T, Hk, K] (normalized, q scaled),
    v [T, H, V], g (log decay) / beta [T, H] -> o [T, H, V] fp32."""
    state = v.new_zeros(v.shape[1], k.shape[2], v.shape[2], dtype=torch.float32)
    return ref.delta_chunked(q, k, v, g, beta, state)[0]


@gated_delta_rule.register_fake
def _(q, k, v, g, beta):
    return torch.empty_like(v, dtype=torch.float32)


@torch.library.custom_op("autodeploy::lightning_attention", mutates_args=())
def lightning_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slopes: torch.Tensor) -> torch.Tensor:
    """Lightning (decayed linear) attention over the rows as one sequence: q/k [T, H, K], v [T, H, V],
    slopes [H] (decay exp(-slope) per token) -> o [T, H, V] fp32."""
    state = v.new_zeros(v.shape[1], k.shape[2], v.shape[2], dtype=torch.float32)
    return lightning_chunked(q, k, v, slopes, state)[0]


@lightning_attention.register_fake
def _(q, k, v, slopes):
    return torch.empty_like(v, dtype=torch.float32)


# ---- the sequences of a step, state in slots (after insert_state_cache) ---------------------------


@torch.library.custom_op("autodeploy::causal_conv1d_cached", mutates_args=("conv_state",))
def causal_conv1d_cached(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, conv_state: torch.Tensor,
    state_slots: torch.Tensor, cu_seqlens: torch.Tensor, context_lens: torch.Tensor,
) -> torch.Tensor:
    """``causal_conv1d`` per sequence; conv_state [slots, C, K - 1] holds each sequence's last inputs."""
    if decode.is_decode_step(x, state_slots):
        return decode.conv_step(x, weight, bias, conv_state, state_slots, cu_seqlens, context_lens)

    def run(rows, one_token, initial):
        return ref.conv_sequence(x[rows], weight, bias, initial.to(x.dtype))

    return _run_sequences(torch.zeros_like(x), conv_state, state_slots, cu_seqlens, context_lens, run)


@causal_conv1d_cached.register_fake
def _(x, weight, bias, conv_state, state_slots, cu_seqlens, context_lens):
    return torch.empty_like(x)


@torch.library.custom_op("autodeploy::ssm_scan_cached", mutates_args=("ssm_state",))
def ssm_scan_cached(
    x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor, ssm_state: torch.Tensor,
    state_slots: torch.Tensor, cu_seqlens: torch.Tensor, context_lens: torch.Tensor,
) -> torch.Tensor:
    """``ssm_scan`` per sequence; ssm_state [slots, H, P, N] fp32."""
    if decode.is_decode_step(x, state_slots):
        return decode.ssm_step(x, dt, A, B, C, ssm_state, state_slots, cu_seqlens, context_lens)

    def run(rows, one_token, initial):
        scan = ref.ssm_recurrent if one_token else ref.ssm_chunked
        return scan(x[rows], dt[rows], A, B[rows], C[rows], initial)

    out = torch.zeros_like(x, dtype=torch.float32)
    return _run_sequences(out, ssm_state, state_slots, cu_seqlens, context_lens, run)


@ssm_scan_cached.register_fake
def _(x, dt, A, B, C, ssm_state, state_slots, cu_seqlens, context_lens):
    return torch.empty_like(x, dtype=torch.float32)


@torch.library.custom_op("autodeploy::gated_delta_rule_cached", mutates_args=("delta_state",))
def gated_delta_rule_cached(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    delta_state: torch.Tensor, state_slots: torch.Tensor, cu_seqlens: torch.Tensor, context_lens: torch.Tensor,
) -> torch.Tensor:
    """``gated_delta_rule`` per sequence; delta_state [slots, H, K, V] fp32."""
    if decode.is_decode_step(v, state_slots):
        return decode.delta_step(q, k, v, g, beta, delta_state, state_slots, cu_seqlens, context_lens)

    def run(rows, one_token, initial):
        rule = ref.delta_recurrent if one_token else ref.delta_chunked
        return rule(q[rows], k[rows], v[rows], g[rows], beta[rows], initial)

    out = torch.zeros_like(v, dtype=torch.float32)
    return _run_sequences(out, delta_state, state_slots, cu_seqlens, context_lens, run)


@gated_delta_rule_cached.register_fake
def _(q, k, v, g, beta, delta_state, state_slots, cu_seqlens, context_lens):
    return torch.empty_like(v, dtype=torch.float32)


@torch.library.custom_op("autodeploy::lightning_attention_cached", mutates_args=("lightning_state",))
def lightning_attention_cached(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slopes: torch.Tensor, lightning_state: torch.Tensor,
    state_slots: torch.Tensor, cu_seqlens: torch.Tensor, context_lens: torch.Tensor,
) -> torch.Tensor:
    """``lightning_attention`` per sequence; lightning_state [slots, H, K, V] fp32."""
    if decode.is_decode_step(v, state_slots):
        return decode.lightning_step(q, k, v, slopes, lightning_state, state_slots, cu_seqlens, context_lens)

    def run(rows, one_token, initial):
        form = lightning_recurrent if one_token else lightning_chunked
        return form(q[rows], k[rows], v[rows], slopes, initial)

    out = torch.zeros_like(v, dtype=torch.float32)
    return _run_sequences(out, lightning_state, state_slots, cu_seqlens, context_lens, run)


@lightning_attention_cached.register_fake
def _(q, k, v, slopes, lightning_state, state_slots, cu_seqlens, context_lens):
    return torch.empty_like(v, dtype=torch.float32)


def _run_sequences(out, state, slots, cu_seqlens, context_lens, run):
    """``run(rows, one_token, initial state) -> (outputs, final state)`` for every sequence of the step,
    its outputs written to ``out[rows]`` and its final state to its slot."""
    for start, end, slot, initial in _sequences(state, slots, cu_seqlens, context_lens):
        out[start:end], final = run(slice(start, end), end - start == 1, initial)
        if slot >= 0:
            state[slot] = final
    return out


def _sequences(state: torch.Tensor, slots: torch.Tensor, cu_seqlens: torch.Tensor, context_lens: torch.Tensor):
    """(start, end, slot, initial state) of every sequence with tokens (the reference's host loop)."""
    cu, slots, context = cu_seqlens.tolist(), slots.tolist(), context_lens.tolist()
    for b, slot in enumerate(slots):
        start, end = cu[b], cu[b + 1]
        if end > start:
            resumes = slot >= 0 and context[b] > 0
            yield start, end, slot, state[slot] if resumes else state.new_zeros(state.shape[1:])


STATE_OPS = {  # plain op -> its cached form
    torch.ops.autodeploy.causal_conv1d.default: torch.ops.autodeploy.causal_conv1d_cached.default,
    torch.ops.autodeploy.ssm_scan.default: torch.ops.autodeploy.ssm_scan_cached.default,
    torch.ops.autodeploy.gated_delta_rule.default: torch.ops.autodeploy.gated_delta_rule_cached.default,
    torch.ops.autodeploy.lightning_attention.default: torch.ops.autodeploy.lightning_attention_cached.default,
}
# the cached ops whose decode steps never synchronize with the host (their other steps do): an op
# is listed here only once its decode step goes through ``state_decode``
DECODE_CAPTURABLE_OPS = frozenset({
    torch.ops.autodeploy.causal_conv1d_cached.default,
    torch.ops.autodeploy.ssm_scan_cached.default,
    torch.ops.autodeploy.gated_delta_rule_cached.default,
    torch.ops.autodeploy.lightning_attention_cached.default,
})
