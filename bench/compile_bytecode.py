"""Compile the environment's Python sources to bytecode, as ``pip install`` does at install time.

    python bench/compile_bytecode.py              # every directory on sys.path (stdlib included)
    python bench/compile_bytecode.py torch triton  # the named packages only

The device image's environment was installed without bytecode (``uv``'s default), so the first process
of a fresh machine compiles every module it imports (~7 s of a cold start in the fourteenth session's
py-spy profile). Run this before ``cold_start.py`` to measure the cold start of a ``pip``-installed
environment. With ``PYTHONPYCACHEPREFIX`` set (for a read-only site-packages; the cold start's child
inherits it) Python reads bytecode only under that prefix, so compile everything there, not a few
packages. Prints the seconds this took, which a real install pays once.
"""

from __future__ import annotations

import compileall
import importlib.util
import os
import sys
import time


def package_dir(name: str) -> str | None:
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        return None
    return list(spec.submodule_search_locations)[0]


def targets(names: list[str]) -> list[tuple[str, str]]:
    """(label, directory) pairs: the named packages', or every existing directory on sys.path."""
    if not names:
        return [(path, path) for path in sys.path if path and os.path.isdir(path)]
    found = [(name, package_dir(name)) for name in names]
    for name, path in found:
        if path is None:
            print(f"{name}: not installed, skipped")
    return [(name, path) for name, path in found if path is not None]


def main() -> None:
    start = time.perf_counter()
    dirs = targets(sys.argv[1:])
    for label, path in dirs:
        began = time.perf_counter()
        ok = compileall.compile_dir(path, quiet=2, workers=os.cpu_count() or 1)
        note = "" if ok else " (some files are not valid Python, e.g. test fixtures)"
        print(f"{label}: {time.perf_counter() - began:.1f} s{note}")
    print(f"bytecode of {len(dirs)} directories in {time.perf_counter() - start:.1f} s "
          f"(PYTHONPYCACHEPREFIX={os.environ.get('PYTHONPYCACHEPREFIX', '')})")


if __name__ == "__main__":
    main()
