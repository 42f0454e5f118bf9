"""Decode steps of the cached state ops: one token per sequence, gathered, updated and scattered back
in one batched step (no host loop, no shape that depends on values: capturable in a CUDA graph).

A step is a decode step when its token count equals its sequence count (``T == B``, a shape). Every
real sequence of a step has at least one token and padding never adds more sequences than tokens
(a decode graph pads both alike, a piecewise bucket pads tokens only), so ``T == B`` means token
``b`` is sequence ``b``'s only token, or a padding token of a padding sequence (no tokens, slot -1).
The kernels still check it per row from ``cu_seqlens``: a row that breaks it gets NaN outputs and
writes nothing (loud, never a plausible wrong answer); padding rows get zeros and write nothing.

Each op reads its slot's state (zeros for a sequence's first token, ``context_lens == 0``, or slot
-1), advances it by one token and writes it back. On CUDA the Triton kernels of
``autodeploy.kernels.state_update`` do it in one launch per op (a convolution of at most 4 taps);
elsewhere, and for what the kernels do not cover, the batched torch forms below, whose write-back
never lets a padding row touch a real slot (see :func:`write_slots`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ._triton import use_triton
from .state_reference import _grouped

MAX_KERNEL_TAPS = 4  # the conv-update kernel's widths (Mamba-2 hybrids use 4)


def is_decode_step(tokens: torch.Tensor, state_slots: torch.Tensor) -> bool:
    """Whether a step is decodes only, from shapes alone (see the module docstring)."""
    return tokens.shape[0] == state_slots.shape[0]


@dataclass(frozen=True)
class DecodeRows:
    """Per row of a decode step: where its state is, and what to do with it."""

    slots: torch.Tensor  # [B] int64, -1 clamped to 0 (a safe gather index; ``resumes`` decides)
    resumes: torch.Tensor  # [B] bool: start from the slot's state (else from zeros)
    writes: torch.Tensor  # [B] bool: the row is its sequence's one token and has a slot
    valid: torch.Tensor  # [B] bool: the row is its sequence's one token
    fill: torch.Tensor  # [B] fp32: the output of a row that is not valid (0 padding, NaN broken)


def decode_rows(state_slots: torch.Tensor, cu_seqlens: torch.Tensor, context_lens: torch.Tensor) -> DecodeRows:
    rows = torch.arange(state_slots.shape[0], device=state_slots.device)
    starts, ends = cu_seqlens[:-1], cu_seqlens[1:]
    valid = (starts == rows) & (ends == rows + 1)
    has_slot = state_slots >= 0
    fill = torch.where(ends == starts, 0.0, float("nan")).to(torch.float32)
    return DecodeRows(state_slots.clamp(min=0), valid & has_slot & (context_lens > 0), valid & has_slot, valid, fill)


def read_slots(state: torch.Tensor, rows: DecodeRows) -> torch.Tensor:
    """Each row's state before its token: [B, *state] (zeros where it does not resume)."""
    old = state.index_select(0, rows.slots)
    return torch.where(_per_row(rows.resumes, old), old, torch.zeros((), dtype=state.dtype, device=state.device))


def write_slots(state: torch.Tensor, rows: DecodeRows, new: torch.Tensor) -> None:
    """``state[slot] = new[row]`` for the rows that write; the others repeat the first writing row's
    write (or rewrite slot 0's own value when none writes): duplicate indices with equal values, so
    the result is exact whatever order the scatter takes, and no real slot gets a padding row's value."""
    writes = rows.writes
    first = torch.argmax(writes.to(torch.int32)).view(1)  # the first writing row (row 0 when none writes)
    anyone = writes.any()
    spare_slot = torch.where(anyone, rows.slots.index_select(0, first), 0)
    spare_value = torch.where(anyone, new.index_select(0, first), state[:1].to(new.dtype))
    index = torch.where(writes, rows.slots, spare_slot)
    state.index_copy_(0, index, torch.where(_per_row(writes, new), new, spare_value).to(state.dtype))


