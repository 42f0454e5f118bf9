"""The suite's entry point: the chosen sections (``SECTIONS``: each a module of this folder with
``add_options(group)`` and ``table_rows(args, header)`` yielding ``table.TableRow``s), after a header that
measures the rates the floors come from; one table, and JSON saved after every row. ``bench/README.md`` says
what each section answers; ``bash bench/run.sh`` runs them all on a GPU machine.

    python bench/full_table.py --sections decode,kernels --json out/run.json
    python bench/full_table.py --merge out/decode.json out/offline.json --json out/table.json
    python bench/full_table.py --dry-run    # the plan and every option, without a GPU

Exit status 1 if a row failed a check (a serving run with failed requests, a done-when check, a kernel's).
"""

from __future__ import annotations

import argparse
import importlib
import os
import subprocess
import sys
import time
from pathlib import Path

from table import IMPLS, WEIGHT_FORMATS, Header, TableRow, load, print_table, save

SECTIONS = {  # name -> module of this folder; the order of a full run
    "decode": "decode_bench",
    "offline": "offline_bench",
    "serving": "serving_bench",
    "coldstart": "cold_start",
    "kernels": "kernel_bench",
    "structured": "structured_bench",
}


def commit() -> str:
    """The checkout's commit (``+dirty`` with local changes); where there is no git checkout (a copy of the
    working tree on a GPU machine), ``$BENCH_COMMIT`` as given, else ``unknown``."""
    def git(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(["git", *args], cwd=Path(__file__).parent, capture_output=True, text=True)

    try:
        rev, dirty = git("rev-parse", "--short", "HEAD"), git("status", "--porcelain", "--untracked-files=no")
    except OSError:  # no git on this machine
        rev = None
    if rev is None or rev.returncode:
        return os.environ.get("BENCH_COMMIT", "unknown")
    return rev.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")


def measure_header(sections: str) -> Header:
    import torch
    import transformers
    import triton
    from decode_bench import copy_bandwidth, gemm_rate

    return Header(date=time.strftime("%Y-%m-%d %H:%M"), device=torch.cuda.get_device_name(0),
                  torch=torch.__version__, triton=triton.__version__, transformers=transformers.__version__,
                  commit=commit(), sections=sections, bandwidth=copy_bandwidth(), gemm_flops=gemm_rate())


def run(args) -> tuple[list[TableRow], Header]:
    """Every row of ``args.sections``, written to ``args.json`` after each one (a run cut short keeps them)."""
    header = measure_header(args.sections)
    print(header.line(), flush=True)
    rows: list[TableRow] = []
    for section in args.sections.split(","):
        for row in importlib.import_module(SECTIONS[section]).table_rows(args, header):
            rows.append(row)
            print(row, flush=True)
            if args.json:
                save(args.json, rows, [header])
    return rows, header


def parser() -> tuple[argparse.ArgumentParser, dict]:
    """The suite's options, and each section's argument group (its ``add_options``)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sections", default=",".join(SECTIONS), help=f"some of {', '.join(SECTIONS)}")
    p.add_argument("--impls", default=",".join(IMPLS),
                   help="decode, offline and cold start: which to run (autodeploy, hf_eager, hf_static)")
    p.add_argument("--weights", default="bf16",
                   help=f"autodeploy's weight formats: some of {', '.join(WEIGHT_FORMATS)}")
    p.add_argument("--json", default=None, help="also write the rows here (after every row)")
    p.add_argument("--merge", nargs="+", default=None, metavar="JSON", help="print one table from these files")
    p.add_argument("--dry-run", action="store_true", help="print the plan and its options; measure nothing")
    groups = {name: p.add_argument_group(f"{name} ({module}.py)") for name, module in SECTIONS.items()}
    for name, module in SECTIONS.items():
        importlib.import_module(module).add_options(groups[name])
    return p, groups


def check_args(p: argparse.ArgumentParser, args) -> None:
    """Refuse unknown names before anything runs; parse the comma lists once."""
    for option, given, known in (("--sections", args.sections, SECTIONS),
                                 ("--impls", args.impls, IMPLS),
                                 ("--weights", args.weights, WEIGHT_FORMATS)):
        unknown = sorted(set(given.split(",")) - set(known))
        if unknown:
            p.error(f"unknown {option} {unknown}; expected some of {', '.join(known)}")
    args.impls = tuple(args.impls.split(","))
    args.weights = [WEIGHT_FORMATS[name] for name in args.weights.split(",")]


def dry_run(groups: dict, args) -> None:
    values = vars(args)
    for name in args.sections.split(","):
        group = groups[name]  # argparse keeps a group's options in _group_actions (no public accessor)
        print(f"{group.title}: " + ", ".join(f"{a.dest}={values[a.dest]}" for a in group._group_actions))
    weights = ", ".join(w.name for w in args.weights)
    print(f"impls {', '.join(args.impls)}; weights {weights}; json {args.json}; commit {commit()}")


def main() -> int:
    p, groups = parser()
    args = p.parse_args()
    if args.merge:
        loaded = [load(path) for path in args.merge]
        rows, headers = [r for part in loaded for r in part[0]], [h for part in loaded for h in part[1]]
        if args.json:
            save(args.json, rows, headers)
    else:
        check_args(p, args)
        if args.dry_run:
            dry_run(groups, args)
            return 0
        rows, header = run(args)
        headers = [header]
    print_table(rows, headers)
    return 1 if any(r.passed is False for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
