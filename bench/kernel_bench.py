"""The kernels section: each Triton kernel of a decode step at the Llama-3.1-8B shape (norms, SiLU·mul, argmax,
RoPE; paged attention with 32 q / 8 kv heads of 128 on pages of 16: decode at batch 1-256 x context 512/4096,
prefill 4 x 1024, chunked prefill on 1024 cached tokens, decode on an FP8 pool, decode with RoPE folded in next to
the unfused pair) timed against its floor and its torch peer:

- time: median replay of a CUDA graph calling the kernel on K rotating input sets (more than 4x the L2 cache
  together), divided by K: its cost inside the engine's graph, without launch overhead or L2 reuse; the note
  adds ``eager`` (``triton.testing.do_bench``, launch included) and ``torch`` (the reference in the same graph);
- floor: the bytes that must move at the copy bandwidth, or prefill's FLOPs at the GEMM rate if longer.

Anchors (FlashInfer 0.6.6, H200): decode 64 x 4096 386 us, 64 x 512 59 us, prefill 4 x 1024 413 TFLOP/s;
``--flashinfer`` times FlashInfer in the same run (minutes of JIT). The paged batches are the GPU tests' too; the
launch-config sweeps are ``bench/probes/attention_sweeps.py``.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, replace

import torch
from gpu_harness import BF16_TOL, DEV, Report, Row, eager_us, graph_us, rel_err, sets_for, suite_rows, timed
from table import TableRow

import autodeploy.ops  # noqa: F401  (registers the reference ops)
from autodeploy.kernels.activation import act_mul
from autodeploy.kernels.argmax import argmax_rows
from autodeploy.kernels.attention_config import AttentionLaunch
from autodeploy.kernels.norm import add_rms_norm, rms_norm
from autodeploy.kernels.paged_attention import paged_attention_fwd
from autodeploy.kernels.rope import rope, rope_qk
from autodeploy.ops.mlp import ACTIVATIONS
from autodeploy.ops.norm import rms_norm_reference
from autodeploy.ops.paged_attention import to_cache_dtype
from autodeploy.ops.rope import rope_reference

HQ, HKV, D, PAGE, HIDDEN, INTER = 32, 8, 128, 16, 4096, 14336
BF16 = torch.bfloat16


def _random_sets(nbytes: float, *shape: int) -> list[torch.Tensor]:
    """As many random bf16 ``shape`` tensors as ``timed`` rotates through for a call moving ``nbytes``."""
    return [torch.randn(*shape, device=DEV, dtype=BF16) for _ in range(sets_for(nbytes))]


def bench_norms(report: Report) -> None:
    for tokens in (1, 256, 8192):
        x = _random_sets(4 * tokens * HIDDEN, tokens, HIDDEN)
        res = [torch.randn_like(t) for t in x]
        w = torch.randn(HIDDEN, device=DEV, dtype=BF16)
        report.add(timed(Row(f"rms_norm T={tokens} H={HIDDEN}"), lambda i: lambda: rms_norm(x[i], w, 1e-5),
                         lambda i: lambda: rms_norm_reference(x[i], w, 1e-5), 2 * 2 * tokens * HIDDEN))
        ref = lambda i: lambda: rms_norm_reference(x[i] + res[i], w, 1e-5)  # noqa: E731
        report.add(timed(Row(f"add+rms_norm T={tokens} H={HIDDEN}"),
                         lambda i: lambda: add_rms_norm(x[i], res[i], w, 1e-5), ref, 4 * 2 * tokens * HIDDEN))


def bench_act_mul(report: Report) -> None:
    for tokens in (1, 256, 8192):
        halves = [t.chunk(2, dim=-1) for t in _random_sets(6 * tokens * INTER, tokens, 2 * INTER)]
        ref = lambda i: lambda: ACTIVATIONS["silu"](halves[i][0]) * halves[i][1]  # noqa: E731
        report.add(timed(Row(f"silu*mul T={tokens} I={INTER}"),
                         lambda i: lambda: act_mul(*halves[i]), ref, 3 * 2 * tokens * INTER))


def bench_argmax(report: Report) -> None:
    """Greedy sampling's argmax over the 8B vocabulary (128256) in bf16."""
    for rows in (1, 64, 256):
        logits = _random_sets(2 * rows * 128256, rows, 128256)
        report.add(timed(Row(f"argmax {rows}x128256"), lambda i: lambda: argmax_rows(logits[i]),
                         lambda i: lambda: logits[i].argmax(dim=-1), 2 * rows * 128256))


