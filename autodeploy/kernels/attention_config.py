"""Launch configuration of the Triton paged-attention kernel, chosen from shapes only.

No autotuning: configs are a function of the shapes (the interpreter cannot autotune, and a CUDA
graph needs the same launch on every replay), and nothing here reads a metadata value.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch

from .pdl import Trigger

# A split streams at least one block of this many keys (the block table's width, not the context, sets
# the count: graphs are captured per batch size). 8B batch 1 x 512 keys between the GEMVs (H200,
# bench/probes/layer_chain.py, 2026-12-03, merge in one load of 16-byte vectors): 16 splits 7.6-7.8 us per
# layer, 8 splits 10.2-10.3; at 64 keys, a 592-key table (max_seq_len 592) got 8.
MIN_KEYS_PER_SPLIT = 32
MAX_SPLITS = 32  # SmolLM2 (3 KV heads) at batch 1 x 512: 32 splits 7.1 us per layer, 64: 10.0 (bench/probes/layer_chain.py)
DECODE_TOKENS_PER_SEQ = 4  # at most this many tokens per sequence on average: the decode launch
# Programs wanted per SM before splitting the keys (H200 sweep, bench/kernels_gpu.py --sweep,
# 2026-12-02): a decode program streams keys at its own latency-bound pace, so more programs than
# ~1.5 per SM only add partial results to merge. 64 x 512 keys: 1 split 44 us, 4 splits 75 us;
# 8 x 4096: 4 splits 61 us, 16 splits 69 us; 1 x 4096: 16 splits 25 us, 32 splits 29 us. At batch 1
# between the GEMVs of a decode step (bench/probes/layer_chain.py, 2026-12-03, 8B shape, 512 keys, splits
# without keys skipping the merge): 4 splits 13.6 us per layer, 8: 11.5, 16: 11.8, 32: 15.8 (before
# the merge's 16-byte loads; after them 8: 10.3, 16: 7.7).
# A prefill program (~215 registers x 256 threads, 96 KB smem) fits one per SM and has plenty of
# work: split only when the tiles cannot give every SM two programs.
DECODE_PROGRAMS_PER_SM = 1.5
PREFILL_PROGRAMS_PER_SM = 2
CPU_TARGET_PROGRAMS = {True: 12, False: 2}  # decode / prefill under the interpreter: small tests still split


@dataclass(frozen=True)
class AttentionLaunch:
    """Rows per query tile (query tokens x padded GQA group), keys per step, flash-decoding splits.

    ``decode``: tiles hold few new keys (about one per sequence), so the kernel walks them in one
    masked loop instead of an unmasked loop plus the diagonal: one loop fewer, fewer registers.
    Either way is correct for any step.

    ``preload_kv`` (decode launches only): each program loads its split's first block of pooled keys
    (block table entries, then K and V) before the PDL wait, while the kernel before it finishes, so
    that after the wait the block is a dot away instead of two dependent memory round trips. (Two
    blocks preloaded: 8B batch 1 between the GEMVs 8.3 vs 8.0 us per layer, H200, 2026-12-03.)
    ``second_block_early`` (with ``preload_kv``): the second block's table entries are loaded before
    the wait as well, and its K/V right after q, before the first block's dot.
    ``trigger``: where each program lets the next kernel (under PDL) launch.
    """

    block_m: int
    block_n: int
    num_splits: int = 1
    num_warps: int = 4
    num_stages: int = 2
    decode: bool = False
    preload_kv: bool = False
    second_block_early: bool = False
    trigger: Trigger = Trigger.START

    def block_q(self, group: int) -> int:
        """Query tokens per tile for ``group`` query heads per KV head."""
        return max(1, self.block_m // _next_pow2(group))

    @classmethod
    def choose(
        cls,
        num_tokens: int,
        num_seqs: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        max_kv_len: int,
        device: torch.device,
        element_size: int = 2,
    ) -> "AttentionLaunch":
        """Decode-like steps (about one query per sequence) get 16-row tiles and, when the grid
        would leave SMs idle, flash-decoding splits over the keys; prefill gets 128-row tiles.
        ``element_size``: bytes per element of q and the cache (4 for fp32)."""
        group_pad = _next_pow2(num_heads // num_kv_heads)
        block_n = 64 if head_dim <= 128 else 32
        # Few tokens per sequence (decodes, maybe with a short prompt chunk): 16-row tiles. A mixed
        # step under the prefill config gives every decode a 128-row tile of which one row is real
        # (H200: 248 decodes + 2 x 128 prompt tokens, attention 390 us per layer).
        decode = num_tokens <= DECODE_TOKENS_PER_SEQ * num_seqs
        if decode:
            block_m, warps, stages = max(16, group_pad), 4, 2  # 3 stages spill (tests/kernels/compile_sm90.py)
        else:
            block_m = max(128 if head_dim <= 128 else 64, group_pad)
            if head_dim * element_size > 256:
                block_n = 32  # fp32 at head 128 with RoPE folded in: 257 KB of shared memory at 64 keys
            warps, stages = (8 if block_m >= 128 or head_dim > 128 else 4), 2  # 4 warps spill at head 256
        block_q = max(1, block_m // group_pad)
        tiles = max(num_seqs, -(-num_tokens // block_q)) * num_kv_heads
        target = _target_programs(decode, device)
        # A decode grid short of filling the GPU waits on latency: smaller key blocks (8B batch 1 x 512
        # between the GEMVs: 10.4 vs 12.5 us), and the preload hides a round trip. In a full grid the
        # preload's 30-40 extra registers cost occupancy; fp32 blocks spill (tests/kernels/compile_sm90.py).
        latency_bound = decode and tiles < target
        if latency_bound:
            block_n = min(block_n, 32)
        splits = _num_splits(tiles, max_kv_len, target)
        preload = latency_bound and element_size <= 2 and _flag("AUTODEPLOY_ATTN_PRELOAD_KV", True)
        second_early = preload and _flag("AUTODEPLOY_ATTN_SECOND_EARLY", False)
        return cls(block_m, block_n, splits, warps, stages, decode, preload, second_early)


def _flag(name: str, default: bool) -> bool:
    """An on/off environment switch for A/B runs of a launch choice ("0" off, "1" on)."""
    return os.environ.get(name, "1" if default else "0") != "0"


def _num_splits(tiles: int, max_kv_len: int, target_programs: int) -> int:
    """Flash-decoding splits: enough programs to fill the GPU, each streaming enough keys.

    A power of two: the split count is a constexpr, and every distinct value is one more kernel
    for Triton to compile when an eager step first meets it (seconds, while requests wait).
    """
    if tiles >= target_programs:
        return 1
    wanted = -(-target_programs // tiles)
    by_length = max(1, max_kv_len // MIN_KEYS_PER_SPLIT)
    splits = max(1, min(wanted, by_length, MAX_SPLITS))
    return 1 << (splits.bit_length() - 1)


def _target_programs(decode: bool, device: torch.device) -> int:
    if device.type != "cuda":
        return CPU_TARGET_PROGRAMS[decode]
    per_sm = DECODE_PROGRAMS_PER_SM if decode else PREFILL_PROGRAMS_PER_SM
    return int(per_sm * _sm_count_of(device))


def _sm_count_of(device: torch.device) -> int:
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())
