"""Host and device time per step kind: prefill and mixed (prefill chunks + decodes) steps run eagerly
against the piecewise CUDA graphs (``autodeploy.piecewise``) and the whole-step graphs
(``autodeploy.mixed_graphs``), decode steps against the decode graphs too.

    PYTHONPATH=bench python bench/probes/mixed_steps.py --sizes 64,128,256,512,1024,2048   # GPU, 8B shape, < 2 min
    PYTHONPATH=bench python bench/probes/mixed_steps.py --shape tiny --device cpu          # the same code on the CPU

One model (random weights, decode graphs at batch 64, piecewise and whole-step graphs at the default token
buckets or ``--sizes``) runs every step kind through ``CompiledModel.__call__`` as the engine does (the
metadata build and copy included): ``eager`` (no graphs), ``piecewise`` (decode and whole-step graphs
off), ``whole step`` (decode graphs off, for a step a whole-step graph takes; its bucket column is
tokens x sequences) and, for a decode step, ``decode graph``. The first line repeats the pass table's
``compile_cuda_graphs`` detail: captures, seconds and the MiB each kind of graph added to the pool.
Columns, medians of ``--steps`` runs:

- ``host ms``: the host's time to issue the step, with the GPU held busy by a sleep kernel queued first,
  so that no launch waits for the device (the host's own cost: Python, dispatch, launches);
- ``device ms``: the device's time for the step so issued (all of it queued behind the sleep: the kernels
  back to back, no launch gaps; while a step issues fewer launches than the driver queues, ~1000);
- ``step ms``: a step as the engine sees it (synchronised, the sampled ids read back): about the larger
  of the two when the host cannot run ahead;
- ``Δ eager``: the largest logit difference from the eager graph on the same padded step (0: the same
  kernels on the same shapes; beyond ``--tolerance`` the script exits 1 after the table), and how many
  greedy tokens match the eager unpadded step's (piecewise and whole-step rows).

On the CPU the device columns are empty (the host computes).
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from dataclasses import dataclass

import torch

CONTEXT = 256  # cached tokens of each decoding sequence
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, vocab_size=256, max_position_embeddings=256)


@dataclass(frozen=True)
class StepKind:
    """``decodes`` sequences at ``CONTEXT`` cached tokens decoding one token, and prompt chunks of
    ``(tokens, cached)`` each."""

    name: str
    decodes: int
    prompts: tuple[tuple[int, int], ...] = ()

    @property
    def num_seqs(self) -> int:
        return self.decodes + len(self.prompts)

    @property
    def num_tokens(self) -> int:
        return self.decodes + sum(tokens for tokens, _ in self.prompts)


GPU_KINDS = (
    StepKind("decode 64", 64),
    StepKind("mixed 64 decodes + 1x64", 64, ((64, 0),)),
    StepKind("mixed 64 decodes + 1x100", 64, ((100, 0),)),
    StepKind("mixed 64 decodes + 1x448", 64, ((448, 0),)),
    StepKind("mixed 248 decodes + 2x128", 248, ((128, 0), (128, 0))),
    StepKind("mixed 64 decodes + 1x960 on 1024", 64, ((960, 1024),)),
    StepKind("prefill 1x2048", 0, ((2048, 0),)),
    StepKind("prefill 1x3072 (beyond buckets)", 0, ((3072, 0),)),
)
CPU_KINDS = (
    StepKind("decode 4", 4),
    StepKind("mixed 4 decodes + 1x12", 4, ((12, 0),)),
    StepKind("mixed 4 decodes + 1x9 on 8", 4, ((9, 8),)),
    StepKind("prefill 1x40 (beyond buckets)", 0, ((40, 0),)),
)
CPU_SIZES = [4, 16, 32]


def step_chunks(kind: StepKind, block_size: int, vocab: int) -> list:
    """The step's chunks: random token ids, every sequence in blocks of its own (block 0 is the captures')."""
    from autodeploy.kvcache.metadata import SequenceChunk

    gen = torch.Generator().manual_seed(0)
    seqs = [(1, CONTEXT)] * kind.decodes + list(kind.prompts)
    chunks, first = [], 1
    for tokens, cached in seqs:
        blocks = -(-(tokens + cached) // block_size)
        ids = tuple(torch.randint(3, vocab, (tokens,), generator=gen).tolist())
        chunks.append(SequenceChunk(ids, cached, tuple(range(first, first + blocks))))
        first += blocks
    return chunks


def blocks_needed(kinds, block_size: int) -> int:
    seqs = [[(1, CONTEXT)] * k.decodes + list(k.prompts) for k in kinds]
    return 1 + max(sum(-(-(t + c) // block_size) for t, c in kind) for kind in seqs)


def compile_model(args, kinds):
    from transformers import LlamaConfig

    from autodeploy.compiler import compile_config
    from autodeploy.config import CompileConfig

    cuda = args.device.startswith("cuda")
    if args.shape == "tiny":
        cfg = LlamaConfig(**TINY)
    else:
        from decode_bench import llama_config

        cfg = llama_config(args.shape)
    sizes = [int(s) for s in args.sizes.split(",")] if args.sizes else (None if cuda else CPU_SIZES)
    graphs = {"piecewise": True, "piecewise_on_cpu": not cuda, "mixed_graphs": True, "mixed_graphs_on_cpu": not cuda,
              "piecewise_sizes": sizes, "batch_sizes": [64 if cuda else 4]}
    longest = max(t + c for k in kinds for t, c in [(1, CONTEXT)] + list(k.prompts))
    config = CompileConfig(weights="random", device=args.device, dtype="bfloat16" if cuda else "float32",
                           max_batch_size=max(k.num_seqs for k in kinds), max_seq_len=longest,
                           max_num_tokens=max(k.num_tokens for k in kinds), tokens_per_block=16,
                           num_kv_blocks=blocks_needed(kinds, 16), attention_backend=args.attention_backend,
                           passes={"compile_cuda_graphs": graphs})
    start = time.perf_counter()
    model = compile_config(cfg, config)
    seconds = time.perf_counter() - start
    generator = torch.Generator(device=model.device).manual_seed(0)
    for cache in model.pool.caches:  # random keys and values: zeros draw less power and run faster
        cache.normal_(generator=generator)
    return model, seconds


RUNNERS = ("cuda_graphs", "piecewise", "mixed_graphs")  # decode, piecewise and whole-step graphs


@contextlib.contextmanager
def graphs_on(model, *kept: str):
    """``model`` with only the runners named in ``kept`` (of :data:`RUNNERS`) inside."""
    saved = {name: getattr(model, name) for name in RUNNERS}
    for name in RUNNERS:
        setattr(model, name, saved[name] if name in kept else None)
    try:
        yield model
    finally:
        for name, runner in saved.items():
            setattr(model, name, runner)


class Timer:
    """Host, device and synchronised step times of a callable on ``device``."""

    def __init__(self, device: torch.device, steps: int):
        self.cuda, self.steps = device.type == "cuda", steps
        self.cycles_per_ms = self._calibrate() if self.cuda else 0.0

    @staticmethod
    def _calibrate() -> float:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(1_000_000)
        start.record()
        torch.cuda._sleep(20_000_000)
        end.record()
        torch.cuda.synchronize()
        return 20_000_000 / start.elapsed_time(end)

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def step_ms(self, run) -> float:
        times = []
        for _ in range(self.steps):
            self.sync()
            start = time.perf_counter()
            run().argmax(-1).tolist()
            times.append((time.perf_counter() - start) * 1e3)
        return statistics.median(times)

    def host_and_device_ms(self, run, step_ms: float) -> tuple[float, float | None]:
        """Each run issued behind a sleep longer than the step takes, so the host never waits."""
        if not self.cuda:
            return step_ms, None
        hosts, devices = [], []
        for _ in range(self.steps):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            self.sync()
            torch.cuda._sleep(int((2 * step_ms + 5) * self.cycles_per_ms))
            start.record()
            began = time.perf_counter()
            run()
            hosts.append((time.perf_counter() - began) * 1e3)
            end.record()
            torch.cuda.synchronize()
            devices.append(start.elapsed_time(end))
        return statistics.median(hosts), statistics.median(devices)


@dataclass(frozen=True)
class Row:
    kind: str
    tokens: int
    bucket: str  # the piecewise bucket, tokens x sequences of a whole-step graph, or "eager"
    path: str
    host_ms: float
    device_ms: float | None
    step_ms: float
    seqs: int
    same_tokens: int | None = None  # greedy tokens equal to the eager step's
    difference: float | None = None  # largest logit difference from the eager graph on the same padded step

    def check(self) -> str:
        same = f"{self.same_tokens}/{self.seqs} tokens" if self.same_tokens is not None else ""
        return f"{self.difference:.2g}, {same}" if self.difference is not None else same


def padded_difference(model, chunks, pad, logits: torch.Tensor) -> float:
    """Largest difference of ``logits`` (a graph's step) from the eager graph on the step padded to ``pad``."""
    from autodeploy.kvcache.metadata import BatchMetadata

    batch = BatchMetadata.build(chunks, model.block_size, model.device, pad=pad)
    want = model.gm(**batch.as_kwargs(), **model.pool.as_kwargs())[: len(chunks)]
    return float((logits.float() - want.float()).abs().max())


def step_paths(model, chunks) -> list[tuple[str, tuple[str, ...], object, str]]:
    """(path, the runners it keeps, the padding its difference is checked on, its bucket) per path the step can take."""
    pad = model.piecewise.padding(chunks)
    paths = [("eager", (), None, "eager"), ("piecewise", ("piecewise",), pad, str(pad.num_tokens) if pad else "eager")]
    if model.mixed_graphs is not None and (whole := model.mixed_graphs.padding(chunks)) is not None:
        paths.append(("whole step", ("mixed_graphs",), whole, f"{whole.num_tokens}x{whole.num_seqs}"))
    if model.cuda_graphs is not None and model.cuda_graphs.fits(chunks):
        size = next(s for s in model.cuda_graphs.batch_sizes if s >= len(chunks))
        paths.append(("decode graph", RUNNERS, None, f"{size}x{size}"))
    return paths


def measure(model, kind: StepKind, timer: Timer) -> list[Row]:
    chunks = step_chunks(kind, model.block_size, model.vocab_size)
    rows, eager_ids = [], None
    for path, kept, pad, bucket in step_paths(model, chunks):
        with graphs_on(model, *kept):
            run = lambda: model(chunks)  # noqa: E731
            for _ in range(2):  # first calls compile kernels
                run()
            step = timer.step_ms(run)
            host, device = timer.host_and_device_ms(run, step)
            logits = run().clone()
            ids = logits.argmax(-1)
            eager_ids = ids if eager_ids is None else eager_ids
            difference = padded_difference(model, chunks, pad, logits) if pad is not None else None
        rows.append(Row(kind.name, kind.num_tokens, bucket, path, host, device, step, len(chunks),
                        None if path == "eager" else int((ids == eager_ids).sum()), difference))
    return rows


HEADER = (f"{'step kind':<36}{'tokens':>7}{'bucket':>9}  {'path':<13}{'host ms':>8}{'device ms':>10}{'step ms':>9}"
          "  Δ eager")


def print_row(r: Row) -> None:
    device = f"{r.device_ms:10.2f}" if r.device_ms is not None else f"{'-':>10}"
    print(f"{r.kind:<36}{r.tokens:>7}{r.bucket:>9}  {r.path:<13}{r.host_ms:8.2f}{device}{r.step_ms:9.2f}  {r.check()}",
          flush=True)


def capture_line(model) -> str:
    return next(r.detail for r in model.report.passes if r.name == "compile_cuda_graphs")


def run(args) -> list[Row]:
    started = time.perf_counter()
    kinds = CPU_KINDS if args.shape == "tiny" else GPU_KINDS
    model, seconds = compile_model(args, kinds)
    print(f"{args.shape} on {model.device}, compiled in {seconds:.1f} s; compile_cuda_graphs: {capture_line(model)}",
          flush=True)
    timer = Timer(model.device, args.steps)
    print(HEADER, flush=True)
    rows = []
    for kind in kinds:  # each kind's rows as they come (a run cut short keeps them)
        kind_rows = measure(model, kind, timer)
        for row in kind_rows:
            print_row(row)
        rows += kind_rows
    worst = max(r.difference for r in rows if r.difference is not None)
    print(f"graphs vs the eager graph on the same padded steps: largest logit difference {worst:.2g} "
          f"({time.perf_counter() - started:.0f} s in all)", flush=True)
    if worst > args.tolerance:
        raise SystemExit(f"graph steps differ from eager ones by {worst:.2g} > --tolerance {args.tolerance}")
    return rows


def main(argv: list[str] | None = None) -> list[Row]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="llama8b", help="llama8b, smollm2 (bench/decode_bench.py) or tiny")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--steps", type=int, default=10, help="timed runs per step kind and path")
    parser.add_argument("--sizes", default="", help="token buckets of the piecewise and whole-step graphs, e.g. 128,512,2048 (default: the "
                        "default ladder on CUDA, 4,16,32 on the CPU)")
    parser.add_argument("--attention_backend", default="auto", help="auto (triton on CUDA, torch on the CPU), torch, "
                        "triton (on the CPU: TRITON_INTERPRET=1), flashinfer")
    parser.add_argument("--tolerance", type=float, default=0.05, help="largest logit difference accepted "
                        "between a graph's step and the eager graph on the same padded step (exit 1 beyond)")
    args = parser.parse_args(argv)
    with torch.inference_mode():
        return run(args)


if __name__ == "__main__":
    main()
