"""Torch references of the state-space ops, one sequence at a time (fp32 math).

Every function takes one sequence's tokens and the state before them, and returns the outputs and
the state after them, so prefill, chunked prefill and decode are the same call. Two forms each:
``*_recurrent`` (token by token: the decode step, and the definition) and ``*_chunked`` (a few
matmuls per chunk of tokens: prefill). ``autodeploy.ops.state_ops`` runs them over the sequences of
a step.

Mamba-2 SSD (``ssm``): per head h, state S [P, N]; per token t with ``a = exp(dt_t * A_h)``:
``S = a * S + dt_t * x_t (outer) B_t``, ``y_t = S @ C_t``. B and C have G groups, head h reads group
``h // (H / G)``. MiniMax's lightning attention is this with dt = 1, A = -slope, B = k, C = q, x = v
(its own references: ``lightning_reference``).

Gated DeltaNet (``delta``): per head h, state S [K, V]; per token, with q and k already normalized:
``S = exp(g_t) * S``, ``S = S + k_t (outer) (beta_t * (v_t - S^T k_t))``, ``o_t = S^T q_t``. q and k
have H_k heads, v has H_v (a multiple): value head h reads key head ``h // (H_v / H_k)``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

CHUNK = 64  # tokens per chunk of the chunked forms


def _grouped(t: torch.Tensor, heads: int) -> torch.Tensor:
    """[L, G, *] -> [L, heads, *]: each group serves heads // G consecutive heads."""
    return t.repeat_interleave(heads // t.shape[1], dim=1)


# ---- Mamba-2 SSD ---------------------------------------------------------------------------------


def ssm_recurrent(x, dt, A, B, C, state):
    """x [L, H, P], dt [L, H], A [H], B/C [L, G, N], state [H, P, N] -> (y [L, H, P], state), fp32."""
    x, dt, A, state = x.float(), dt.float(), A.float(), state.float().clone()
    B, C = _grouped(B.float(), x.shape[1]), _grouped(C.float(), x.shape[1])
    ys = []
    for t in range(x.shape[0]):
        decay = torch.exp(dt[t] * A)[:, None, None]
        state = state * decay + (dt[t][:, None] * x[t])[:, :, None] * B[t][:, None, :]
        ys.append((state * C[t][:, None, :]).sum(-1))
    return torch.stack(ys) if ys else x.new_zeros(x.shape), state


def ssm_chunked(x, dt, A, B, C, state, chunk: int = CHUNK):
    """The same as :func:`ssm_recurrent`, a chunk of tokens at a time."""
    x, dt, A, state = x.float(), dt.float(), A.float(), state.float()
    B, C = _grouped(B.float(), x.shape[1]), _grouped(C.float(), x.shape[1])
    ys = []
    for start in range(0, x.shape[0], chunk):
        end = start + chunk
        y, state = _ssm_chunk(x[start:end], dt[start:end], A, B[start:end], C[start:end], state)
        ys.append(y)
    return torch.cat(ys) if ys else x.new_zeros(x.shape), state


def _ssm_chunk(x, dt, A, B, C, state):
    log_decay = torch.cumsum(dt * A, dim=0)  # [L, H]: log of the decay from the chunk start to t
    pair = log_decay[:, None, :] - log_decay[None, :, :]  # [t, s, H]
    causal = torch.ones(x.shape[0], x.shape[0], dtype=torch.bool, device=x.device).tril()
    pair = torch.exp(pair.masked_fill(~causal[:, :, None], float("-inf")))
    scores = torch.einsum("thn,shn->tsh", C, B) * pair  # [t, s, H]
    y = torch.einsum("tsh,sh,shp->thp", scores, dt, x)
    y = y + torch.exp(log_decay)[:, :, None] * torch.einsum("hpn,thn->thp", state, C)
    to_end = torch.exp(log_decay[-1][None, :] - log_decay)  # [s, H]
    new_state = torch.exp(log_decay[-1])[:, None, None] * state
    new_state = new_state + torch.einsum("sh,sh,shp,shn->hpn", to_end, dt, x, B)
    return y, new_state


# ---- Gated DeltaNet --------------------------------------------------------------------------------


def delta_recurrent(q, k, v, g, beta, state):
    """q/k [L, Hk, K], v [L, H, V], g/beta [L, H], state [H, K, V] -> (o [L, H, V], state), fp32."""
    heads = v.shape[1]
    q, k = _grouped(q.float(), heads), _grouped(k.float(), heads)
    v, g, beta, state = v.float(), g.float(), beta.float(), state.float().clone()
    outs = []
    for t in range(v.shape[0]):
        state = state * torch.exp(g[t])[:, None, None]
        predicted = (state * k[t][:, :, None]).sum(1)  # [H, V]
        delta = (v[t] - predicted) * beta[t][:, None]
        state = state + k[t][:, :, None] * delta[:, None, :]
        outs.append((state * q[t][:, :, None]).sum(1))
    return torch.stack(outs) if outs else v.new_zeros(v.shape), state


def delta_chunked(q, k, v, g, beta, state, chunk: int = CHUNK):
    """The same as :func:`delta_recurrent`, a chunk of tokens at a time (the WY form: the chunk's
    delta-rule updates condensed by solving one unit lower-triangular system)."""
    heads = v.shape[1]
    q, k = _grouped(q.float(), heads), _grouped(k.float(), heads)
    v, g, beta, state = v.float(), g.float(), beta.float(), state.float()
    outs = []
    for start in range(0, v.shape[0], chunk):
        end = start + chunk
        o, state = _delta_chunk(q[start:end], k[start:end], v[start:end], g[start:end], beta[start:end], state)
        outs.append(o)
    return torch.cat(outs) if outs else v.new_zeros(v.shape), state


def _delta_chunk(q, k, v, g, beta, state):
    q, k, v = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)  # [H, L, *]
    log_decay = torch.cumsum(g, dim=0).transpose(0, 1)  # [H, L]
    length = v.shape[1]
    pair = log_decay[:, :, None] - log_decay[:, None, :]  # [H, t, s]
    lower = torch.ones(length, length, dtype=torch.bool, device=v.device).tril()
    pair = torch.exp(pair.masked_fill(~lower, float("-inf")))
    k_beta = k * beta.transpose(0, 1)[:, :, None]
    strictly = (k_beta @ k.transpose(1, 2)) * pair * (~torch.eye(length, dtype=torch.bool, device=v.device))
    system = strictly + torch.eye(length, device=v.device)
    new_values = torch.linalg.solve_triangular(system, v * beta.transpose(0, 1)[:, :, None], upper=False)
    decayed_keys = torch.linalg.solve_triangular(system, k_beta * torch.exp(log_decay)[:, :, None], upper=False)
    v_new = new_values - decayed_keys @ state  # the part the state does not already predict
    o = (q * torch.exp(log_decay)[:, :, None]) @ state + ((q @ k.transpose(1, 2)) * pair) @ v_new
    to_end = torch.exp(log_decay[:, -1:] - log_decay)[:, :, None]
    new_state = state * torch.exp(log_decay[:, -1])[:, None, None] + (k * to_end).transpose(1, 2) @ v_new
    return o.transpose(0, 1), new_state


# ---- causal depthwise convolution ----------------------------------------------------------------


def conv_sequence(x, weight, bias, state):
    """x [L, C], weight [C, K], bias [C] or None, state [C, K - 1] (the inputs before x) ->
    (out [L, C] in x's dtype, state [C, K - 1])."""
    window = torch.cat([state.to(x.dtype), x.transpose(0, 1)], dim=1)  # [C, K - 1 + L]
    out = F.conv1d(window[None].float(), weight.float()[:, None, :], None if bias is None else bias.float(),
                   groups=x.shape[1])
    return out[0].transpose(0, 1).to(x.dtype), window[:, window.shape[1] - state.shape[1]:]
