"""Decode attention sweeps and a per-program timeline, on the GPU (what tuned ``AttentionLaunch.choose``
and explained where a decode grid's time goes; the kernels and batches of ``bench/kernel_bench.py``):

    PYTHONPATH=bench python bench/probes/attention_sweeps.py --sweep 1x4096,64x512 --context-sweep 480x192

- ``sweep_decode`` (``--sweep``): block sizes, warps, stages, splits, the first-block
  preload, for batch x context cases;
- ``sweep_context`` (``--context-sweep``): the engine's kernel (RoPE folded in) by context, key-block
  width, register cap and preload;
- ``sweep_layout`` (``--layout-sweep``): token-major against head-major KV pages;
- ``trace_attention`` (``--trace-attention``): each program's events (``kernels/trace.py``) in a full grid.
"""

from __future__ import annotations

import argparse
from dataclasses import replace

import torch

from gpu_harness import DEV, Report, Row, rel_err, sets_for, timed  # (bench/)
from kernel_bench import D, HKV, HQ, PAGE, attention_cost, paged_batch, rotary_rows  # (bench/)

from autodeploy.kernels import paged_attention as pa
from autodeploy.kernels.attention_config import AttentionLaunch
from autodeploy.kernels.paged_attention import paged_attention_fwd


def _cases(cases: str) -> list[tuple[int, int]]:
    """(batch, context) pairs of a "BxCTX,BxCTX" option."""
    return [tuple(int(v) for v in case.split("x")) for case in cases.split(",")]


def sweep_decode(report: Report, cases: str = "1x4096,8x4096,64x512,64x4096") -> None:
    """Decode launch configurations and split counts, to tune AttentionLaunch.choose with measurements;
    ``cases``: batch x context pairs."""
    for b, c in _cases(cases):
        seqs = [(c - 1, 1)] * b
        nbytes, _ = attention_cost(seqs)
        batches = [paged_batch(seqs) for _ in range(sets_for(nbytes, cap=16))]
        base = AttentionLaunch.choose(b, b, HQ, HKV, D, c, DEV)
        configs = [replace(base, block_n=n, num_warps=w, num_stages=st)
                   for n in (16, 32, 64, 128) for w, st in ((4, 2), (4, 3), (4, 4), (8, 3))]
        configs += [replace(base, num_splits=sp) for sp in (1, 2, 4, 8, 16, 32) if sp != base.num_splits]
        configs += [replace(base, preload_kv=True)] if not base.preload_kv else []
        for launch in configs:
            err = rel_err(batches[0].triton(launch), batches[0].reference())
            row = Row(f"sweep b={b} ctx={c} n={launch.block_n} w={launch.num_warps} s={launch.num_stages}"
                      f"{' preload' if launch.preload_kv else ''}", err,
                      note=f"splits {launch.num_splits} (default {base.block_n}/{base.num_warps}/"
                           f"{base.num_stages}, {base.num_splits} splits)")
            # timed() rotates through as many input sets as L2 calls for; small cases reuse these
            report.add(timed(row, lambda i: lambda: batches[i % len(batches)].triton(launch), None, nbytes))
        del batches


def sweep_context(report: Report, cases: str, caps: tuple[int, ...] = (128, 96)) -> None:
    """Decode with RoPE folded in (the engine's kernel) at ``cases`` (batch x context, one new token
    each), default launch at each register cap of ``rope_decode_tuning`` (128: four programs per SM,
    96: five), with 32-key blocks, and with the first key block preloaded before the PDL wait
    (``AttentionLaunch.preload_kv``, on by default only where the grid leaves SMs idle): how the cost
    follows the key-block count, occupancy, and the prologue's round trips."""
    for b, c in _cases(cases):
        seqs = [(c - 1, 1)] * b
        nbytes = attention_cost(seqs)[0] + 2 * b * D * 2  # + the cos/sin rows
        batches = [paged_batch(seqs) for _ in range(sets_for(nbytes, cap=16))]
        cos, sin = rotary_rows(seqs)
        base = AttentionLaunch.choose(b, b, HQ, HKV, D, batches[0].block_table.shape[1] * PAGE, DEV)
        want = batches[0].reference(batches[0].cache.clone(), rope_cos=cos, rope_sin=sin)
        default_cap = pa.ROPE_DECODE_MAX_REGISTERS
        try:
            widths = sorted({base.block_n, 32}, reverse=True)
            preloads = sorted({base.preload_kv, True})
            for block_n, cap, preload in ((n, cap, p) for n in widths for cap in caps for p in preloads):
                pa.ROPE_DECODE_MAX_REGISTERS = cap  # read by rope_decode_tuning at each launch
                launch = replace(base, block_n=block_n, preload_kv=preload)
                got = batches[0].triton(launch, cache=batches[0].cache.clone(), rope_cos=cos, rope_sin=sin)
                label = f"rope b={b} ctx={c} keys/block={block_n} maxnreg={cap}"
                label += " preload" if preload else ""
                row = Row(label, rel_err(got, want),
                          note=f"splits {launch.num_splits}, {-(-(c - 1) // block_n)} blocks of cached keys")
                def call(i, launch=launch):
                    return lambda: batches[i % len(batches)].triton(launch, rope_cos=cos, rope_sin=sin)

                report.add(timed(row, call, None, nbytes))
        finally:
            pa.ROPE_DECODE_MAX_REGISTERS = default_cap
        del batches


