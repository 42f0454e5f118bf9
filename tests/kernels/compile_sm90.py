"""Compile every Triton kernel of autodeploy for sm_90 (H100/H200) on a machine without a GPU.

Catches what the CPU interpreter cannot: GPU-only compile errors (types of loop-carried values,
unsupported ops) and register spills, and shows what the compiler made of each variant: registers,
spill stack, shared memory, and whether the tensor cores (mma / wgmma) and asynchronous copies
(cp.async, TMA) are used. Arguments are specialised like the JIT does at run time: pointers and strides
divisible by 16. Needs only torch + triton (the wheel ships ptxas and cuobjdump).

A spill inside a loop fails the variant. ptxas also parks a few long-lived values (a predicate
needed only in the epilogue) in local memory to reach a lower register count, i.e. a higher
occupancy: such spills outside every loop cost a store and a load per program, and are listed as
``cold`` without failing.

    python tests/kernels/compile_sm90.py    # one table; exit status 1 if a variant fails or spills in a loop
    python tests/kernels/compile_sm90.py --sass DIR   # + each variant's SASS (addresses stripped) in DIR/<variant>.sass
    python tests/kernels/compile_sm90.py --only attn  # the variants whose name contains "attn"

CI runs it (``test_compile_sm90.py``, next to it). The variants are listed in ``sm90_variants.py``.

``--sass`` on two checkouts and ``diff -r`` shows whether a change left a variant's machine code as it
was (a new constexpr switch must not change the variants that leave it off).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
import types
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "0"  # real JIT functions, not the interpreter's
if "autodeploy" not in sys.modules:  # autodeploy.kernels alone: a bare package over the source tree (the
    _package = types.ModuleType("autodeploy")  # package's __init__ imports transformers, needless here)
    _package.__path__ = [str(Path(__file__).resolve().parents[2] / "autodeploy")]
    sys.modules["autodeploy"] = _package

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sm90_variants import variants  # noqa: E402  (the variants the runtime launches)

TARGET = GPUTarget("cuda", 90, 32)
CUOBJDUMP = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
FLOAT_ARGS = {"scale", "softcap", "eps", "k_scale", "v_scale", "out_factor"}
DIVISIBLE_INTS = {"n_cols", "N", "K", "row_bytes", "row_words"}  # hidden / intermediate sizes: multiples of 16 in real models


def _signature(kernel, pointers: dict[str, str], constexprs: dict) -> tuple[dict, dict]:
    """Triton's signature and the divisibility the JIT would find at run time: pointers, strides and
    hidden sizes divisible by 16, except the kernel's ``do_not_specialize`` arguments (the JIT leaves
    those unspecialized; assuming them divisible here once hid the 32 B spill and fewer vector loads
    of the batch-1 attention the GPU actually ran), and pointers the kernel marks
    ``do_not_specialize_on_alignment``. A host-side TMA descriptor is a "pointer" typed
    ``tensordesc<u8[16, 256]>`` (dtype, block shape), as the JIT types a ``TensorDescriptor`` argument."""
    sig, attrs = {}, {}
    named = lambda args: {kernel.arg_names[a] if isinstance(a, int) else a for a in args}  # noqa: E731
    unspecialized, unaligned = named(kernel.do_not_specialize), named(kernel.do_not_specialize_on_alignment)
    for index, name in enumerate(kernel.arg_names):
        if name in constexprs:
            sig[name] = "constexpr"
        elif name in pointers:
            sig[name] = pointers[name]
            # a host TMA descriptor is passed by value: the JIT specializes neither it nor its shape and strides
            if name not in unaligned and not pointers[name].startswith("tensordesc"):
                attrs[(index,)] = [["tt.divisibility", 16]]
        else:
            sig[name] = "fp32" if name in FLOAT_ARGS else "i32"
            if (name.startswith("stride") or name in DIVISIBLE_INTS) and name not in unspecialized:
                attrs[(index,)] = [["tt.divisibility", 16]]
    return sig, attrs


def _cuobjdump(cubin: bytes, flag: str) -> str:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as handle:
        handle.write(cubin)
        handle.flush()
        return subprocess.run([str(CUOBJDUMP), flag, handle.name], capture_output=True, text=True).stdout


def _resources(cubin: bytes) -> tuple[int, int]:
    """(registers per thread, stack bytes: spills) from cuobjdump."""
    out = _cuobjdump(cubin, "-res-usage")
    found = re.search(r"REG:(\d+) STACK:(\d+)", out)
    return (int(found.group(1)), int(found.group(2))) if found else (-1, -1)


def _sass(cubin: bytes) -> str:
    """The cubin's instructions, one per line, without their addresses."""
    sass = _cuobjdump(cubin, "-sass")
    return "\n".join(m.group(1).strip() for m in re.finditer(r"/\*[0-9a-f]{4,}\*/\s+([^;]*);", sass)) + "\n"


