"""The suite's kernels section: autodeploy's Triton kernels checked and timed on the GPU.

Every kernel is first checked against its torch reference on fresh random bf16 inputs
(||out - ref|| / ||ref||; bf16 passes below 1e-2), then timed:

- ``graph us``: median replay time of a CUDA graph that calls the kernel on K rotating input sets
  (K sized so the sets exceed 4x the L2 cache where memory allows), divided by K: the time the
  kernel costs inside the engine's decode graph, without launch overhead or L2 reuse;
- ``eager us``: ``triton.testing.do_bench`` median of one eager call (host launch cost included);
- ``torch us``: the reference in the same CUDA-graph harness (small ops only), the kernel's peer;
- floor: bytes that must move (inputs read once, outputs written once) at the copy bandwidth, and for
  prefill attention its FLOPs at the bf16 GEMM rate, whichever is longer.

The rows, the table and the timing live in ``gpu_harness.py`` (this folder).

Paged attention uses the Llama-3.1-8B shape (32 q heads, 8 kv heads, head 128, page 16): decode at
batch 1/8/64/256 x context 512/4096, prefill 4 x 1024 and a chunked prefill 4 x 1024 on 1024
cached tokens; decode with the RoPE folded in (``decode+rope``, batch 1/64 x 512) next to the
unfused ``rope_qk`` + attention pair it replaces. It is one launch per call: the cache write, the
attention and the merge of the flash-decoding splits; its checks also compare the written cache with the
reference's and replay a split launch from a CUDA graph (the split counters must be back at zero after every
replay). Anchors (FlashInfer 0.6.6 on an H200): decode 64 x 4096 386 us, 64 x 512 59 us, prefill 4 x 1024
413 TFLOP/s; ``--flashinfer`` times FlashInfer in the same run (JIT-compiles for minutes).

    python bench/full_table.py --sections kernels    # < 3 minutes; exit 1 if any check fails
    python bench/kernels_gpu.py [--flashinfer]       # the same checks in the harness's own wider table

The decode launch-config sweeps and the per-program timeline: ``bench/probes/attention_sweeps.py``.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterator
from dataclasses import dataclass, replace

import torch
import triton
from gpu_harness import (BF16_TOL, DEV, Report, Row, eager_us, graph_us, rel_err, sets_for, suite_rows,
                         timed)
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
from autodeploy.ops.rope import rope_reference

HQ, HKV, D, PAGE, HIDDEN, INTER = 32, 8, 128, 16, 4096, 14336
BF16 = torch.bfloat16


# ----------------------------------------------------------------------------- small kernels


def bench_norms(report: Report) -> None:
    for tokens in (1, 256, 8192):
        x = [torch.randn(tokens, HIDDEN, device=DEV, dtype=BF16) for _ in range(sets_for(4 * tokens * HIDDEN))]
        res = [torch.randn_like(t) for t in x]
        w = torch.randn(HIDDEN, device=DEV, dtype=BF16)
        row = Row(f"rms_norm T={tokens} H={HIDDEN}", rel_err(rms_norm(x[0], w, 1e-5), rms_norm_reference(x[0], w, 1e-5)))
        report.add(timed(row, lambda i: lambda: rms_norm(x[i], w, 1e-5),
                         lambda i: lambda: rms_norm_reference(x[i], w, 1e-5), 2 * 2 * tokens * HIDDEN))
        normed, summed = add_rms_norm(x[0], res[0], w, 1e-5)
        want_sum = x[0] + res[0]
        err = max(rel_err(summed, want_sum), rel_err(normed, rms_norm_reference(want_sum, w, 1e-5)))
        ref = lambda i: lambda: rms_norm_reference(x[i] + res[i], w, 1e-5)  # noqa: E731
        report.add(timed(Row(f"add+rms_norm T={tokens} H={HIDDEN}", err),
                         lambda i: lambda: add_rms_norm(x[i], res[i], w, 1e-5), ref, 4 * 2 * tokens * HIDDEN))


def bench_act_mul(report: Report) -> None:
    for tokens in (1, 256, 8192):
        fused = [torch.randn(tokens, 2 * INTER, device=DEV, dtype=BF16) for _ in range(sets_for(6 * tokens * INTER))]
        halves = [t.chunk(2, dim=-1) for t in fused]
        ref = lambda i: lambda: ACTIVATIONS["silu"](halves[i][0]) * halves[i][1]  # noqa: E731
        err = rel_err(act_mul(*halves[0]), ref(0)())
        report.add(timed(Row(f"silu*mul T={tokens} I={INTER}", err),
                         lambda i: lambda: act_mul(*halves[i]), ref, 3 * 2 * tokens * INTER))


def bench_argmax(report: Report) -> None:
    """Greedy sampling's argmax over the 8B vocabulary (128256) in bf16; check: share of rows that differ
    from torch.argmax (0 passes)."""
    for rows in (1, 64, 256):
        logits = [torch.randn(rows, 128256, device=DEV, dtype=BF16) for _ in range(sets_for(2 * rows * 128256))]
        err = float((argmax_rows(logits[0]) != logits[0].argmax(dim=-1)).float().mean())
        report.add(timed(Row(f"argmax {rows}x128256", err), lambda i: lambda: argmax_rows(logits[i]),
                         lambda i: lambda: logits[i].argmax(dim=-1), 2 * rows * 128256))


def bench_rope(report: Report) -> None:
    for tokens in (1, 256, 8192):
        count = sets_for(4 * tokens * HQ * D)
        # q as the fused-qkv graph produces it: a [1, T, 32, 128] slice of [1, T, 6144], transposed
        qkv = [torch.randn(1, tokens, (HQ + 2 * HKV) * D, device=DEV, dtype=BF16) for _ in range(count)]
        q = [t[..., : HQ * D].view(1, tokens, HQ, D).transpose(1, 2) for t in qkv]
        cos = torch.randn(1, 1, tokens, D, device=DEV, dtype=BF16)
        sin = torch.randn(1, 1, tokens, D, device=DEV, dtype=BF16)
        k = [t[..., HQ * D: (HQ + HKV) * D].view(1, tokens, HKV, D).transpose(1, 2) for t in qkv]
        ref = lambda i: lambda: rope_reference(q[i], cos, sin, False)  # noqa: E731
        err = rel_err(rope(q[0], cos, sin), ref(0)())
        report.add(timed(Row(f"rope q T={tokens} 32x128", err), lambda i: lambda: rope(q[i], cos, sin), ref,
                         2 * (2 * tokens * HQ * D + 2 * tokens * D)))
        ref_qk = lambda i: lambda: (rope_reference(q[i], cos, sin, False), rope_reference(k[i], cos, sin, False))  # noqa: E731
        got_q, got_k = rope_qk(q[0], k[0], cos, sin)
        want_q, want_k = ref_qk(0)()
        report.add(timed(Row(f"rope_qk T={tokens} 32+8 heads", max(rel_err(got_q, want_q), rel_err(got_k, want_k))),
                         lambda i: lambda: rope_qk(q[i], k[i], cos, sin), ref_qk,
                         2 * (2 * tokens * (HQ + HKV) * D + 2 * tokens * D)))


# ----------------------------------------------------------------------------- paged attention


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
        cache = self.cache if cache is None else cache
        return torch.ops.autodeploy.paged_attention(
            self.q, self.k, self.v, cache, self.query_lens, self.context_lens, self.cu_seqlens,
            self.block_table, self.slots, D ** -0.5, features.get("sliding_window"),
            features.get("logit_softcap"), features.get("sinks"), features.get("rope_cos"),
            features.get("rope_sin"), features.get("rope_interleaved", False))


def paged_metadata(seqs: list[tuple[int, int]], pad_tokens=0, device=None) -> tuple[tuple[torch.Tensor, ...], int]:
    """Batch metadata (query_lens, context_lens, cu_seqlens, block_table, slot_mapping) of sequences of
    (context_len, query_len) on shuffled pages of ``PAGE`` tokens (``pad_tokens`` padding tokens last), and the
    number of pages a pool needs for them (one spare)."""
    device = DEV if device is None else device
    pages = [-(-(c + n) // PAGE) for c, n in seqs]
    order = torch.randperm(sum(pages) + 1, device=device)
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
                head_major: bool = False, device=DEV, dtype=BF16) -> PagedBatch:
    """Sequences of (context_len, query_len) on shuffled pages of a random bf16 cache. ``head_major``: the
    cache is stored [pages, 2, kv_heads, PAGE, head_dim] (each head's page contiguous, "HND") and passed as
    a view of the pool's logical [pages, 2, PAGE, kv_heads, head_dim] shape (the kernel reads strides)."""
    meta, pages = paged_metadata(seqs, pad_tokens, device)
    tokens = meta[-1].shape[0]
    rand = lambda *shape: torch.randn(*shape, device=device, dtype=dtype)  # noqa: E731
    return PagedBatch(rand(tokens, heads, head_dim), rand(tokens, kv_heads, head_dim),
                      rand(tokens, kv_heads, head_dim), _cache(pages, kv_heads, head_dim, head_major, device, dtype), *meta)


def _cache(pages: int, kv_heads: int, head_dim: int, head_major: bool, device=DEV, dtype=BF16) -> torch.Tensor:
    """A random pool of the logical shape [pages, 2, PAGE, kv_heads, head_dim]; ``head_major`` stores it
    as [pages, 2, kv_heads, PAGE, head_dim] (a view)."""
    if head_major:
        return torch.randn(pages, 2, kv_heads, PAGE, head_dim, device=device, dtype=dtype).transpose(2, 3)
    return torch.randn(pages, 2, PAGE, kv_heads, head_dim, device=device, dtype=dtype)


def attention_cost(seqs: list[tuple[int, int]]) -> tuple[float, float]:
    """(bytes, flops) of causal paged attention: the visible K/V read once, q/out/new k,v once."""
    kv = sum(c + n for c, n in seqs) * HKV * D * 2 * 2
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
        err = rel_err(first.triton(), first.reference())
        tokens, num_seqs = first.q.shape[0], len(seqs)
        launch = AttentionLaunch.choose(tokens, num_seqs, HQ, HKV, D, first.block_table.shape[1] * PAGE, DEV)
        row = Row(name, err, note=f"tile {launch.block_m}x{launch.block_n}, splits {launch.num_splits}")
        row = timed(row, lambda i: batches[i % len(batches)].triton, None, nbytes)
        row.flops = flops if "prefill" in name else 0.0
        if flashinfer:
            try:
                row.note += f"; flashinfer {flashinfer_us(first):.1f} us eager"
            except Exception as exc:  # optional comparison: report, keep benchmarking
                row.note += f"; flashinfer failed: {type(exc).__name__}: {str(exc)[:80]}"
        report.add(row)
        del batches


def rotary_rows(seqs: list[tuple[int, int]], theta: float = 500000.0, device=DEV) -> tuple[torch.Tensor, ...]:
    """cos/sin [T, D] bf16 of each token's position (Llama-3 half-rotate frequencies), as the graph feeds
    them to an attention with its RoPE folded in."""
    pos = torch.cat([torch.arange(c, c + n, device=device) for c, n in seqs]).float()
    inv_freq = theta ** -(torch.arange(0, D, 2, device=device).float() / D)
    angles = (pos[:, None] * inv_freq).repeat(1, 2)
    return angles.cos().to(BF16), angles.sin().to(BF16)


def bench_rope_attention(report: Report) -> None:
    """Decode with RoPE folded into the attention (fuse_rope_attention): checked against the reference op
    with the same rotary inputs (output and written cache), timed next to the unfused rope_qk + attention."""
    for b in (1, 64):
        seqs = [(511, 1)] * b
        nbytes = attention_cost(seqs)[0] + 2 * b * D * 2  # + the cos/sin rows
        batches = [paged_batch(seqs) for _ in range(sets_for(nbytes))]  # as many as timed() rotates through
        cos, sin = rotary_rows(seqs)
        first = batches[0]
        want_cache, got_cache = first.cache.clone(), first.cache.clone()
        err = rel_err(first.triton(cache=got_cache, rope_cos=cos, rope_sin=sin),
                      first.reference(want_cache, rope_cos=cos, rope_sin=sin))
        written = (first.slots // PAGE, slice(None), first.slots % PAGE)  # the new rotated keys and values
        err = max(err, rel_err(got_cache[written], want_cache[written]))
        unfused = graph_us([_unfused_rope_attention(batch, cos, sin) for batch in batches])
        row = timed(Row(f"decode+rope b={b} ctx=512", err),
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


def check_attention_features(report: Report) -> None:
    """Correctness only: mixed steps with every feature, GQA/MQA/MHA, padding and empty sequences; the
    cache after the call must equal the reference's, bit for bit."""
    mixed = [(37, 5), (0, 70), (300, 1), (0, 0), (129, 1), (16, 33)]
    sinks = torch.randn(HQ, device=DEV)
    for name, heads, kv_heads, head_dim, feats in [
        ("gqa4 d128", HQ, HKV, D, {}),
        ("gqa4 window64 softcap30 sinks", HQ, HKV, D,
         dict(sliding_window=64, logit_softcap=30.0, sinks=sinks)),
        ("mqa d64", 8, 1, 64, {}),
        ("mha d256", 4, 4, 256, {}),
    ]:
        batch = paged_batch(mixed, heads, kv_heads, head_dim, pad_tokens=5)
        want_cache, got_cache = batch.cache.clone(), batch.cache.clone()
        want = batch.reference(want_cache, **feats)
        got = batch.triton(cache=got_cache, **feats)
        err = rel_err(got, want)
        if got[-5:].abs().max() != 0 or not torch.equal(got_cache, want_cache):
            err = float("inf")  # padding rows must be zero; the new k/v where the reference writes them
        # flash-decoding regardless of the shape heuristic; both ways of walking the new keys
        for launch in (AttentionLaunch(16, 32, 3, decode=True), AttentionLaunch(16, 32, 16, decode=True),
                       AttentionLaunch(32, 32, 3)):
            err = max(err, rel_err(batch.triton(launch, **feats), want))
        report.add(Row(f"check mixed {name}", err, note="mixed step, padding, cache; default + 3/16 splits"))


def check_split_merge_replays(report: Report, replays: int = 20) -> None:
    """Flash-decoding splits merged in the kernel, replayed from a CUDA graph: the last split of each
    tile resets its counter, so every replay must merge right (a leftover count would skip a merge)."""
    batch = paged_batch([(c, 1) for c in (4095, 300, 17, 0, 1000, 64, 2047, 511)] * 8)
    want = batch.reference()
    launch = AttentionLaunch(16, 32, 16, decode=True)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        batch.triton(launch)  # compile and allocate the counters outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = batch.triton(launch)
    err = 0.0
    for _ in range(replays):
        out.zero_()
        graph.replay()
        torch.cuda.synchronize()
        err = max(err, rel_err(out, want))
    report.add(Row("check split merge, graph replays", err, note=f"64 decodes, 16 splits, {replays} replays"))


def run_all(flashinfer: bool = False) -> Report:
    torch.manual_seed(0)
    props = torch.cuda.get_device_properties(DEV)
    print(f"{props.name}, {props.multi_processor_count} SMs; torch {torch.__version__}, triton {triton.__version__}")
    report = Report()
    for bench in (bench_norms, bench_act_mul, bench_argmax, bench_rope, check_attention_features,
                  check_split_merge_replays):
        bench(report)
    bench_attention(report, flashinfer)
    bench_rope_attention(report)
    return report


def add_options(group) -> None:
    group.add_argument("--flashinfer", action="store_true",
                       help="also time the FlashInfer backend (minutes of JIT)")


def table_rows(args, header) -> Iterator[TableRow]:
    yield from suite_rows(run_all(args.flashinfer), header, "kernels")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--flashinfer", action="store_true", help="also time the FlashInfer backend")
    report = run_all(parser.parse_args().flashinfer)
    print(report.table())
    failed = [r.name for r in report.rows if not r.ok]
    print(f"checks: {len(report.rows) - len(failed)} ok, {len(failed)} failed {failed if failed else ''}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
