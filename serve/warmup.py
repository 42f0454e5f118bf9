"""The engine's start-up requests: whatever would otherwise happen the first time a client asks.

The compile pipeline's ``warm_up`` pass runs the model's eager steps and CUDA-graph captures compile
its kernels, but the engine does more per step than the graph: the sampler (a Triton argmax for the
model's dtype and another for float32 rows, sorts for top-k/top-p, the exponential draws, log-softmax
for logprobs, penalties' scatter), the GEMM library choice timed on the first GEMM of each row bucket
up to 512 rows (``ops/blas_choice.py``), CUDA's lazy loading of each kernel's module on its first
launch, and the host code of each path. On an H100 the first request after start-up waited
seconds for these (concurrency 1: TTFT p99 3.8 s on the first run, 149 ms on the next).

So before the server says ready, :func:`warm_up_engine` runs requests through the engine itself:
one prompt at a time at every power-of-two token count up to 512 (the GEMM row buckets; chunked as
the scheduler chunks them), the largest step the limits allow, and a full batch of short requests
that decode together and meet each sampler path (greedy; temperature with top-k, top-p, min-p and a
seed; penalties; ``min_tokens``; logprobs; prompt logprobs; stop strings). The requests use free
blocks, leave nothing behind and the engine's running totals start over afterwards.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass

from autodeploy.sampling_params import SamplingParams

from .engine import Engine

log = logging.getLogger("autodeploy.serve.warmup")

MAX_GEMM_BUCKET = 512  # blas_choice.MAX_TUNED_ROWS: larger GEMMs are not timed
DECODE_TOKENS = 3  # tokens each request of the full batch generates


@dataclass(frozen=True)
class WarmUpReport:
    requests: int
    steps: int
    seconds: float

    def summary(self) -> str:
        return f"{self.requests} requests in {self.steps} engine steps, {self.seconds:.1f} s"


def sampler_variants(vocab_size: int) -> list[SamplingParams]:
    """One of each sampler path (they differ in kernels and in the dtype of the rows they reduce)."""
    common = dict(max_tokens=DECODE_TOKENS, ignore_eos=True)
    return [
        SamplingParams(temperature=0, **common),
        SamplingParams(temperature=0.8, top_k=min(20, vocab_size), top_p=0.9, min_p=0.05, seed=1, **common),
        SamplingParams(temperature=1.0, **common),
        SamplingParams(temperature=0, repetition_penalty=1.1, presence_penalty=0.5, frequency_penalty=0.5, **common),
        SamplingParams(temperature=0, min_tokens=2, **common),
        SamplingParams(temperature=0, logprobs=5, prompt_logprobs=5, **common),
        SamplingParams(temperature=0, stop=("\n\n",), **common),
    ]


def warm_up_plan(engine: Engine) -> list[list[tuple[list[int], SamplingParams]]]:
    """Waves of (prompt, params): each wave runs to completion before the next starts."""
    vocab, longest = engine.model.vocab_size, engine.max_total_tokens - DECODE_TOKENS
    one_token = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True, detokenize=False)
    lengths = [n for n in _powers_of_two(MAX_GEMM_BUCKET) if n <= longest]
    lengths.append(min(engine.max_num_tokens, longest))  # the largest step: its memory is reserved now
    waves = [[(_prompt(n, vocab, i), one_token)] for i, n in enumerate(dict.fromkeys(lengths))]
    variants = [p if engine.tokenizer is not None or not p.stop else dataclasses.replace(p, stop=())
                for p in sampler_variants(vocab)]
    batch = engine.scheduler.max_batch_size
    waves.append([(_prompt(8, vocab, 1000 + i), variants[i % len(variants)]) for i in range(batch)])
    return waves


def warm_up_engine(engine: Engine) -> WarmUpReport:
    """Run :func:`warm_up_plan` through ``engine``; requests that cannot fit its pool are left out."""
    start, steps, count = time.perf_counter(), 0, 0
    for wave in warm_up_plan(engine):
        for i, (prompt, params) in enumerate(wave):
            try:
                engine.add_request(f"warm-up-{count}-{i}", prompt, params)
            except ValueError as exc:  # a pool or context too small for this one
                log.debug("warm-up request left out: %s", exc)
        count += len(wave)
        while engine.has_unfinished_requests() or engine.has_step_in_flight:
            engine.step()
            steps += 1
    if engine.stats().num_used_blocks:
        raise RuntimeError("the start-up requests left KV blocks in use")
    engine.reset_counters()
    report = WarmUpReport(count, steps, time.perf_counter() - start)
    log.info("engine warm-up: %s", report.summary())
    return report


def _powers_of_two(limit: int) -> list[int]:
    return [1 << i for i in range(limit.bit_length()) if 1 << i <= limit]


def _prompt(length: int, vocab_size: int, salt: int) -> list[int]:
    """Deterministic ids, different for every ``salt``: no two start-up prompts share a cached prefix
    (which would shorten the steps they are meant to run)."""
    return [(salt * 7919 + i * 104729) % vocab_size for i in range(length)]
