"""The kernel benchmarks' harness (the kernels section and the probes): result rows and their table, relative
error, CUDA-graph and eager timing over rotating input sets, and ``suite_rows``: a report as rows of the suite's
table. Needs torch + triton, and a CUDA device to time.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
import triton
import triton.testing
from table import Header, TableRow

COPY_TBPS = 4.18
BF16_TOL = 1e-2
DEV = torch.device("cuda")


@dataclass
class Row:
    name: str
    err: float | None = None
    graph_us: float | None = None
    eager_us: float | None = None
    torch_us: float | None = None
    bytes: float = 0.0
    flops: float = 0.0
    note: str = ""

    @property
    def ok(self) -> bool:
        return self.err is None or (math.isfinite(self.err) and self.err < BF16_TOL)


@dataclass
class Report:
    rows: list[Row] = field(default_factory=list)

    def add(self, row: Row) -> None:
        self.rows.append(row)
        print(f"  done: {row.name}", flush=True)

    def table(self) -> str:
        fmt = lambda v, spec: "-" if v is None or v == 0 else format(v, spec)  # noqa: E731
        head = (f"{'case':<40}{'check':>13}{'graph us':>10}{'eager us':>10}{'torch us':>10}{'MB':>9}"
                f"{'TB/s':>7}{'%copy':>7}{'TFLOP/s':>9}  note")
        lines = [head, "-" * len(head)]
        for r in self.rows:
            check = "-" if r.err is None else f"{r.err:.1e} {'ok' if r.ok else 'FAIL'}"
            tbps = r.bytes / (r.graph_us * 1e-6) / 1e12 if r.graph_us and r.bytes else None
            tflops = r.flops / (r.graph_us * 1e-6) / 1e12 if r.graph_us and r.flops else None
            lines.append(
                f"{r.name:<40}{check:>13}{fmt(r.graph_us, '.1f'):>10}{fmt(r.eager_us, '.1f'):>10}"
                f"{fmt(r.torch_us, '.1f'):>10}{fmt(r.bytes / 1e6, '.2f'):>9}{fmt(tbps, '.2f'):>7}"
                f"{fmt(tbps and 100 * tbps / COPY_TBPS, '.0f'):>7}{fmt(tflops, '.0f'):>9}  {r.note}")
        return "\n".join(lines)


def suite_rows(report: Report, header: Header, section: str, impl: str = "triton") -> Iterator[TableRow]:
    """Each row as the suite's: the graph time against the longer of its bytes at the copy bandwidth and its
    FLOPs at the bf16 GEMM rate; the check's verdict; the torch and eager times in the note."""
    for r in report.rows:
        floor = max(r.bytes / header.bandwidth, r.flops / header.gemm_flops) if r.graph_us else None
        notes = [f"rel err {r.err:.1e}" if r.err is not None else "",
                 f"torch {r.torch_us:.1f} us" if r.torch_us else "",
                 f"eager {r.eager_us:.1f} us" if r.eager_us else "", r.note]
        yield TableRow(section, r.name, impl, r.graph_us and r.graph_us * 1e-6, floor_s=floor,
                       note="; ".join(n for n in notes if n), passed=None if r.err is None else r.ok)


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.double(), want.double()
    return float((got - want).norm() / want.norm().clamp_min(1e-30))


def sets_for(bytes_per_call: float, cap: int = 64) -> int:
    """Input sets to rotate through so that one graph replay streams more than 4x the L2 cache."""
    l2 = getattr(torch.cuda.get_device_properties(DEV), "L2_cache_size", 50 << 20)
    return max(1, min(cap, math.ceil(4 * l2 / max(bytes_per_call, 1))))


def graph_us(calls: list, reps: int = 30) -> float:
    """Median time per call of a CUDA graph running every callable of ``calls`` once."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for call in calls:  # compile and warm up outside the capture
            call()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / len(calls))
    return statistics.median(times)


def eager_us(call) -> float:
    return triton.testing.do_bench(call, warmup=10, rep=40, return_mode="median") * 1e3


def timed(row: Row, make_call, make_ref, bytes_per_call: float) -> Row:
    """Time ``make_call(i)`` (i-th input set) in the graph and eagerly; the reference ``make_ref`` in the graph."""
    count = sets_for(bytes_per_call)
    calls = [make_call(i) for i in range(count)]
    row.graph_us, row.eager_us, row.bytes = graph_us(calls), eager_us(calls[0]), bytes_per_call
    if make_ref is not None:
        row.torch_us = graph_us([make_ref(i) for i in range(count)])
    return row
