"""The serving section's verdicts (issue 36's done-when) and its own table, from the runs' results.

A :class:`Run` is one load against a server (``autodeploy bench serve``'s result, the compiles the
server counted after ready during it); :class:`EngineSteps` the engine's own decode steps measured in
the same run. :func:`check_rows` turns them into ``passed`` rows, :func:`done_when_table` prints the
table of the issue: every run with its output tok/s against the engine's batch decode, TTFT and ITL
percentiles, and the compiles after ready.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from table import TableRow

THROUGHPUT_SHARE = 0.85  # of the engine's own decode at the largest batch
TTFT_P99_MS = 500.0  # at the largest concurrency
ITL_P99_STEPS = 3.0  # ITL p99 in bare decode steps at the largest batch
RUN_TO_RUN = 0.10  # first run vs second, and after history vs fresh
TTFT_P99_C1_MS = 100.0
TPOT_C1_SHARE = 0.05  # concurrency 1: TPOT within this of the bare batch-1 step


@dataclass
class Run:
    server: str  # "fresh" or "history"
    name: str  # e.g. "c64 #1", "poisson 80%", "1000/200 c64"
    concurrency: int | None
    result: object  # bench_serving.ServingResult
    compiles_after_ready: int = 0
    text_prompts: bool = False
    context: int = 0  # the requests' mean context (input + output / 2): the decode floor's


@dataclass
class EngineSteps:
    """Decode steps of the compiled model measured in this process: batch -> (bare step ms, engine step ms)."""

    ms: dict[int, tuple[float, float]] = field(default_factory=dict)

    def engine_tok_s(self, batch: int) -> float:
        return batch * 1e3 / self.ms[batch][1]

    def bare_ms(self, batch: int) -> float:
        return self.ms[batch][0]


def find(runs: list[Run], server: str, name: str) -> Run | None:
    return next((r for r in runs if r.server == server and r.name == name), None)


def _check(workload: str, what: str, value: float, bound: float, passed: bool) -> TableRow:
    return TableRow("serving", workload, "check: " + what, None, note=f"{value:,.1f} against {bound:,.1f}",
                    passed=passed, metrics={"value": value, "bound": bound})


def check_rows(runs: list[Run], steps: EngineSteps, concurrencies: list[int], shape: str) -> list[TableRow]:
    """The done-when criteria that these runs measured (a run left out of a reduced plan: its check too)."""
    top = max(concurrencies)
    after = f"after {', '.join(f'c{c}' for c in concurrencies if c != top)}"
    rows = []
    history = find(runs, "history", f"c{top} #1")
    if history is not None and top in steps.ms:
        r, workload = history.result, f"{shape} c{top} {after}"
        rows.append(_check(workload, f">= {THROUGHPUT_SHARE:.0%} of engine b{top} tok/s", r.output_throughput,
                           THROUGHPUT_SHARE * steps.engine_tok_s(top),
                           r.output_throughput >= THROUGHPUT_SHARE * steps.engine_tok_s(top)))
        rows.append(_check(workload, "TTFT p99 ms", r.ttft.p99_ms, TTFT_P99_MS, r.ttft.p99_ms <= TTFT_P99_MS))
        bound = ITL_P99_STEPS * steps.bare_ms(top)
        rows.append(_check(workload, f"ITL p99 ms <= {ITL_P99_STEPS:.0f} bare steps", r.itl.p99_ms, bound,
                           r.itl.p99_ms <= bound))
    for server in ("fresh", "history"):
        first, second = find(runs, server, f"c{top} #1"), find(runs, server, f"c{top} #2")
        if first is not None and second is not None:
            rows.append(_within(f"{shape} c{top} {server} server", "run 1 within 10% of run 2", first, second))
    fresh = find(runs, "fresh", f"c{top} #2")
    if history is not None and fresh is not None:
        rows.append(_within(f"{shape} c{top}", f"{after} within 10% of fresh", history, fresh))
    c1 = find(runs, "history", "c1 #1")
    if c1 is not None:
        rows.append(_check(f"{shape} c1 from the first request", "TTFT p99 ms", c1.result.ttft.p99_ms,
                           TTFT_P99_C1_MS, c1.result.ttft.p99_ms <= TTFT_P99_C1_MS))
        if 1 in steps.ms:
            bound = (1 + TPOT_C1_SHARE) * steps.bare_ms(1)
            rows.append(_check(f"{shape} c1", "TPOT p50 ms within 5% of the bare step", c1.result.tpot.p50_ms,
                               bound, c1.result.tpot.p50_ms <= bound))
    compiles = sum(r.compiles_after_ready for r in runs)
    rows.append(_check(f"{shape} every run", "compiles after ready", compiles, 0, compiles == 0))
    return rows


def _within(workload: str, what: str, run: Run, reference: Run) -> TableRow:
    value, bound = run.result.output_throughput, (1 - RUN_TO_RUN) * reference.result.output_throughput
    return _check(workload, f"{what} (tok/s)", value, bound, value >= bound)


def done_when_table(runs: list[Run], steps: EngineSteps, top: int, extra: list[str] = ()) -> str:
    """The issue's table: one line per run, then the engine's own steps and any hook's lines."""
    engine = steps.engine_tok_s(top) if top in steps.ms else None
    lines = [f"{'server':<8}{'run':<24}{'prompts':<8}{'done':>5}{'out tok/s':>11}{'% engine':>9}"
             f"{'TTFT p50/p90/p99 ms':>22}{'ITL p50/p99 ms':>16}{'TPOT p50':>9}{'prompt':>7}{'compiles':>9}"]
    for run in runs:
        r = run.result
        share = f"{r.output_throughput / engine:.0%}" if engine else "-"
        ttft = f"{r.ttft.p50_ms:.0f}/{r.ttft.p90_ms:.0f}/{r.ttft.p99_ms:.0f}"
        lines.append(f"{run.server:<8}{run.name:<24}{'text' if run.text_prompts else 'ids':<8}{r.completed:>5}"
                     f"{r.output_throughput:>11,.0f}{share:>9}{ttft:>22}{f'{r.itl.p50_ms:.1f}/{r.itl.p99_ms:.1f}':>16}"
                     f"{r.tpot.p50_ms:>9.2f}{r.mean_prompt_tokens:>7.0f}{run.compiles_after_ready:>9}"
                     + (f"  {r.failed} FAILED: {r.first_error}" if r.failed else ""))
    for batch, (bare, engine_ms) in sorted(steps.ms.items()):
        lines.append(f"engine  batch-{batch} decode: bare step {bare:.2f} ms, engine step {engine_ms:.2f} ms = "
                     f"{steps.engine_tok_s(batch):,.0f} tok/s")
    return "\n".join([*lines, *extra])
