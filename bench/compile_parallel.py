"""Serial vs thread-pool (vs process-pool) compile of the Triton kernels the 8B shape's warm-up
compiles, without a GPU.

A stand-in Triton driver reports an sm_90 device, so the warm-up's own launch code runs on CPU
tensors through ``autodeploy.kernels.precompile``: every attention launch variant the engine's
limits allow (``attention_warmup.warm_up_launches``, PDL on as on the H200) and the norm /
activation kernels of its eager steps are recorded (not launched), then compiled for real, once
serially and once on a thread pool, each into a fresh Triton cache.

``--processes N`` adds a third way, an experiment for the warm-up (Triton holds the GIL in its
Python code generation, ~14% of a compile, which bounds what threads gain on many cores): N worker
processes (the runtime's ``compile_workers``, ``autodeploy.kernels.compile_workers``) compile the
recorded specializations into the shared on-disk Triton cache, then this process loads every kernel
from that cache. Worker start-up is timed apart: the runtime starts the pool before ``torch.export``.

    python bench/compile_parallel.py --threads 8,16 [--processes 16] [--no-serial]   # times, speed-ups
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

os.environ["TRITON_INTERPRET"] = "0"  # real JIT functions, not the interpreter's
import kernels_only  # noqa: E402,F401  (autodeploy.kernels without transformers; this folder)

import torch
import triton
from triton.backends.compiler import GPUTarget

from autodeploy.kernels import activation, attention_config, norm, pdl
from autodeploy.kernels.attention_warmup import warm_up_launches
from autodeploy.kernels.compile_workers import CompileOnlyDriver, CompileWorkers
from autodeploy.kernels.precompile import KernelSpec, compile_specs, recording_compiles


SM90 = GPUTarget("cuda", 90, 32)


def record_8b_warm_up(max_batch: int, max_tokens: int, max_blocks: int) -> list[KernelSpec]:
    """The kernels the warm-up of Llama-3.1-8B (32/8 heads, head 128, bf16, RoPE folded) compiles."""
    per_sm = attention_config.DECODE_PROGRAMS_PER_SM, attention_config.PREFILL_PROGRAMS_PER_SM
    attention_config._target_programs = lambda decode, device: int(per_sm[0 if decode else 1] * 132)  # H200 SMs
    pdl.enabled = lambda device: True
    cache = torch.zeros(4, 2, 16, 8, 128, dtype=torch.bfloat16)
    with recording_compiles() as specs:
        warm_up_launches(cache, 32, torch.bfloat16, 128 ** -0.5, None, None, None, max_batch, max_tokens, max_blocks,
                         rope=(128, torch.bfloat16, False))
        for tokens in (17, 256):  # one token count divisible by 16, one not
            x, weight = torch.zeros(tokens, 4096, dtype=torch.bfloat16), torch.ones(4096, dtype=torch.bfloat16)
            norm.rms_norm(x, weight, 1e-5)
            norm.add_rms_norm(x, x, weight, 1e-5)
            gate_up = torch.zeros(tokens, 2 * 14336, dtype=torch.bfloat16)
            activation.act_mul(gate_up[:, :14336], gate_up[:, 14336:])
    return specs


def _fresh_caches(specs: list[KernelSpec]) -> None:
    """A new, empty on-disk Triton cache, and empty in-memory caches of the specs' kernels."""
    os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="triton-cache-")
    for spec in specs:
        spec.kernel.device_caches.clear()


def timed_compile(specs: list[KernelSpec], threads: int) -> float:
    """Seconds to compile every spec into a fresh Triton cache (and fresh JIT caches)."""
    _fresh_caches(specs)
    start = time.perf_counter()
    compile_specs(specs, threads)
    return time.perf_counter() - start


def timed_process_compile(specs: list[KernelSpec], processes: int) -> tuple[float, float, float]:
    """(pool start-up s, compile s in the pool, load s here from the disk cache), into a fresh cache:
    the runtime's ``compile_workers`` path (``autodeploy.kernels.compile_workers``)."""
    _fresh_caches(specs)
    start = time.perf_counter()
    workers = CompileWorkers(processes, SM90)
    workers.wait_until_started()
    started = time.perf_counter()
    workers.warm(specs)
    compiled = time.perf_counter()
    workers.close()
    compile_specs(specs, 1)  # every one a disk-cache hit
    return started - start, compiled - started, time.perf_counter() - compiled


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--threads", default="8", help="comma-separated thread counts to time")
    parser.add_argument("--no-serial", action="store_true", help="skip the serial compile (no speed-ups)")
    parser.add_argument("--processes", type=int, default=0, help="also compile on this many worker processes")
    parser.add_argument("--max-batch", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=8192)
    parser.add_argument("--max-blocks", type=int, default=256, help="max_seq_len / tokens_per_block")
    args = parser.parse_args()
    triton.runtime.driver.set_active(CompileOnlyDriver(SM90))
    specs = record_8b_warm_up(args.max_batch, args.max_tokens, args.max_blocks)
    names = sorted({spec.kernel.fn.__name__ for spec in specs})
    print(f"triton {triton.__version__}, {os.cpu_count()} CPUs: {len(specs)} kernels ({', '.join(names)})")
    serial = None if args.no_serial else timed_compile(specs, 1)
    if serial:
        print(f"serial:       {serial:6.1f} s", flush=True)
    if args.processes:
        startup, pooled, loaded = timed_process_compile(specs, args.processes)
        total = pooled + loaded
        gain = f"   speed-up {serial / total:.2f}x" if serial else ""
        print(f"{args.processes} processes:  {total:6.1f} s{gain} (compile {pooled:.1f} s + load from the "
              f"disk cache {loaded:.1f} s; the pool's start-up, {startup:.1f} s, apart)", flush=True)
    for threads in (int(t) for t in args.threads.split(",")):
        parallel = timed_compile(specs, threads)
        gain = f"   speed-up {serial / parallel:.2f}x" if serial else ""
        print(f"{threads} threads:    {parallel:6.1f} s{gain}", flush=True)


if __name__ == "__main__":
    main()
