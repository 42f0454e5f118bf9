"""Latency statistics shared by the offline and the serving benchmarks."""

from __future__ import annotations

from dataclasses import dataclass

PERCENTILES = (50, 90, 99)


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0-100), linear interpolation between closest ranks; NaN if empty."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low = int(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


@dataclass(frozen=True)
class Distribution:
    """Mean and percentiles of one latency, in milliseconds."""

    name: str
    mean_ms: float
    p50_ms: float
    p90_ms: float
    p99_ms: float
    count: int

    @classmethod
    def of(cls, name: str, seconds: list[float]) -> "Distribution":
        ms = [1000 * s for s in seconds]
        mean = sum(ms) / len(ms) if ms else float("nan")
        p50, p90, p99 = (percentile(ms, q) for q in PERCENTILES)
        return cls(name, mean, p50, p90, p99, len(ms))

    def row(self) -> str:
        return f"{self.name:<6}{self.mean_ms:>10.2f}{self.p50_ms:>10.2f}{self.p90_ms:>10.2f}{self.p99_ms:>10.2f}"


def latency_table(distributions: list[Distribution]) -> str:
    header = f"{'ms':<6}{'mean':>10}{'p50':>10}{'p90':>10}{'p99':>10}"
    return "\n".join([header] + [d.row() for d in distributions])
