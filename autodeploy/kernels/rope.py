"""Triton rotary position embedding with the semantics of ``autodeploy::rope``.

Each output column j of the rotated part is ``x[j] * cos[j] + sign(j) * x[partner(j)] * sin[j]``
(half-rotate: partner j +- R/2; interleaved: j +- 1); columns past the rotary width R are copied.
x and cos/sin may be strided or broadcast views (the model's own layouts, e.g. [B, H, S, D] q with
[B, 1, S, D] cos); every tensor is addressed through its strides, so nothing is copied first.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

BLOCK_ROWS = 16


@triton.jit
def _rope_block(
    block, x_ptr, cos_ptr, sin_ptr, out_ptr, n_rows, size1, size2,
    sx0, sx1, sx2, sc0, sc1, sc2, ss0, ss1, ss2,
    HEAD_DIM: tl.constexpr, ROT_DIM: tl.constexpr, INTERLEAVED: tl.constexpr,
    BLOCK_ROWS: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """Rotate rows [block * BLOCK_ROWS, +BLOCK_ROWS) of a [size0, size1, size2, HEAD_DIM] view."""
    rows = block.to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    i0, i1, i2 = rows // (size1 * size2), (rows // size2) % size1, rows % size2
    x_row = i0 * sx0 + i1 * sx1 + i2 * sx2
    cols = tl.arange(0, BLOCK_D)
    row_ok = rows < n_rows
    rotated = cols < ROT_DIM
    if INTERLEAVED:
        partner = tl.where(cols % 2 == 0, cols + 1, cols - 1)
        sign = tl.where(cols % 2 == 0, -1.0, 1.0)
    else:
        half: tl.constexpr = ROT_DIM // 2
        partner = tl.where(cols < half, cols + half, cols - half)
        sign = tl.where(cols < half, -1.0, 1.0)
    mask = row_ok[:, None] & (cols[None, :] < HEAD_DIM)
    rot_mask = row_ok[:, None] & rotated[None, :]
    x = tl.load(x_ptr + x_row[:, None] + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    x_partner = tl.load(x_ptr + x_row[:, None] + partner[None, :], mask=rot_mask, other=0.0).to(tl.float32)
    cos = tl.load(cos_ptr + (i0 * sc0 + i1 * sc1 + i2 * sc2)[:, None] + cols[None, :], mask=rot_mask, other=1.0)
    sin = tl.load(sin_ptr + (i0 * ss0 + i1 * ss1 + i2 * ss2)[:, None] + cols[None, :], mask=rot_mask, other=0.0)
    out = x * cos.to(tl.float32) + sign[None, :] * x_partner * sin.to(tl.float32)
    tl.store(out_ptr + rows[:, None] * HEAD_DIM + cols[None, :], out.to(out_ptr.dtype.element_ty), mask=mask)


# counts and strides that change with the number of tokens: no ==1 / %16 variants, one compile
_ROPE_DYNAMIC = ["n_rows", "size1", "size2", "sx0", "sc0", "ss0"]


@triton.jit(do_not_specialize=_ROPE_DYNAMIC)
def _rope_kernel(
    x_ptr, cos_ptr, sin_ptr, out_ptr, n_rows, size1, size2,
    sx0, sx1, sx2, sc0, sc1, sc2, ss0, ss1, ss2,
    HEAD_DIM: tl.constexpr, ROT_DIM: tl.constexpr, INTERLEAVED: tl.constexpr,
    BLOCK_ROWS: tl.constexpr, BLOCK_D: tl.constexpr,
):
    _rope_block(tl.program_id(0), x_ptr, cos_ptr, sin_ptr, out_ptr, n_rows, size1, size2,
                sx0, sx1, sx2, sc0, sc1, sc2, ss0, ss1, ss2, HEAD_DIM, ROT_DIM, INTERLEAVED, BLOCK_ROWS, BLOCK_D)


@triton.jit(do_not_specialize=["q_rows", "q_size1", "q_size2", "qx0", "qc0", "qs0",
                               "k_rows", "k_size1", "k_size2", "kx0", "kc0", "ks0"])
def _rope_qk_kernel(
    q_ptr, qcos_ptr, qsin_ptr, qout_ptr, q_rows, q_size1, q_size2,
    qx0, qx1, qx2, qc0, qc1, qc2, qs0, qs1, qs2,
    k_ptr, kcos_ptr, ksin_ptr, kout_ptr, k_rows, k_size1, k_size2,
    kx0, kx1, kx2, kc0, kc1, kc2, ks0, ks1, ks2,
    HEAD_DIM: tl.constexpr, ROT_DIM: tl.constexpr, INTERLEAVED: tl.constexpr,
    BLOCK_ROWS: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """q and k of one attention in one launch: the first programs rotate q, the rest k."""
    block = tl.program_id(0)
    q_blocks = tl.cdiv(q_rows, BLOCK_ROWS)
    if block < q_blocks:
        _rope_block(block, q_ptr, qcos_ptr, qsin_ptr, qout_ptr, q_rows, q_size1, q_size2,
                    qx0, qx1, qx2, qc0, qc1, qc2, qs0, qs1, qs2, HEAD_DIM, ROT_DIM, INTERLEAVED, BLOCK_ROWS, BLOCK_D)
    else:
        _rope_block(block - q_blocks, k_ptr, kcos_ptr, ksin_ptr, kout_ptr, k_rows, k_size1, k_size2,
                    kx0, kx1, kx2, kc0, kc1, kc2, ks0, ks1, ks2, HEAD_DIM, ROT_DIM, INTERLEAVED, BLOCK_ROWS, BLOCK_D)


def _as_3d_rows(t: torch.Tensor) -> tuple[int, int, int]:
    """Strides of the three leading dims of a 4-d view (columns must have unit stride)."""
    return t.stride(0), t.stride(1), t.stride(2)


@dataclass(frozen=True)
class _Rows:
    """One rope operand as the kernel sees it: 4-d views, the output, and the launch arguments."""

    out: torch.Tensor
    lead: tuple[int, ...]
    args: tuple

    @property
    def n_rows(self) -> int:
        return self.args[4]


def _rows(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> _Rows:
    rot = cos.shape[-1]
    lead = tuple(torch.broadcast_shapes(x.shape[:-1], cos.shape[:-1], sin.shape[:-1]))
    if len(lead) > 3:
        raise ValueError(f"rope kernel supports up to 4-d inputs, got leading dims {lead}")
    lead4 = (1,) * (3 - len(lead)) + lead
    views = []
    for t, width in ((x, x.shape[-1]), (cos, rot), (sin, rot)):
        view = t.expand(*lead, width).reshape(*lead4, width)  # leading 1s: still a view
        views.append(view if view.stride(-1) == 1 else view.contiguous())
    xv, cv, sv = views
    out = torch.empty(*lead4, x.shape[-1], dtype=torch.promote_types(x.dtype, cos.dtype), device=x.device)
    n_rows = lead4[0] * lead4[1] * lead4[2]
    args = (xv, cv, sv, out, n_rows, lead4[1], lead4[2], *_as_3d_rows(xv), *_as_3d_rows(cv), *_as_3d_rows(sv))
    return _Rows(out, lead, args)


def _constexprs(x: torch.Tensor, cos: torch.Tensor, interleaved: bool) -> dict:
    return dict(HEAD_DIM=x.shape[-1], ROT_DIM=cos.shape[-1], INTERLEAVED=interleaved, BLOCK_ROWS=BLOCK_ROWS,
                BLOCK_D=triton.next_power_of_2(x.shape[-1]), num_warps=4)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool = False) -> torch.Tensor:
    """``autodeploy::rope`` on Triton: returns a contiguous tensor of the broadcast shape."""
    rows = _rows(x, cos, sin)
    if rows.n_rows:
        _rope_kernel[(triton.cdiv(rows.n_rows, BLOCK_ROWS),)](*rows.args, **_constexprs(x, cos, interleaved))
    return rows.out.view(*rows.lead, x.shape[-1])


def rope_qk(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool = False):
    """``autodeploy::rope_qk``: q and k rotated with the same cos/sin in one launch."""
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(f"rope_qk needs one head dim, got {q.shape[-1]} and {k.shape[-1]}")
    q_rows, k_rows = _rows(q, cos, sin), _rows(k, cos, sin)
    blocks = triton.cdiv(q_rows.n_rows, BLOCK_ROWS) + triton.cdiv(k_rows.n_rows, BLOCK_ROWS)
    if blocks:
        _rope_qk_kernel[(blocks,)](*q_rows.args, *k_rows.args, **_constexprs(q, cos, interleaved))
    return q_rows.out.view(*q_rows.lead, q.shape[-1]), k_rows.out.view(*k_rows.lead, k.shape[-1])