def bench_rope(report: Report) -> None:
    for tokens in (1, 256, 8192):
        # q as the fused-qkv graph produces it: a [1, T, 32, 128] slice of [1, T, 6144], transposed
        qkv = _random_sets(4 * tokens * HQ * D, 1, tokens, (HQ + 2 * HKV) * D)
        q = [t[..., : HQ * D].view(1, tokens, HQ, D).transpose(1, 2) for t in qkv]
        cos = torch.randn(1, 1, tokens, D, device=DEV, dtype=BF16)
        sin = torch.randn(1, 1, tokens, D, device=DEV, dtype=BF16)
        k = [t[..., HQ * D: (HQ + HKV) * D].view(1, tokens, HKV, D).transpose(1, 2) for t in qkv]
        ref = lambda i: lambda: rope_reference(q[i], cos, sin, False)  # noqa: E731
        report.add(timed(Row(f"rope q T={tokens} 32x128"), lambda i: lambda: rope(q[i], cos, sin), ref,
                         2 * (2 * tokens * HQ * D + 2 * tokens * D)))
        ref_qk = lambda i: lambda: (rope_reference(q[i], cos, sin, False), rope_reference(k[i], cos, sin, False))  # noqa: E731
        report.add(timed(Row(f"rope_qk T={tokens} 32+8 heads"),
                         lambda i: lambda: rope_qk(q[i], k[i], cos, sin), ref_qk,
                         2 * (2 * tokens * (HQ + HKV) * D + 2 * tokens * D)))


@dataclass
class PagedBatch:
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    cache: torch.Tensor
    query_lens: torch.Tensor
    context_lens: torch.Tensor
    cu_seqlens: torch.Tensor
    block_table: torch.Tensor
    slots: torch.Tensor

    def triton(self, launch=None, cache=None, **features):
        cache = self.cache if cache is None else cache
        return paged_attention_fwd(self.q, self.k, self.v, cache, self.cu_seqlens, self.context_lens,
                                   self.block_table, self.slots, D ** -0.5, launch=launch, **features)

    def reference(self, cache=None, **features):
        """The reference op on the same inputs; ``features`` are the kernel's keyword arguments (FP8 scales too)."""
        cache = self.cache if cache is None else cache
        return torch.ops.autodeploy.paged_attention(
            self.q, self.k, self.v, cache, self.query_lens, self.context_lens, self.cu_seqlens, self.block_table,
            self.slots, D ** -0.5, **features)


