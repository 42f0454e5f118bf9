"""match_mamba2_ssd: Mamba-2's chunked SSD scan -> ``autodeploy::ssm_scan`` (+ its token-local parts).

The pattern is the scan HF's Mamba-2 hybrids (Bamba, FalconH1, NemotronH, GraniteMoeHybrid) run
without a cache (``mamba2_chunk_scan``, written here as the eager code it is): dt gets its bias,
softplus and clamp; the tokens are padded to whole chunks; the intra-chunk (diagonal) and
inter-chunk (state) terms are summed; the D skip is added; the padding is cut. transformers 5.17
writes the contractions as broadcast products summed (``sum_product``), 5.25 as einsums. Both become
the SSM recurrence over the tokens as one sequence, its state kept by the state pool later.

Pad sizes, chunk lengths, repeat counts and the final slice depend on the token count and the chunk
size: they are not compared (the matched subgraph is verified numerically instead).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from autodeploy.graph.matcher import Match
from autodeploy.graph.rewrite import PatternSpec, RewriteRule

aten = torch.ops.aten
DT_MIN, DT_MAX = 0.012345, 543.21  # sentinels: the clamp's bounds (time_step_limit) are captured
_CHUNK, _TOKENS, _HEADS, _HEAD_DIM, _GROUPS, _STATE = 4, 3, 4, 3, 2, 5  # one chunk, as export sees a step


def _pad_tokens(t, pad):
    shape = (0, 0, 0, 0, 0, pad, 0, 0) if t.dim() == 4 else (0, 0, 0, pad, 0, 0)
    return F.pad(t, shape, mode="constant", value=0)


def _chunks(t, pad):
    t = _pad_tokens(t, pad)
    if t.dim() == 3:
        return t.reshape(t.shape[0], -1, _CHUNK, t.shape[2])
    return t.reshape(t.shape[0], -1, _CHUNK, t.shape[2], t.shape[3])


def _segment_sum(t):
    n = t.size(-1)
    t = t[..., None].expand(*t.size(), n)
    t = t.masked_fill(~torch.tril(torch.ones(n, n, dtype=torch.bool), diagonal=-1), 0)
    t = torch.cumsum(t, dim=-2)
    return t.masked_fill(~torch.tril(torch.ones(n, n, dtype=torch.bool), diagonal=0), -torch.inf)


def _prologue(x, dt, A, B, C, D, dt_bias, dt_min, dt_max):
    heads, groups, length = x.shape[2], B.shape[2], x.shape[1]
    dt = torch.clamp(F.softplus(dt + dt_bias), min=dt_min, max=dt_max)
    x = x.float()
    B = B.float().repeat_interleave(heads // groups, dim=2, output_size=heads)
    C = C.float().repeat_interleave(heads // groups, dim=2, output_size=heads)
    pad = (_CHUNK - length % _CHUNK) % _CHUNK
    skip = D[..., None] * _pad_tokens(x, pad)
    x = x * dt[..., None].float()
    A = A.to(x.dtype) * dt.float()
    x, A, B, C = [_chunks(t, pad) for t in (x, A, B, C)]
    A = A.permute(0, 3, 1, 2)
    return x, A, torch.cumsum(A, dim=-1), B, C, skip


def ssd_sum_product(x, dt, A, B, C, D, dt_bias, dt_min, dt_max):
    batch, length, heads, head_dim = x.shape
    x, A, A_cumsum, B, C, skip = _prologue(x, dt, A, B, C, D, dt_bias, dt_min, dt_max)
    L = torch.exp(_segment_sum(A))
    G = (C[:, :, :, None, :, :] * B[:, :, None, :, :, :]).sum(dim=-1)
    M = (G[..., None] * L.permute(0, 2, 3, 4, 1)[..., None]).sum(dim=-1)
    y_diag = (M[..., None] * x[:, :, None]).sum(dim=3)
    decay_states = torch.exp(A_cumsum[:, :, :, -1:] - A_cumsum)
    B_decay = B * decay_states.permute(0, -2, -1, 1)[..., None]
    states = (B_decay[..., None, :] * x[..., None]).sum(dim=2)
    states = torch.cat([torch.zeros_like(states[:, :1]), states], dim=1)
    decay_chunk = torch.exp(_segment_sum(F.pad(A_cumsum[:, :, :, -1], (1, 0)))).transpose(1, 3)
    states = (decay_chunk[..., None, None] * states[:, :, None, ...]).sum(dim=1)[:, :-1]
    y_off = (C[..., None, :] * states[:, :, None, ...]).sum(-1) * torch.exp(A_cumsum).permute(0, 2, 3, 1)[..., None]
    out = (y_diag + y_off).reshape(batch, -1, heads, head_dim) + skip
    return out[:, :length]


def ssd_einsum(x, dt, A, B, C, D, dt_bias, dt_min, dt_max):
    batch, length, heads, head_dim = x.shape
    x, A, A_cumsum, B, C, skip = _prologue(x, dt, A, B, C, D, dt_bias, dt_min, dt_max)
    L = torch.exp(_segment_sum(A))
    M = torch.einsum("bclhn,bcshn->bclsh", C, B) * L.permute(0, 2, 3, 4, 1)
    y_diag = torch.einsum("bclsh,bcshp->bclhp", M, x)
    decay_states = torch.exp(A_cumsum[:, :, :, -1:] - A_cumsum)
    B_decay = B * decay_states.permute(0, -2, -1, 1)[..., None]
    states = torch.einsum("bclhn,bclhp->bchpn", B_decay, x)
    states = torch.cat([torch.zeros_like(states[:, :1]), states], dim=1)
    decay_chunk = torch.exp(_segment_sum(F.pad(A_cumsum[:, :, :, -1], (1, 0)))).transpose(1, 3)
    states = torch.einsum("bzch,bzhpn->bchpn", decay_chunk, states)[:, :-1]
    y_off = torch.einsum("bclhn,bchpn->bclhp", C, states) * torch.exp(A_cumsum).permute(0, 2, 3, 1)[..., None]
    out = (y_diag + y_off).contiguous().reshape(batch, -1, heads, head_dim) + skip
    return out[:, :length]


class MatchMamba2SSD(RewriteRule):
    name = "match_mamba2_ssd"
    required_ops = frozenset({aten.softplus.default, aten.cumsum.default})

    def patterns(self) -> list[PatternSpec]:
        inputs = {
            "x": torch.randn(1, _TOKENS, _HEADS, _HEAD_DIM), "dt": torch.randn(1, _TOKENS, _HEADS),
            "A": -torch.rand(_HEADS), "B": torch.randn(1, _TOKENS, _GROUPS, _STATE),
            "C": torch.randn(1, _TOKENS, _GROUPS, _STATE), "D": torch.randn(_HEADS), "dt_bias": torch.randn(_HEADS),
        }
        scalars = {"dt_min": DT_MIN, "dt_max": DT_MAX}
        ignored = {aten.pad.default: {"pad"}, aten.slice.Tensor: {"end"}, aten.ones.default: {"size"},
                   aten.repeat_interleave.self_int: {"repeats", "output_size"}}
        return [PatternSpec(fn, inputs, scalars, ignored, name=fn.__name__) for fn in (ssd_sum_product, ssd_einsum)]

    def check(self, m: Match, gm) -> str | None:
        x, B = m["x"].meta["val"], m["B"].meta["val"]
        if x.shape[0] != 1 or x.shape[2] % B.shape[2]:
            return f"not one sequence of heads in whole groups (x {tuple(x.shape)}, B {tuple(B.shape)})"
        return None

    def verification_inputs(self, m: Match, values: dict) -> None:
        values[m["A"]] = -values[m["A"]].abs()  # a decay (A < 0), as A = -exp(A_log) always is

    def replacement(self, x, dt, A, B, C, D, dt_bias, dt_min, dt_max):
        dt = aten.clamp.default(aten.softplus.default(aten.add.Tensor(dt, dt_bias)), dt_min, dt_max)
        rows = aten.squeeze.dim(x, 0)
        y = torch.ops.autodeploy.ssm_scan.default(rows, aten.squeeze.dim(dt, 0), A, aten.squeeze.dim(B, 0),
                                                  aten.squeeze.dim(C, 0))
        skip = aten.mul.Tensor(aten.unsqueeze.default(D, -1), aten._to_copy.default(rows, dtype=torch.float32))
        return aten.unsqueeze.default(aten.add.Tensor(y, skip), 0)
