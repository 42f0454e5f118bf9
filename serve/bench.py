"""``autodeploy bench offline``: engine throughput and latency over synthetic requests.

All requests (random token ids of ``--input_len``, exactly ``--output_len`` generated tokens,
EOS ignored) are queued at once, or ``--concurrency`` at a time, and run through the same engine
the server uses. Besides throughput and TTFT/TPOT/ITL percentiles it times the bare decode step
of the compiled model at the engine's typical batch size: the gap between that and the TPOT is
the engine's own overhead (scheduling, sampling, bookkeeping).
"""

from __future__ import annotations

import argparse
import json
import random
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch

from autodeploy.kvcache.block_manager import blocks_needed
from autodeploy.kvcache.metadata import SequenceChunk
from autodeploy.sampling_params import RequestOutputKind, SamplingParams, StructuredOutput

from .bench_stats import Distribution, latency_table
from .engine import Engine, EngineConfig
from .outputs import RequestOutput


@dataclass(frozen=True)
class OfflineResult:
    num_requests: int
    input_len: int
    output_len: int
    concurrency: int
    seconds: float
    request_throughput: float
    output_throughput: float
    total_token_throughput: float
    mean_batch_size: float
    ttft: Distribution
    tpot: Distribution
    itl: Distribution
    model_decode_step_ms: float  # bare CompiledModel decode step at the mean batch size
    steps: "StepStats"
    host_waited_s: float = 0.0  # time the engine waited for the device (the rest is host work)
    allocator: dict[str, int] | None = None  # CUDA caching-allocator counters over the timed run
    # (sequences, tokens, wall ms, waited ms) per step() call: the step it resolved; (0, 0, ...) if none
    step_log: list[tuple[int, int, float, float]] | None = None

    def summary(self) -> str:
        return "\n".join([
            f"requests {self.num_requests} x ({self.input_len} in, {self.output_len} out), concurrency "
            f"{self.concurrency}, {self.seconds:.2f} s",
            f"throughput   {self.request_throughput:.2f} req/s, {self.output_throughput:.1f} output tok/s, "
            f"{self.total_token_throughput:.1f} total tok/s",
            latency_table([self.ttft, self.tpot, self.itl]),
            f"bare model decode step at batch {round(self.mean_batch_size)}: {self.model_decode_step_ms:.2f} ms "
            f"(TPOT p50 - step = engine overhead per token: {self.tpot.p50_ms - self.model_decode_step_ms:.2f} ms)",
            self.steps.summary(),
            f"the host waited for the device {self.host_waited_s:.2f} s of {self.seconds:.2f} s "
            "(near 0: the host, not the device, sets the pace)",
            *([_allocator_line(self.allocator)] if self.allocator is not None else []),
        ])


@dataclass(frozen=True)
class StepStats:
    """Engine steps split by kind: decode-only steps (one token per sequence) and steps that prefill."""

    decode_steps: int
    decode_ms: float  # total wall time of the decode-only steps
    decode_seqs: float  # mean sequences per decode-only step
    prefill_steps: int
    prefill_ms: float
    prefill_tokens: float  # mean tokens per prefilling step
    max_step_ms: float
    launch_only_calls: int = 0  # step() calls that resolved no step (the first one: it only launched)
    launch_only_ms: float = 0.0

    @classmethod
    def of(cls, steps: list[tuple]) -> "StepStats":
        """``steps``: (sequences, tokens, wall ms, ...) of every engine step; no sequences: a call that
        resolved no step."""
        launch_only = [s for s in steps if s[0] == 0]
        steps = [s for s in steps if s[0] > 0]
        decode = [s for s in steps if s[1] == s[0]]
        prefill = [s for s in steps if s[1] != s[0]]
        return cls(len(decode), sum(s[2] for s in decode), _mean(s[0] for s in decode),
                   len(prefill), sum(s[2] for s in prefill), _mean(s[1] for s in prefill),
                   max((s[2] for s in steps), default=0.0), len(launch_only), sum(s[2] for s in launch_only))

    def summary(self) -> str:
        return (f"steps: {self.decode_steps} decode-only ({self.decode_ms / 1e3:.2f} s, "
                f"{self.decode_ms / max(1, self.decode_steps):.2f} ms each, {self.decode_seqs:.0f} seqs), "
                f"{self.prefill_steps} with prefill ({self.prefill_ms / 1e3:.2f} s, "
                f"{self.prefill_ms / max(1, self.prefill_steps):.2f} ms each, {self.prefill_tokens:.0f} tokens); "
                + (f"{self.launch_only_calls} call(s) that only launched a step ({self.launch_only_ms:.1f} ms); "
                   if self.launch_only_calls else "")
                + f"slowest step {self.max_step_ms:.1f} ms")


def _mean(values) -> float:
    values = list(values)
    return sum(values) / len(values) if values else 0.0