def paged_metadata(seqs: list[tuple[int, int]], pad_tokens=0, device=None,
                   shuffled: bool = True) -> tuple[tuple[torch.Tensor, ...], int]:
    """Batch metadata (query_lens, context_lens, cu_seqlens, block_table, slot_mapping) of sequences of
    (context_len, query_len) on shuffled pages of ``PAGE`` tokens (``shuffled=False``: each sequence's pages
    consecutive, as a fresh pool hands them out) (``pad_tokens`` padding tokens last), and the number of pages a
    pool needs for them (one spare)."""
    device = DEV if device is None else device
    pages = [-(-(c + n) // PAGE) for c, n in seqs]
    count = sum(pages) + 1
    # consecutive: pages 1, 2, ... as a fresh engine pool hands them out (page 0 is its spare, last here)
    order = torch.randperm(count, device=device) if shuffled else torch.arange(1, count + 1, device=device) % count
    table = torch.full((len(seqs), max(pages)), -1, dtype=torch.int64, device=device)
    slots, used = [], 0
    for b, ((ctx, n), count) in enumerate(zip(seqs, pages)):
        table[b, :count] = order[used: used + count]
        used += count
        pos = torch.arange(ctx, ctx + n, device=device)
        slots.append(table[b, pos // PAGE] * PAGE + pos % PAGE)
    slots.append(torch.full((pad_tokens,), -1, dtype=torch.int64, device=device))
    query_lens = torch.tensor([n for _, n in seqs], device=device)
    cu_seqlens = torch.nn.functional.pad(query_lens.cumsum(0), (1, 0))
    context_lens = torch.tensor([c for c, _ in seqs], device=device)
    return (query_lens, context_lens, cu_seqlens, table, torch.cat(slots)), sum(pages) + 1


def paged_batch(seqs: list[tuple[int, int]], heads=HQ, kv_heads=HKV, head_dim=D, pad_tokens=0,
                head_major: bool = False, device=DEV, dtype=BF16, shuffled: bool = True) -> PagedBatch:
    """Sequences of (context_len, query_len) on shuffled pages of a random bf16 cache. ``head_major``: the
    cache is stored [pages, 2, kv_heads, PAGE, head_dim] (each head's page contiguous, "HND") and passed as
    a view of the pool's logical [pages, 2, PAGE, kv_heads, head_dim] shape (the kernel reads strides)."""
    meta, pages = paged_metadata(seqs, pad_tokens, device, shuffled)
    tokens = meta[-1].shape[0]
    rand = lambda *shape: torch.randn(*shape, device=device, dtype=dtype)  # noqa: E731
    pool_shape = (pages, 2, kv_heads, PAGE, head_dim) if head_major else (pages, 2, PAGE, kv_heads, head_dim)
    cache = rand(*pool_shape).transpose(2, 3) if head_major else rand(*pool_shape)
    return PagedBatch(rand(tokens, heads, head_dim), rand(tokens, kv_heads, head_dim), rand(tokens, kv_heads, head_dim),
                      cache, *meta)


def attention_cost(seqs: list[tuple[int, int]], kv_bytes: int = 2) -> tuple[float, float]:
    """(bytes, flops) of causal paged attention: the visible K/V read once (``kv_bytes`` an element), q/out/new
    k,v once."""
    kv = sum(c + n for c, n in seqs) * HKV * D * 2 * kv_bytes
    tokens = sum(n for _, n in seqs)
    io = tokens * (2 * HQ + 2 * HKV) * D * 2
    flops = sum(4 * HQ * D * (n * c + n * (n + 1) / 2) for c, n in seqs)
    return kv + io, flops


def bench_attention(report: Report, flashinfer: bool) -> None:
    cases = [(f"decode b={b} ctx={c}", [(c - 1, 1)] * b) for c in (512, 4096) for b in (1, 8, 64, 256)]
    cases += [("prefill 4x1024", [(0, 1024)] * 4), ("chunked prefill 4x1024 on 1024", [(1024, 1024)] * 4)]
    for name, seqs in cases:
        nbytes, flops = attention_cost(seqs)
        batches = [paged_batch(seqs) for _ in range(sets_for(nbytes, cap=16))]
        first = batches[0]
        launch = AttentionLaunch.choose(first.q.shape[0], len(seqs), HQ, HKV, D, first.block_table.shape[1] * PAGE,
                                        DEV)
        row = Row(name, note=f"tile {launch.block_m}x{launch.block_n}, splits {launch.num_splits}")
        row = timed(row, lambda i: batches[i % len(batches)].triton, None, nbytes)
        row.flops = flops if "prefill" in name else 0.0
        if flashinfer:
            try:
                row.note += f"; flashinfer {flashinfer_us(first):.1f} us eager"
            except Exception as exc:  # optional comparison: report, keep benchmarking
                row.note += f"; flashinfer failed: {type(exc).__name__}: {str(exc)[:80]}"
        report.add(row)
        del batches


def fp8_pool(pool: torch.Tensor) -> tuple[torch.Tensor, tuple[float, float]]:
    """``pool`` quantized to e4m3 as a calibrated checkpoint's scales quantize it (one scale for K, one for V:
    amax / 448), and the scales."""
    scales = tuple(float(pool[:, i].abs().amax()) / 448.0 for i in (0, 1))
    fp8 = torch.empty(pool.shape, dtype=torch.float8_e4m3fn, device=pool.device)
    for i, scale in enumerate(scales):
        fp8[:, i] = to_cache_dtype(pool[:, i], torch.float8_e4m3fn, scale)
    return fp8, scales


def bench_fp8_kv(report: Report) -> None:
    """Decode on an FP8 KV pool (half the bytes) against the bf16 rows above."""
    for b, c in ((64, 4096), (1, 4096), (64, 512)):
        seqs = [(c - 1, 1)] * b
        nbytes = attention_cost(seqs, kv_bytes=1)[0]
        batches = [paged_batch(seqs) for _ in range(sets_for(nbytes, cap=16))]
        pools = [fp8_pool(batch.cache) for batch in batches]
        def call(i: int):
            batch, (pool, (k_scale, v_scale)) = batches[i % len(batches)], pools[i % len(batches)]
            return lambda: batch.triton(cache=pool, k_scale=k_scale, v_scale=v_scale)

        report.add(timed(Row(f"decode b={b} ctx={c} fp8 kv"), call, None, nbytes))
        del batches, pools


def rotary_rows(seqs: list[tuple[int, int]], theta: float = 500000.0, device=DEV) -> tuple[torch.Tensor, ...]:
    """cos/sin [T, D] bf16 of each token's position (Llama-3 half-rotate frequencies), as the graph feeds
    them to an attention with its RoPE folded in."""
    pos = torch.cat([torch.arange(c, c + n, device=device) for c, n in seqs]).float()
    inv_freq = theta ** -(torch.arange(0, D, 2, device=device).float() / D)
    angles = (pos[:, None] * inv_freq).repeat(1, 2)
    return angles.cos().to(BF16), angles.sin().to(BF16)


def bench_rope_attention(report: Report) -> None:
    """Decode with RoPE folded into the attention (fuse_rope_attention), next to the unfused rope_qk + attention."""
    for b in (1, 64):
        seqs = [(511, 1)] * b
        nbytes = attention_cost(seqs)[0] + 2 * b * D * 2  # + the cos/sin rows
        batches = [paged_batch(seqs) for _ in range(sets_for(nbytes))]  # as many as timed() rotates through
        cos, sin = rotary_rows(seqs)
        unfused = graph_us([_unfused_rope_attention(batch, cos, sin) for batch in batches])
        row = timed(Row(f"decode+rope b={b} ctx=512"),
                    lambda i: lambda: batches[i].triton(rope_cos=cos, rope_sin=sin), None, nbytes)
        row.note = f"unfused rope_qk + attention {unfused:.1f} us (graph)"
        report.add(row)
        del batches


def _unfused_rope_attention(batch: PagedBatch, cos: torch.Tensor, sin: torch.Tensor):
    def call():
        q, k = rope_qk(batch.q, batch.k, cos[:, None], sin[:, None])
        return replace(batch, q=q, k=k).triton()

    return call


def flashinfer_us(batch: PagedBatch) -> float:
    from autodeploy.kernels.flashinfer_paged import flashinfer_paged_attention

    call = lambda: flashinfer_paged_attention(  # noqa: E731
        batch.q, batch.k, batch.v, batch.cache, batch.query_lens, batch.context_lens, batch.cu_seqlens,
        batch.block_table, batch.slots, D ** -0.5, None, None)
    err = rel_err(call(), batch.reference())
    if not err < BF16_TOL:
        raise RuntimeError(f"flashinfer backend disagrees with the reference: rel err {err:.2e}")
    return eager_us(call)


def run_all(flashinfer: bool = False) -> Report:
    torch.manual_seed(0)
    report = Report()
    for bench in (bench_norms, bench_act_mul, bench_argmax, bench_rope):
        bench(report)
    bench_attention(report, flashinfer)
    bench_fp8_kv(report)
    bench_rope_attention(report)
    return report


def add_options(group) -> None:
    group.add_argument("--flashinfer", action="store_true",
                       help="also time the FlashInfer backend (minutes of JIT)")


def table_rows(args, header) -> Iterator[TableRow]:
    yield from suite_rows(run_all(args.flashinfer), header, "kernels")
