"""Triton kernel: write the step's K/V into the paged cache (``slot_mapping``; -1 = skip).

One program per token writes all KV heads of that token. The same program zeroes the attention
output row of a token that belongs to no sequence (``t >= cu_seqlens[-1]``: padding of a CUDA-graph
batch), so the attention kernels never have to touch rows they do not own and the output matches
the reference op (zeros) without a separate memset launch. Used by the flashinfer backend; the
Triton attention kernel (``paged_attention.py``) does both itself, in its single launch.

An FP8 pool (``float8_e4m3fn``) is written as its bytes: ``e4m3(k / k_scale)`` rounded as the
reference op rounds it (``paged_attention_blocks._to_e4m3``); a float pool ignores the scales.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .paged_attention_blocks import _to_e4m3


@triton.jit
def _write_kv_kernel(
    k_ptr, v_ptr, cache_ptr, slot_ptr, out_ptr, cu_seqlens_ptr, num_seqs,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_cb, stride_ckv, stride_cs, stride_ch, stride_ot, k_scale, v_scale,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, OUT_ROW: tl.constexpr, BLOCK_OUT: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + token)
    if slot >= 0:
        heads = tl.arange(0, BLOCK_H)
        dims = tl.arange(0, BLOCK_D)
        mask = (heads[:, None] < NUM_KV_HEADS) & (dims[None, :] < HEAD_DIM)
        block = slot // PAGE_SIZE
        dst = cache_ptr + block * stride_cb + (slot % PAGE_SIZE) * stride_cs + heads[:, None] * stride_ch + dims[None, :]
        key = tl.load(k_ptr + token * stride_kt + heads[:, None] * stride_kh + dims[None, :], mask=mask)
        value = tl.load(v_ptr + token * stride_vt + heads[:, None] * stride_vh + dims[None, :], mask=mask)
        if cache_ptr.dtype.element_ty == tl.uint8:  # an FP8 pool's bytes
            key = _to_e4m3(key, k_scale).to(tl.uint8, bitcast=True)
            value = _to_e4m3(value, v_scale).to(tl.uint8, bitcast=True)
        tl.store(dst, key.to(cache_ptr.dtype.element_ty), mask=mask)
        tl.store(dst + stride_ckv, value.to(cache_ptr.dtype.element_ty), mask=mask)
    total = tl.load(cu_seqlens_ptr + num_seqs)
    if token >= total:
        offsets = tl.arange(0, BLOCK_OUT)
        zeros = tl.zeros([BLOCK_OUT], dtype=out_ptr.dtype.element_ty)
        for start in range(0, OUT_ROW, BLOCK_OUT):
            tl.store(out_ptr + token * stride_ot + start + offsets, zeros, mask=start + offsets < OUT_ROW)


def write_kv_cache(
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    out: torch.Tensor,
    cu_seqlens: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Write k/v [T, Hkv, D] into ``kv_cache`` at ``slot_mapping`` (an FP8 pool: quantized with the
    scales); zero ``out`` [T, Hq, D] (contiguous) rows of tokens past ``cu_seqlens[-1]``."""
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    assert k.stride(-1) == 1 and v.stride(-1) == 1 and kv_cache.stride(-1) == 1 and out.is_contiguous()
    out_row = out.shape[1] * out.shape[2]
    pool = kv_cache.view(torch.uint8) if kv_cache.dtype == torch.float8_e4m3fn else kv_cache
    _write_kv_kernel[(num_tokens,)](
        k, v, pool, slot_mapping, out, cu_seqlens, cu_seqlens.shape[0] - 1,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3), out.stride(0),
        float(k_scale), float(v_scale),
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, PAGE_SIZE=kv_cache.shape[2],
        BLOCK_H=triton.next_power_of_2(num_kv_heads), BLOCK_D=triton.next_power_of_2(head_dim),
        OUT_ROW=out_row, BLOCK_OUT=min(4096, triton.next_power_of_2(out_row)),
        num_warps=4,
    )
