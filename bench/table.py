"""The suite's rows, the run's header, the weight formats, and the one table they print as.

Every section of ``full_table.py`` yields ``TableRow``s; ``Header`` is what one run measured before them
(device, versions, the copy bandwidth and bf16 GEMM rate its floors come from). A weight format adds one
entry to ``WEIGHT_FORMATS``: the bytes a weight streams (decode floors) and the compile settings that
produce it; the HF peers always run bf16.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field


IMPLS = ("autodeploy", "hf_eager", "hf_static")  # --impls: autodeploy and its HF peers


@dataclass(frozen=True)
class WeightFormat:
    name: str
    bytes_per_weight: float  # of the decoder layers' linears, their scales included
    settings: dict = field(default_factory=dict)  # CompileConfig fields of autodeploy's rows
    head_bytes_per_weight: float = 2  # the LM head (online quantization leaves it bf16)


WEIGHT_FORMATS = {
    "bf16": WeightFormat("bf16", 2, {"dtype": "bfloat16"}),
    # online quantization of the random bf16 weights while they load (per-channel FP8, dynamic per-token activations)
    "fp8": WeightFormat("fp8", 1, {"dtype": "bfloat16", "quantization": "fp8"}),
    # e2m1 codes (half a byte) + one e4m3 scale per 16 weights
    "nvfp4": WeightFormat("nvfp4", 0.5 + 1 / 16, {"dtype": "bfloat16", "quantization": "nvfp4"}),
}


@dataclass(frozen=True)
class TableRow:
    section: str  # a key of full_table.SECTIONS
    workload: str  # e.g. "llama8b batch 64", "llama8b 128/128 x 512"
    impl: str
    seconds: float | None  # per step (decode), run (offline), to the first token (cold start); None: a check only
    tokens_per_s: float | None = None
    floor_s: float | None = None  # what the GPU cannot beat, from the header's rates
    note: str = ""
    weights: str = "bf16"
    passed: bool | None = None  # a check's verdict (serving: failed requests, done-when); None: a timing only
    metrics: dict = field(default_factory=dict)  # the section's own figures (serving: latency percentiles, ms)

    @property
    def roofline_share(self) -> float | None:
        return self.floor_s / self.seconds if self.floor_s and self.seconds else None


@dataclass(frozen=True)
class Header:
    date: str
    device: str
    torch: str
    triton: str
    transformers: str
    commit: str
    sections: str
    bandwidth: float  # bytes/s, device-to-device copy (read + write)
    gemm_flops: float  # bf16 FLOP/s of an 8192-cube matmul

    def line(self) -> str:
        return (f"{self.date} {self.device} | autodeploy {self.commit}, torch {self.torch}, triton {self.triton}, "
                f"transformers {self.transformers} | copy {self.bandwidth / 1e12:.2f} TB/s | bf16 GEMM "
                f"{self.gemm_flops / 1e12:.0f} TFLOP/s | sections {self.sections}")


def format_seconds(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    if seconds < 1e-3:
        return f"{seconds * 1e6:.1f} us"
    return f"{seconds * 1e3:.3f} ms" if seconds < 1 else f"{seconds:.2f} s"


def print_table(rows: list[TableRow], headers: list[Header]) -> None:
    """One table; a line per run the rows came from. A failed check says so first in its note."""
    print()
    for h in headers:
        print(h.line())
    print(f"{'workload':<38}{'weights':<8}{'impl':<26}{'time':>11}{'tok/s':>9}{'floor':>11}{'roofline':>9}  note")
    for r in rows:
        tokens = f"{r.tokens_per_s:.0f}" if r.tokens_per_s else "-"
        share = f"{r.roofline_share:.0%}" if r.roofline_share else "-"
        note = ("FAILED: " if r.passed is False else "") + r.note
        print(f"{r.workload:<38}{r.weights:<8}{r.impl:<26}{format_seconds(r.seconds):>11}{tokens:>9}"
              f"{format_seconds(r.floor_s):>11}{share:>9}  {note}")


def save(path: str, rows: list[TableRow], headers: list[Header]) -> None:
    with open(path, "w") as f:
        json.dump({"headers": [asdict(h) for h in headers], "rows": [asdict(r) for r in rows]}, f, indent=1)


def load(path: str) -> tuple[list[TableRow], list[Header]]:
    """Rows and headers of a saved run (or of a merge of several)."""
    with open(path) as f:
        data = json.load(f)
    return [TableRow(**row) for row in data["rows"]], [Header(**h) for h in data["headers"]]
