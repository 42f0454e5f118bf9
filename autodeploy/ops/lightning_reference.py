"""Torch references of lightning attention (MiniMax's linear attention), one sequence at a time (fp32).

Per head h with slope ``s_h`` (decay ``exp(-s_h)`` per token), state S [K, V]; per token t:
``S = exp(-s_h) * S + k_t (outer) v_t``, ``o_t = q_t @ S`` (no softmax, no scale, q and k as given).
It is the SSM recurrence of ``state_reference`` with dt = 1, A = -s, B = k, C = q, x = v, its state
transposed; the decay is a constant per head, so a chunk's decays are powers of one number.

Like ``state_reference``, each function takes one sequence's tokens and the state before them and
returns the outputs and the state after them: ``lightning_recurrent`` (token by token: the decode
step, and the definition) and ``lightning_chunked`` (a chunk of tokens at a time: prefill).
"""

from __future__ import annotations

import torch

from .state_reference import CHUNK


def lightning_recurrent(q, k, v, slopes, state):
    """q/k [L, H, K], v [L, H, V], slopes [H], state [H, K, V] -> (o [L, H, V], state), fp32."""
    q, k, v, state = q.float(), k.float(), v.float(), state.float().clone()
    decay = torch.exp(-slopes.float())[:, None, None]
    outs = []
    for t in range(v.shape[0]):
        state = decay * state + k[t][:, :, None] * v[t][:, None, :]
        outs.append(torch.einsum("hk,hkv->hv", q[t], state))
    return torch.stack(outs) if outs else v.new_zeros(v.shape), state


def lightning_chunked(q, k, v, slopes, state, chunk: int = CHUNK):
    """The same as :func:`lightning_recurrent`, a chunk of tokens at a time."""
    q, k, v, slopes, state = q.float(), k.float(), v.float(), slopes.float(), state.float()
    outs = []
    for start in range(0, v.shape[0], chunk):
        end = start + chunk
        o, state = _lightning_chunk(q[start:end], k[start:end], v[start:end], slopes, state)
        outs.append(o)
    return torch.cat(outs) if outs else v.new_zeros(v.shape), state


def _lightning_chunk(q, k, v, slopes, state):
    length = v.shape[0]
    position = torch.arange(length, device=v.device, dtype=torch.float32)
    gap = position[:, None] - position[None, :]  # t - s
    within = torch.exp(-slopes[:, None, None] * gap.clamp(min=0)) * (gap >= 0)  # [H, t, s]
    scores = torch.einsum("thk,shk->hts", q, k) * within
    o = torch.einsum("hts,shv->thv", scores, v)
    from_state = torch.exp(-slopes[None, :] * (position[:, None] + 1))  # [t, H]: decay of the state to t
    o = o + torch.einsum("thk,th,hkv->thv", q, from_state, state)
    to_end = torch.exp(-slopes[None, :] * (length - 1 - position[:, None]))  # [s, H]
    new_state = torch.exp(-slopes * length)[:, None, None] * state
    new_state = new_state + torch.einsum("shk,sh,shv->hkv", k, to_end, v)
    return o, new_state