def run_offline(model, input_len: int, output_len: int, num_requests: int, concurrency: int | None = None,
                temperature: float = 0.0, seed: int = 0, enable_prefix_caching: bool = False,
                output_kind: RequestOutputKind = RequestOutputKind.FINAL_ONLY,
                overlap: bool | None = None) -> OfflineResult:
    """Run the benchmark on a compiled model; see the module docstring."""
    engine = Engine(model, None, EngineConfig(enable_prefix_caching=enable_prefix_caching, overlap=overlap))
    rng = random.Random(seed)
    # reported once per request, as LLM.generate does: per-step reports would cost the host more than the step
    params = SamplingParams(max_tokens=output_len, ignore_eos=True, temperature=temperature, seed=seed,
                            detokenize=False, output_kind=output_kind)
    prompts = [[rng.randrange(model.vocab_size) for _ in range(input_len)] for _ in range(num_requests)]
    concurrency = concurrency or num_requests
    warm_up_engine(engine)
    finished: list[RequestOutput] = []
    steps: list[tuple[int, int, float, float]] = []
    resolved: list[tuple[Any, float]] = []  # what each step resolved, and the wall time since the step before
    allocator_before = _allocator_counters(model.device)
    next_prompt, begin, waited_before = 0, time.perf_counter(), engine.wait_seconds
    last = begin
    while next_prompt < num_requests or engine.has_unfinished_requests():
        while next_prompt < num_requests and engine.num_unfinished_requests < concurrency:
            engine.add_request(str(next_prompt), prompts[next_prompt], params)
            next_prompt += 1
        before, waited_step, resolved_before = time.perf_counter(), engine.wait_seconds, engine.last_resolved
        finished += engine.step()
        now = time.perf_counter()
        # a call's wall time goes to the step it resolved (with overlap, mostly the wait for it); a call that
        # resolved none (the first: it only launched) is logged with no sequences and kept out of the ITL
        waited_ms = (engine.wait_seconds - waited_step) * 1e3
        if engine.last_resolved is resolved_before:
            steps.append((0, 0, (now - before) * 1e3, waited_ms))
            continue
        ran = engine.last_resolved
        steps.append((len(ran.chunks), ran.num_tokens, (now - before) * 1e3, waited_ms))
        resolved.append((ran, now - last))
        last = now
    seconds = time.perf_counter() - begin
    waited = engine.wait_seconds - waited_before
    allocator = _allocator_counters(model.device)
    if allocator is not None:
        allocator = {name: allocator[name] - allocator_before[name] for name in allocator}
    itl = [gap for ran, gap in resolved for _ in range(_decode_tokens(ran))]
    metrics = [out.metrics for out in finished if out.finished]  # (DELTA: every report of every step)
    ttft = [m.first_token_time - m.arrival_time for m in metrics]
    tpot = [(m.finished_time - m.first_token_time) / (output_len - 1) for m in metrics if output_len > 1]
    mean_batch = max(1.0, _mean(s[0] for s in steps if s[0]))
    step_ms = decode_step_ms(model, max(1, round(mean_batch)), input_len + output_len // 2)
    return OfflineResult(
        num_requests, input_len, output_len, concurrency, seconds, num_requests / seconds,
        num_requests * output_len / seconds, num_requests * (input_len + output_len) / seconds, mean_batch,
        Distribution.of("TTFT", ttft), Distribution.of("TPOT", tpot), Distribution.of("ITL", itl), step_ms,
        StepStats.of(steps), waited, allocator, steps,
    )


_ALLOCATOR_COUNTERS = {"retries": "num_alloc_retries", "device_mallocs": "num_device_alloc",
                       "device_frees": "num_device_free"}


def _allocator_counters(device: torch.device) -> dict[str, int] | None:
    """The caching allocator's retry (free everything cached, then cudaMalloc again: a device-wide
    sync) and cudaMalloc/cudaFree counts; ``None`` off CUDA."""
    if device.type != "cuda":
        return None
    stats = torch.cuda.memory_stats(device)
    return {name: int(stats.get(key, 0)) for name, key in _ALLOCATOR_COUNTERS.items()}


def _allocator_line(counts: dict[str, int]) -> str:
    line = (f"allocator during the run: {counts['device_mallocs']} cudaMalloc, {counts['device_frees']} cudaFree, "
            f"{counts['retries']} retries")
    return line + (" (each retry frees the cache and syncs the device: memory is tight)" if counts["retries"] else "")


def _decode_tokens(resolved) -> int:
    """Tokens after a sequence's first that a step resolved: each came one engine step after the
    token before it, so each is an inter-token latency sample of that step's wall time. Counted once
    the run is over (outside the timed loop): a chunk counts if it ran a generated token and its
    sampled token was kept (a token follows its end; the token sampled one step after a sequence
    stopped is dropped)."""
    return sum(1 for c in resolved.chunks if c.start >= c.seq.num_prompt_tokens and c.seq.num_tokens > c.end)


def warm_up_engine(engine: Engine) -> None:
    """One short request, and no step left in flight: the timed loop's first call must not resolve it."""
    engine.add_request("warmup", [0, 1, 2, 3], SamplingParams(max_tokens=2, ignore_eos=True, detokenize=False))
    while engine.has_unfinished_requests() or engine.has_step_in_flight:
        engine.step()


def decode_step_ms(model, batch_size: int, context_len: int, iters: int = 10) -> float:
    """Milliseconds of one bare ``CompiledModel`` decode step: ``batch_size`` sequences, one token each."""
    batch_size = min(batch_size, model.num_blocks // blocks_needed(context_len + 1, model.block_size))
    per_seq = blocks_needed(context_len + 1, model.block_size)
    slot = (lambda i: i) if model.num_state_slots else (lambda i: -1)  # a model with state: a slot each, read and written
    chunks = [SequenceChunk((1,), context_len, tuple(range(i * per_seq, (i + 1) * per_seq)), state_slot=slot(i))
              for i in range(batch_size)]
    model(chunks)  # warm-up
    _sync(model.device)
    start = time.perf_counter()
    for _ in range(iters):
        model(chunks)
    _sync(model.device)
    return 1000 * (time.perf_counter() - start) / iters


@dataclass(frozen=True)
class EngineStepTime:
    ms: float  # one engine decode step
    waited_ms: float  # of which the host waited for the device: ~0 means the host is the bottleneck


def engine_decode_step_ms(model, batch_size: int, context_len: int, steps: int = 20, warmup: int = 3,
                          overlap: bool | None = None, tokenizer=None,
                          structured: StructuredOutput | None = None) -> EngineStepTime:
    """One engine decode step in steady state: ``batch_size`` sequences of ``context_len`` prompt
    tokens, all decoding (scheduling, metadata, sampling and bookkeeping included; with overlap they
    run while the device computes). With ``structured`` (and the ``tokenizer`` its grammar is matched
    against) every sequence samples under that grammar.

    The first prompts decode while later ones prefill, so every request gets enough tokens for that
    as well; a timed step that does not decode all ``batch_size`` sequences is an error (a shrinking
    batch made earlier engine rows at batch 256 look faster than they were)."""
    max_tokens = decode_tokens_needed(model, batch_size, context_len, warmup + steps)
    engine = decoding_engine(model, batch_size, context_len, max_tokens, overlap, tokenizer, structured)
    for _ in range(warmup):
        engine.step()
    _sync(model.device)
    start, waited, sizes = time.perf_counter(), engine.wait_seconds, []
    for _ in range(steps):
        engine.step()
        sizes.append(len(engine.last_schedule.chunks))
    _sync(model.device)
    timing = EngineStepTime(1000 * (time.perf_counter() - start) / steps, 1000 * (engine.wait_seconds - waited) / steps)
    if any(size != batch_size for size in sizes):
        raise RuntimeError(f"the timed engine steps decoded {sorted(set(sizes))} sequences, not {batch_size}: "
                           "requests finished during the measurement (raise max_seq_len)")
    for i in range(batch_size):
        engine.abort_request(str(i))
    return timing


def decode_tokens_needed(model, batch_size: int, context_len: int, steps: int) -> int:
    """``max_tokens`` for requests that must all still decode after ``steps`` more steps once the
    last prompt is prefilled: the first ones generate a token in every step that prefills later ones."""
    prefill_steps = -(-batch_size * context_len // model.config.max_num_tokens) + 1
    return steps + 2 + prefill_steps


def decoding_engine(model, batch_size: int, context_len: int, max_tokens: int, overlap: bool | None = None,
                    tokenizer=None, structured: StructuredOutput | None = None) -> Engine:
    """An engine whose ``batch_size`` requests (random prompts) have all been prefilled: every
    further step decodes all of them, until ``max_tokens`` (or their grammar ends them)."""
    config = EngineConfig(max_batch_size=batch_size, enable_prefix_caching=False, overlap=overlap)
    engine = Engine(model, tokenizer, config)
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0, detokenize=False,
                            structured=structured)
    rng = random.Random(0)
    for i in range(batch_size):
        engine.add_request(str(i), [rng.randrange(model.vocab_size) for _ in range(context_len)], params)
    while not _all_decoding(engine.last_schedule, batch_size):
        engine.step()
    return engine


def _all_decoding(schedule, batch_size: int) -> bool:
    return len(schedule.chunks) == batch_size and schedule.num_tokens == batch_size


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def cmd_offline(args: argparse.Namespace) -> int:
    from autodeploy.cli import compile_options
    from autodeploy.compiler import compile as compile_model

    model = compile_model(args.model_dir, **compile_options(args))
    result = run_offline(model, args.input_len, args.output_len, args.num_requests, args.concurrency,
                         args.temperature, enable_prefix_caching=args.enable_prefix_caching)
    print(result.summary())
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(asdict(result), f, indent=2)
    return 0
