"""Every kernel variant compiles for sm_90 (GPU-only compile errors and spills, caught without a GPU)."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from autodeploy.kernels.paged_attention import FP8_DECODE_MAX_REGISTERS

TOOL = Path(__file__).resolve().parent / "compile_sm90.py"


@pytest.mark.slow
def test_all_kernels_compile_for_hopper_without_spills():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, str(TOOL)], capture_output=True, text=True, env=env, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr  # a variant failed to compile or spilled
    # A batch-1 decode (the 8B shape's 16 splits) merges its splits' partials with 16-byte loads and
    # spills nothing: with the partials' strides unspecialized it spilled 32 B, and the merge took ~4.5 us
    # after the last split's arrival on the H200 instead of ~1.3 (docs/perf.md, tenth session).
    variant = "attn rope decode b1 (32 keys, s16, PDL) "
    merge_row = next(line for line in run.stdout.splitlines() if line.startswith(variant))
    _, spill = (int(field) for field in merge_row[len(variant):].split()[:2])
    vector_loads = re.search(r"ld\.cg\.v4 x(\d+)", merge_row)
    assert spill == 0 and vector_loads and int(vector_loads.group(1)) >= 16, merge_row
    # the quantized linears: tensor cores in the GEMMs, 16-byte weight loads in the GEMVs
    rows = {line[:44].strip(): line for line in run.stdout.splitlines()}
    assert "wgmma" in rows["fp8_gemm 4096 rows block"] and "wgmma" in rows["nvfp4 weight-only 4096 rows"]
    assert "ld.v4" in rows["fp8_gemv 1 row(s)"] and "ld.v4" in rows["nvfp4_gemv 1 row(s)"]
    # the norm / activation folded into the FP8 one-row GEMV: 7 programs per SM or more (plain: 58 registers, 8)
    for step in ("norm", "add+norm", "gated silu"):
        line = rows[f"fp8_gemv {step} 1 row(s)"]
        assert int(line[44:].split()[0]) <= 72, line
        line = rows[f"nvfp4_gemv {step} 1 row(s)"]  # the word kernel's: 96 at most (64 plain)
        assert int(line[44:].split()[0]) <= 96, line
    # an FP8 pool's decode (no RoPE) as light as bf16's: four programs per SM (it took 255 registers, quantizing
    # the new keys 64 at a time), and e4m3 widened to fp16 (one instruction a pair), never on to bf16 (one more
    # conversion a value, at a quarter of the issue rate: 128 a thread per 64-key block)
    fp8_decodes = [line for name, line in rows.items() if name.startswith("attn fp8-kv decode")]
    assert len(fp8_decodes) == 3, fp8_decodes
    for line in fp8_decodes:
        assert int(line[44:].split()[0]) <= FP8_DECODE_MAX_REGISTERS, line
    assert not any("cvt.bf16.f16" in line for name, line in rows.items() if "fp8-kv" in name), run.stdout