def finish_outputs(out: torch.Tensor, rows: DecodeRows) -> torch.Tensor:
    """Valid rows keep their outputs; padding rows become zeros, broken rows NaN."""
    fill = rows.fill.to(out.dtype).view(-1, *[1] * (out.dim() - 1))
    return torch.where(_per_row(rows.valid, out), out, fill)


def _per_row(mask: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return mask.view(-1, *[1] * (like.dim() - 1))


# ---- the ops' decode steps -------------------------------------------------------------------------


def conv_step(x, weight, bias, conv_state, state_slots, cu_seqlens, context_lens) -> torch.Tensor:
    """``causal_conv1d_cached`` on a decode step: x [B, C] -> out [B, C] in x's dtype."""
    if use_triton(x) and weight.shape[1] <= MAX_KERNEL_TAPS:
        from ..kernels.state_update import conv_update

        return conv_update(x, weight, bias, conv_state, state_slots, cu_seqlens, context_lens)
    rows = decode_rows(state_slots, cu_seqlens, context_lens)
    window = torch.cat([read_slots(conv_state, rows).to(x.dtype), x[:, :, None]], dim=2)  # [B, C, K]
    out = (window.float() * weight.float()).sum(-1)
    if bias is not None:
        out = out + bias.float()
    write_slots(conv_state, rows, window[:, :, 1:])
    return finish_outputs(out.to(x.dtype), rows)


def ssm_step(x, dt, A, B, C, ssm_state, state_slots, cu_seqlens, context_lens) -> torch.Tensor:
    """``ssm_scan_cached`` on a decode step: x [B, H, P], dt [B, H], B/C [B, G, N] -> y [B, H, P] fp32."""
    if use_triton(x):
        from ..kernels.state_update import ssm_update

        return ssm_update(x, dt, A, B, C, ssm_state, state_slots, cu_seqlens, context_lens)
    rows = decode_rows(state_slots, cu_seqlens, context_lens)
    heads = x.shape[1]
    B, C = _grouped(B.float(), heads), _grouped(C.float(), heads)  # [B, H, N]
    dt = dt.float()
    decay = torch.exp(dt * A.float())[:, :, None, None]
    state = read_slots(ssm_state, rows).float() * decay + (dt[:, :, None] * x.float())[:, :, :, None] * B[:, :, None, :]
    write_slots(ssm_state, rows, state)
    return finish_outputs((state * C[:, :, None, :]).sum(-1), rows)


def delta_step(q, k, v, g, beta, delta_state, state_slots, cu_seqlens, context_lens) -> torch.Tensor:
    """``gated_delta_rule_cached`` on a decode step: q/k [B, Hk, K], v [B, H, V] -> o [B, H, V] fp32."""
    rows = decode_rows(state_slots, cu_seqlens, context_lens)
    heads = v.shape[1]
    q, k = _grouped(q.float(), heads), _grouped(k.float(), heads)  # [B, H, K]
    state = read_slots(delta_state, rows).float() * torch.exp(g.float())[:, :, None, None]  # [B, H, K, V]
    predicted = (state * k[:, :, :, None]).sum(2)
    delta = (v.float() - predicted) * beta.float()[:, :, None]
    state = state + k[:, :, :, None] * delta[:, :, None, :]
    write_slots(delta_state, rows, state)
    return finish_outputs((state * q[:, :, :, None]).sum(2), rows)


def lightning_step(q, k, v, slopes, lightning_state, state_slots, cu_seqlens, context_lens) -> torch.Tensor:
    """``lightning_attention_cached`` on a decode step: q/k [B, H, K], v [B, H, V], slopes [H] -> o [B, H, V]
    fp32 (the state decays by exp(-slope), then adds k v^T; the output reads it with q)."""
    rows = decode_rows(state_slots, cu_seqlens, context_lens)
    decay = torch.exp(-slopes.float())[None, :, None, None]
    state = read_slots(lightning_state, rows).float() * decay + k.float()[:, :, :, None] * v.float()[:, :, None, :]
    write_slots(lightning_state, rows, state)
    return finish_outputs((state * q.float()[:, :, :, None]).sum(2), rows)