def _spills_in_loops(cubin: bytes) -> int:
    """Local-memory loads/stores (LDL/STL) inside a loop: between a backward branch and its target."""
    sass = _cuobjdump(cubin, "-sass")
    code = [(int(m.group(1), 16), m.group(2)) for m in re.finditer(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", sass)]
    branch = re.compile(r"\bBRA\s+(?:`\(\S+\)\s*)?0x([0-9a-f]+)")
    loops = [(int(m.group(1), 16), addr) for addr, text in code
             if (m := branch.search(text)) and int(m.group(1), 16) <= addr]
    return sum(1 for addr, text in code if re.search(r"\b(LDL|STL)\b", text)
               and any(lo <= addr <= hi for lo, hi in loops))


def _instructions(ptx: str) -> str:
    kinds = [("wgmma", r"wgmma\.mma_async"), ("mma", r"\bmma\.sync"), ("cp.async", r"cp\.async\.c[ag]"),
             ("tma", r"cp\.async\.bulk\.tensor"),  # (TMA: a descriptor's boxes into shared memory)
             ("ld.v4", r"ld\.global\S*\.v4"), ("st.v4", r"st\.global\S*\.v4"),
             ("ld.cg.v4", r"ld\.global\.cg\S*\.v4"),  # (.cg: the split merge's loads of partials)
             ("cvt.bf16.f16", r"cvt\.bf16\.f16")]  # (e4m3 -> fp16 -> bf16: one more conversion a value)
    found = [(name, len(re.findall(pattern, ptx))) for name, pattern in kinds]
    return " ".join(f"{name} x{count}" if name == "ld.cg.v4" else name for name, count in found if count)


def compile_variant(name, kernel, pointers, constexprs, warps=4, stages=2, options=None,
                    sass_dir: Path | None = None) -> tuple[str, bool]:
    """One table row, and whether the variant compiled without spilling registers inside a loop."""
    sig, attrs = _signature(kernel, pointers, constexprs)
    start = time.perf_counter()
    try:
        compiled = triton.compile(ASTSource(kernel, sig, constexprs=constexprs, attrs=attrs), target=TARGET,
                                  options={"num_warps": warps, "num_stages": stages, **(options or {})})
    except Exception as exc:  # report every failing variant, not only the first
        return f"{name:<44} FAILED: {type(exc).__name__}: {str(exc).splitlines()[0][:120]}", False
    seconds = time.perf_counter() - start
    if sass_dir is not None:
        (sass_dir / (re.sub(r"[^A-Za-z0-9]+", "_", name).strip("_") + ".sass")).write_text(_sass(compiled.asm["cubin"]))
    regs, spill = _resources(compiled.asm["cubin"])
    hot = _spills_in_loops(compiled.asm["cubin"]) if spill else 0
    kind = "" if not spill else f" ({hot} spill ops in loops)" if hot else " (cold)"
    row = (f"{name:<44} {regs:>4} {spill:>6} {compiled.metadata.shared:>8} "
           f"{warps:>3}/{stages:<2} {seconds:5.1f}s  {_instructions(compiled.asm['ptx'])}{kind}")
    return row, spill >= 0 and hot == 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sass", type=Path, default=None, metavar="DIR", help="write each variant's SASS here")
    parser.add_argument("--only", default="", metavar="TEXT", help="only the variants whose name contains TEXT")
    args = parser.parse_args()
    if args.sass is not None:
        args.sass.mkdir(parents=True, exist_ok=True)
    print(f"triton {triton.__version__}, target sm_90")
    print(f"{'variant':<44} {'regs':>4} {'spill':>6} {'smem B':>8} w/st  compile  instructions")
    ok = True
    for name, kernel, pointers, constexprs, *launch in variants():
        if args.only not in name:
            continue
        row, good = compile_variant(name, kernel, pointers, constexprs, *launch, sass_dir=args.sass)
        ok &= good
        print(row, flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
