"""Triton kernels of the state ops' decode steps: one token per sequence, state gathered from its slot,
advanced one token and written back in the same program (``autodeploy.ops.state_decode`` says when
they run and what a row is).

- ``conv_update``: one program per (sequence, block of channels): the window is the slot's last
  ``K - 1`` inputs and the new one; the output is its dot product with the taps (+ bias), the slot
  keeps the window shifted by one. Widths 2 to 4 (explicit taps: the window stays in registers).
- ``ssm_update``: one program per (sequence, head, block of the head's P rows), the selective
  state update of Mamba-2: ``S = exp(dt * A) * S + dt * x (outer) B``, ``y = S @ C``, with the
  ``[BLOCK_P, N]`` tile of the state in registers (fp32) and B/C read from the head's group.

Every program finds its row's status from the metadata (``_row_status``): a row that is not its
sequence's one token writes nothing and outputs 0 (padding, no tokens) or NaN (a broken step); a
row starts from zeros unless its sequence has context and a slot. Nothing here reads a value on the
host: grids come from shapes, so launches can be captured in CUDA graphs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

SSM_TILE = 4096  # state elements of one program's tile (16 KiB of fp32: 32 per thread of 4 warps)


@triton.jit
def _row_status(cu_ptr, slots_ptr, context_ptr, row):
    """(slot clamped to >= 0, valid, resumes, writes, output of a row that is not valid)."""
    start = tl.load(cu_ptr + row)
    end = tl.load(cu_ptr + row + 1)
    slot = tl.load(slots_ptr + row)
    valid = (start == row) & (end == row + 1)
    writes = valid & (slot >= 0)
    resumes = writes & (tl.load(context_ptr + row) > 0)
    fill = tl.where(end == start, 0.0, float("nan"))
    return tl.maximum(slot, 0).to(tl.int64), valid, resumes, writes, fill


@triton.jit
def _conv_update_kernel(
    x_ptr, weight_ptr, bias_ptr, state_ptr, out_ptr, cu_ptr, slots_ptr, context_ptr,
    channels, stride_x, stride_o, stride_w, stride_slot, stride_c, stride_k,
    TAPS: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_C: tl.constexpr,
):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    mask = cols < channels
    slot, valid, resumes, writes, fill = _row_status(cu_ptr, slots_ptr, context_ptr, row)
    state = state_ptr + slot * stride_slot + cols * stride_c
    taps = weight_ptr + cols * stride_w
    x = tl.load(x_ptr + row.to(tl.int64) * stride_x + cols, mask=mask, other=0.0)
    read = mask & resumes
    # the window [s0, (s1,) (s2,) x], in x's dtype like the reference's
    s0 = tl.load(state, mask=read, other=0.0).to(x.dtype)
    s1 = tl.load(state + stride_k, mask=read & (TAPS >= 3), other=0.0).to(x.dtype)
    s2 = tl.load(state + 2 * stride_k, mask=read & (TAPS >= 4), other=0.0).to(x.dtype)
    acc = tl.load(taps, mask=mask, other=0.0).to(tl.float32) * s0.to(tl.float32)
    acc += tl.load(taps + (TAPS - 1), mask=mask, other=0.0).to(tl.float32) * x.to(tl.float32)
    if TAPS >= 3:
        acc += tl.load(taps + 1, mask=mask, other=0.0).to(tl.float32) * s1.to(tl.float32)
    if TAPS >= 4:
        acc += tl.load(taps + 2, mask=mask, other=0.0).to(tl.float32) * s2.to(tl.float32)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    out = tl.where(valid, acc, fill)
    tl.store(out_ptr + row.to(tl.int64) * stride_o + cols, out.to(out_ptr.dtype.element_ty), mask=mask)
    keep = mask & writes
    dtype = state_ptr.dtype.element_ty
    if TAPS == 2:
        tl.store(state, x.to(dtype), mask=keep)
    if TAPS == 3:
        tl.store(state, s1.to(dtype), mask=keep)
        tl.store(state + stride_k, x.to(dtype), mask=keep)
    if TAPS == 4:
        tl.store(state, s1.to(dtype), mask=keep)
        tl.store(state + stride_k, s2.to(dtype), mask=keep)
        tl.store(state + 2 * stride_k, x.to(dtype), mask=keep)


@triton.jit
def _ssm_update_kernel(
    x_ptr, dt_ptr, A_ptr, B_ptr, C_ptr, state_ptr, out_ptr, cu_ptr, slots_ptr, context_ptr,
    head_dim, state_size, heads_per_group,
    stride_xt, stride_xh, stride_dtt, stride_dth, stride_bt, stride_bg, stride_ct, stride_cg,
    stride_slot, stride_sh, stride_sp, stride_ot, stride_oh,
    BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
):
    row = tl.program_id(0)
    head = tl.program_id(1)
    p = tl.program_id(2) * BLOCK_P + tl.arange(0, BLOCK_P)
    n = tl.arange(0, BLOCK_N)
    p_mask, n_mask = p < head_dim, n < state_size
    slot, valid, resumes, writes, fill = _row_status(cu_ptr, slots_ptr, context_ptr, row)
    row64, group = row.to(tl.int64), head // heads_per_group
    x = tl.load(x_ptr + row64 * stride_xt + head * stride_xh + p, mask=p_mask, other=0.0).to(tl.float32)
    dt = tl.load(dt_ptr + row64 * stride_dtt + head * stride_dth).to(tl.float32)
    decay = tl.exp(dt * tl.load(A_ptr + head).to(tl.float32))
    B = tl.load(B_ptr + row64 * stride_bt + group * stride_bg + n, mask=n_mask, other=0.0).to(tl.float32)
    C = tl.load(C_ptr + row64 * stride_ct + group * stride_cg + n, mask=n_mask, other=0.0).to(tl.float32)
    tile = state_ptr + slot * stride_slot + head * stride_sh + p[:, None] * stride_sp + n[None, :]
    tile_mask = p_mask[:, None] & n_mask[None, :]
    state = tl.load(tile, mask=tile_mask & resumes, other=0.0)
    state = state * decay + (dt * x)[:, None] * B[None, :]
    y = tl.where(valid, tl.sum(state * C[None, :], axis=1), fill)
    tl.store(out_ptr + row64 * stride_ot + head * stride_oh + p, y, mask=p_mask)
    tl.store(tile, state.to(state_ptr.dtype.element_ty), mask=tile_mask & writes)


def _unit_last(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def conv_update(x, weight, bias, conv_state, state_slots, cu_seqlens, context_lens) -> torch.Tensor:
    """Decode step of ``causal_conv1d_cached``: x [B, C], weight [C, K] (K in 2..4), conv_state
    [slots, C, K - 1] -> out [B, C] in x's dtype; the written slots' windows shifted by x."""
    x, weight = _unit_last(x), _unit_last(weight)
    rows, channels = x.shape
    taps = weight.shape[1]
    if not 2 <= taps <= 4:
        raise ValueError(f"conv_update handles 2 to 4 taps, got {taps}")
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    block = min(triton.next_power_of_2(channels), 256)  # several programs even for one sequence
    if rows:
        _conv_update_kernel[(rows, triton.cdiv(channels, block))](
            x, weight, bias if bias is not None else x, conv_state, out, cu_seqlens, state_slots, context_lens,
            channels, x.stride(0), out.stride(0), weight.stride(0), *conv_state.stride(),
            TAPS=taps, HAS_BIAS=bias is not None, BLOCK_C=block, num_warps=4,
        )
    return out


def ssm_update(x, dt, A, B, C, ssm_state, state_slots, cu_seqlens, context_lens) -> torch.Tensor:
    """Decode step of ``ssm_scan_cached``: x [B, H, P], dt [B, H], A [H], B/C [B, G, N], ssm_state
    [slots, H, P, N] -> y [B, H, P] fp32; the written slots advanced by one token."""
    x, B, C, A = _unit_last(x), _unit_last(B), _unit_last(C), A.contiguous()
    if ssm_state.stride(-1) != 1:
        raise ValueError("ssm_update needs the state's last dimension contiguous")
    rows, heads, head_dim = x.shape
    state_size = B.shape[2]
    out = torch.empty(x.shape, dtype=torch.float32, device=x.device)
    block_n = triton.next_power_of_2(state_size)
    block_p = max(1, min(triton.next_power_of_2(head_dim), SSM_TILE // block_n))
    if rows:
        _ssm_update_kernel[(rows, heads, triton.cdiv(head_dim, block_p))](
            x, dt, A, B, C, ssm_state, out, cu_seqlens, state_slots, context_lens,
            head_dim, state_size, heads // B.shape[1],
            x.stride(0), x.stride(1), dt.stride(0), dt.stride(1), B.stride(0), B.stride(1), C.stride(0), C.stride(1),
            ssm_state.stride(0), ssm_state.stride(1), ssm_state.stride(2), out.stride(0), out.stride(1),
            BLOCK_P=block_p, BLOCK_N=block_n, num_warps=4,
        )
    return out