def sweep_layout(report: Report, cases: str) -> None:
    """Decode with RoPE folded in (the engine's kernel, default launch) on the pool's token-major pages
    ([block, 2, token, head, dim]: a head's page is PAGE rows of 256 B, 2 KB apart) against head-major
    pages (one contiguous 4 KB run per head and page), same shuffled page order and values layout-wise."""
    for b, c in _cases(cases):
        seqs = [(c - 1, 1)] * b
        nbytes = attention_cost(seqs)[0] + 2 * b * D * 2
        cos, sin = rotary_rows(seqs)
        for head_major in (False, True):
            torch.manual_seed(b * 100_000 + c)
            batches = [paged_batch(seqs, head_major=head_major) for _ in range(sets_for(nbytes, cap=16))]
            first = batches[0]
            want_cache, got_cache = first.cache.clone(), first.cache.clone()
            err = rel_err(first.triton(cache=got_cache, rope_cos=cos, rope_sin=sin),
                          first.reference(want_cache, rope_cos=cos, rope_sin=sin))
            if not torch.equal(got_cache, want_cache):
                err = float("inf")
            launch = AttentionLaunch.choose(b, b, HQ, HKV, D, first.block_table.shape[1] * PAGE, DEV)
            row = Row(f"layout {'HND' if head_major else 'NHD'} b={b} ctx={c}", err,
                      note=f"tile {launch.block_m}x{launch.block_n}, splits {launch.num_splits}")
            def call(i):
                return lambda: batches[i % len(batches)].triton(rope_cos=cos, rope_sin=sin)

            report.add(timed(row, call, None, nbytes))
            del batches


TRACE_STEPS = ((1, "start"), (2, "after wait"), (6, "q loaded"), (3, "attended"), (5, "stored"))


def trace_attention(report_lines: list[str], cases: str) -> None:
    """Where a full decode grid's microseconds go: the engine's kernel (RoPE folded in, default launch)
    replayed in a CUDA graph between two untraced launches of itself (PDL as in a step), its programs'
    events (``kernels/trace.py``) in us from the first program's start: quantiles over programs, and
    each program's own intervals."""
    from autodeploy.kernels import trace

    for b, c in _cases(cases):
        seqs = [(c - 1, 1)] * b
        batches = [paged_batch(seqs) for _ in range(3)]
        cos, sin = rotary_rows(seqs)
        launch = AttentionLaunch.choose(b, b, HQ, HKV, D, batches[0].block_table.shape[1] * PAGE, DEV)
        programs = (-(-batches[0].q.shape[0] // launch.block_q(HQ // HKV)) + b) * HKV * launch.num_splits
        buf = trace.buffer(programs, torch.device(DEV))

        def run():
            batches[0].triton(launch, rope_cos=cos, rope_sin=sin)
            mid = batches[1]
            paged_attention_fwd(mid.q, mid.k, mid.v, mid.cache, mid.cu_seqlens, mid.context_lens,
                                mid.block_table, mid.slots, D ** -0.5, rope_cos=cos, rope_sin=sin,
                                launch=launch, trace_buffer=buf)
            batches[2].triton(launch, rope_cos=cos, rope_sin=sin)

        run()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            run()
        rows = []
        for _ in range(5):
            buf.fill_(trace.UNSET)
            graph.replay()
            torch.cuda.synchronize()
            rows.append(buf.clone())
        tile = f"tile {launch.block_m}x{launch.block_n}, splits {launch.num_splits}"
        report_lines.append(f"trace b={b} ctx={c}: {programs} programs, {tile} (us; quantiles 0/10/50/90/100 "
                            "over programs, median replay)")
        stats = [_trace_stats(r) for r in rows]
        for key in stats[0]:
            values = torch.tensor([s[key] for s in stats]).median(dim=0).values
            report_lines.append(f"    {key:<22}" + " ".join(f"{v:7.2f}" for v in values.tolist()))
        del batches


def _trace_stats(buf: torch.Tensor) -> dict[str, list[float]]:
    """Quantiles (us) of each event from the first start, and of each program's intervals."""
    from autodeploy.kernels import trace

    done = buf[:, 5] != trace.UNSET
    t = buf[done].double().cpu()
    t0 = t[:, 1].min()
    qs = torch.tensor([0.0, 0.1, 0.5, 0.9, 1.0], dtype=torch.float64)
    out = {f"at {name}": torch.quantile((t[:, e] - t0) / 1e3, qs).tolist() for e, name in TRACE_STEPS}
    for (e0, n0), (e1, n1) in zip(TRACE_STEPS, TRACE_STEPS[1:]):
        out[f"{n0} -> {n1}"] = torch.quantile((t[:, e1] - t[:, e0]) / 1e3, qs).tolist()
    out["start -> stored"] = torch.quantile((t[:, 5] - t[:, 1]) / 1e3, qs).tolist()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name in ("sweep", "context-sweep", "layout-sweep", "trace-attention"):
        parser.add_argument(f"--{name}", default=None, metavar="BxCTX,...")
    args = parser.parse_args()
    if args.trace_attention:
        lines: list[str] = []
        trace_attention(lines, args.trace_attention)
        print("\n".join(lines))
    report = Report()
    for cases, sweep in ((args.layout_sweep, sweep_layout), (args.sweep, sweep_decode),
                         (args.context_sweep, sweep_context)):
        if cases:
            sweep(report, cases)
    print(report.table())


if __name__ == "__main__":
    main()
