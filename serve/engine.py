"""The engine: continuous batching over one ``CompiledModel``, one step at a time.

``add_request`` queues a request; every ``step`` schedules a batch (decodes and prefill chunks
mixed, see ``scheduler``), runs it, appends the sampled tokens, detokenizes, applies the stop
conditions and returns a delta :class:`RequestOutput` for every request that changed. Finished
and aborted sequences give their KV blocks back at once.

Failure isolation: a step that fails because of one request fails that request alone (a report
with ``error`` set; its blocks are freed) and the engine goes on. Bookkeeping is guarded per
sequence; a launch that raises is retried on halves of its requests until the failing ones are
found. Only a device fault (a CUDA error: the device is unusable for everyone) propagates. None of
this costs anything while nothing fails (``try`` is free in Python 3.11+).

Overlap (async scheduling, as vLLM's and TensorRT-LLM's overlap scheduler): on CUDA, step n + 1 is
scheduled and launched before step n's sampled tokens reach the host. Each token step n samples is a
placeholder in its sequence until then, and step n + 1 reads it from the device (see ``runner``).
While the device runs step n + 1, the host waits for step n's tokens and does all of step n's
bookkeeping: stop tokens, prefix-cache keys, detokenization, stop strings, reports. So the device
never waits for the host as long as the host's work per step is shorter than the device's. A
sequence that step n stops has run one more token in step n + 1, which is dropped. Penalties need
the tokens on the host, so a step with such a request waits for the previous one first. On the CPU
nothing runs asynchronously and overlap would only delay outputs by a step, so it is off there by
default; both modes give identical outputs.
"""

from __future__ import annotations

import gc
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Sequence as Seq

import torch

from autodeploy.compiled import CompiledModel
from autodeploy.kvcache.block_manager import BlockManager
from autodeploy.kvcache.metadata import PLACEHOLDER_TOKEN
from autodeploy.sampling_params import RequestOutputKind, SamplingParams, StructuredOutput

from .outputs import RequestOutput
from .reports import detokenize, request_metrics, request_output
from .request_bounds import RequestBounds, check_request
from .runner import ModelRunner, PendingStep
from .sampler import Sampler
from .scheduler import ScheduledChunk, Schedule, Scheduler
from .sequence import Request, Sequence, Status, new_sequences
from .structured import GrammarCompiler, StructuredOutputs

log = logging.getLogger("autodeploy.serve.engine")


@dataclass(frozen=True)
class EngineConfig:
    """Engine options; ``None`` takes the compiled model's value."""

    max_batch_size: int | None = None
    max_num_tokens: int | None = None
    max_num_prefill_tokens: int | None = None  # prompt tokens per step (None: the whole token budget)
    busy_prefill_tokens: int | None = None  # ... once half the batch decodes in it (None: the same)
    enable_prefix_caching: bool = True
    num_blocks: int | None = None  # use only this many of the model's KV blocks
    overlap: bool | None = None  # default: on for CUDA, off on the CPU
    freeze_gc: bool | None = None  # default: on for CUDA (see freeze_long_lived_objects)
    # structured outputs: compile grammars in a worker process under this deadline (None: here, unbounded)
    grammar_compile_timeout: float | None = None


@dataclass(frozen=True)
class EngineStats:
    """A snapshot of the engine's state and running totals."""

    num_running: int  # sequences (a request with n choices has n)
    num_waiting: int
    num_running_requests: int  # requests with a sequence running
    num_waiting_requests: int  # requests with none running and one waiting
    num_blocks: int
    num_used_blocks: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int
    # what compiled or was captured after the server said ready, by kind (``compile_watch``)
    compiles_after_ready: dict[str, int] = field(default_factory=dict)

    @property
    def kv_usage(self) -> float:
        return self.num_used_blocks / self.num_blocks

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0


class Engine:
    def __init__(self, model: CompiledModel, tokenizer: Any = None, config: EngineConfig = EngineConfig()):
        self.model = model
        self.tokenizer = tokenizer
        self.config = config
        num_blocks = min(config.num_blocks or model.num_blocks, model.num_blocks)
        caching = config.enable_prefix_caching and not model.num_state_slots  # a prefix comes without its state
        self.blocks = BlockManager(num_blocks, model.block_size, caching, num_state_slots=model.num_state_slots)
        self.max_num_tokens = min(config.max_num_tokens or model.config.max_num_tokens, model.config.max_num_tokens)
        self.scheduler = Scheduler(self.blocks, config.max_batch_size or model.config.max_batch_size, self.max_num_tokens,
                                   config.max_num_prefill_tokens, config.busy_prefill_tokens)
        self.eos_token_ids = eos_token_ids(model.hf_config, tokenizer)
        self.structured = None if tokenizer is None else StructuredOutputs(GrammarCompiler(
            tokenizer, model.vocab_size, self.eos_token_ids, config.grammar_compile_timeout))
        self.runner = ModelRunner(model, Sampler(model.vocab_size, model.device, self.structured))
        self.overlap = config.overlap if config.overlap is not None else model.device.type == "cuda"
        if config.freeze_gc if config.freeze_gc is not None else model.device.type == "cuda":
            freeze_long_lived_objects()
        self.max_total_tokens = min(model.max_seq_len, num_blocks * model.block_size)
        self._requests: dict[str, list[Sequence]] = {}
        self._in_flight: PendingStep | None = None  # launched, its tokens not yet on the host (overlap)
        self.last_schedule = Schedule(())  # what the last step launched (benchmarks read it)
        self.last_resolved = Schedule(())  # whose results the last step waited for (with overlap: the one before)
        self.wait_seconds = 0.0  # host time spent waiting for the device's results (benchmarks read it)
        self.compile_watch = None  # counts compiles after ready (``compile_watch.CompileWatch``), once serving

    # ---- requests -------------------------------------------------------------------------------

    def add_request(
        self, request_id: str, prompt_token_ids: Seq[int], params: SamplingParams | None = None,
        arrival_time: float | None = None,
    ) -> None:
        """Queue a request; raises ``ValueError`` (a client error) when it cannot be served."""
        params = params or SamplingParams()
        if request_id in self._requests:
            raise ValueError(f"request id '{request_id}' is already in use")
        prompt = tuple(int(t) for t in prompt_token_ids)
        self.check_request(prompt, params)
        request = Request(request_id, prompt, params, arrival_time or time.monotonic(),
                          frozenset(self.eos_token_ids), self._total_tokens(prompt, params), frozenset(params.stop_token_ids))
        if params.structured is not None:
            self.structured.prepare(params.structured)
        seqs = new_sequences(request, self.tokenizer)
        for seq in seqs:
            if params.seed is not None:
                seq.generator = torch.Generator(device=self.model.device).manual_seed(params.seed + seq.index)
            self.scheduler.add(seq)
        self._requests[request_id] = seqs

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Stop a request now and free its blocks; returns its last report (``finish_reason`` abort)."""
        seqs = self._requests.get(request_id)
        if seqs is None:
            return None
        for seq in seqs:
            seq.drop_pending_tokens()  # sampled by the step in flight: never reported
            if not seq.is_finished:
                self._finish(seq, "abort", None)
        return self._request_output(request_id, seqs)

    def compile_grammar(self, spec: StructuredOutput) -> None:
        """Compile a request's grammar into the engine's cache now (thread-safe; the server calls it before
        adding the request); ``GrammarError``, a ``ValueError``, with the reason when it cannot be compiled."""
        if self.structured is None:
            raise ValueError("structured outputs need a tokenizer (the grammar is matched against its vocabulary)")
        self.structured.compiler.compile(spec)

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests)

    @property
    def has_step_in_flight(self) -> bool:
        """A launched step is still unresolved (with overlap, the one after a request's last token may be);
        one more ``step()`` resolves it."""
        return self._in_flight is not None

    @property
    def num_unfinished_requests(self) -> int:
        return len(self._requests)

    def stats(self) -> EngineStats:
        running = {seq.request.request_id for seq in self.scheduler.running}
        waiting = {seq.request.request_id for seq in self.scheduler.waiting} - running
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            num_running_requests=len(running),
            num_waiting_requests=len(waiting),
            num_blocks=self.blocks.num_blocks,
            num_used_blocks=self.blocks.num_used,
            prefix_cache_queries=self.blocks.prefix_queries,
            prefix_cache_hits=self.blocks.prefix_hits,
            num_preemptions=self.scheduler.num_preemptions,
            compiles_after_ready=self.compile_watch.counts() if self.compile_watch is not None else {},
        )

    def reset_counters(self) -> None:
        """Start the running totals of :meth:`stats` over (after the start-up warm-up's requests)."""
        self.blocks.prefix_queries = self.blocks.prefix_hits = 0
        self.scheduler.num_preemptions = 0
        self.wait_seconds = 0.0

    def stop_sequences(self, stops: Seq[tuple[str, int, str]]) -> list[RequestOutput]:
        """Finish these (request id, choice index) sequences with a stop string found outside the engine
        (the API process detokenizes when the engine runs in a process of its own); returns the reports."""
        touched = {}
        for request_id, index, stop in stops:
            seqs = self._requests.get(request_id)
            seq = next((s for s in seqs or () if s.index == index), None)
            if seq is None or seq.is_finished:
                continue
            seq.drop_pending_tokens()
            self._finish(seq, "stop", stop)
            touched[request_id] = seqs
        return [self._request_output(rid, seqs) for rid, seqs in touched.items()]

    # ---- the step -------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one batch; returns the reports of the requests that changed."""
        reports = []
        if self._in_flight is not None and not self._may_schedule_ahead(self._in_flight):
            reports += self._resolve(self._in_flight)
            self._in_flight = None
        schedule = self.scheduler.schedule()
        self.last_schedule = schedule
        if not schedule.chunks and self._in_flight is None and self.scheduler.has_work:
            # cannot happen when requests are validated against the pool size; never spin silently
            raise RuntimeError("the scheduler made no progress with requests waiting")
        launched = None
        if schedule.chunks:
            try:
                launched = self.runner.launch(schedule, self._in_flight)
            except Exception as exc:  # noqa: BLE001 (find the request that broke it; a device fault re-raises)
                raise_if_device_fault(exc)
                return reports + self._launch_isolating(schedule)
        if self._in_flight is not None:
            reports += self._resolve(self._in_flight)  # while the device runs the step just launched
        self._in_flight = self._mark_launched(launched) if launched is not None else None
        if self._in_flight is not None and not self.overlap:
            reports += self._resolve(self._in_flight)
            self._in_flight = None
        return reports

    def _launch_isolating(self, schedule: Schedule) -> list[RequestOutput]:
        """A launch raised: resolve the step in flight, then run the schedule's chunks again in groups
        of requests, halving a group that fails until the requests that fail alone are found."""
        reports = []
        if self._in_flight is not None:
            reports += self._resolve(self._in_flight)
            self._in_flight = None
        chunks = [c for c in schedule.chunks if not c.seq.is_finished]
        if self.model.num_state_slots:  # the failed launch may have advanced states: rerun from scratch
            chunks = [_from_first_token(c) for c in chunks]
        return reports + self._run_split(chunks)

    def _run_split(self, chunks: list) -> list[RequestOutput]:
        if not chunks:
            return []
        try:
            step = self.runner.launch(Schedule(tuple(chunks)))
        except Exception as exc:  # noqa: BLE001
            raise_if_device_fault(exc)
            ids = list(dict.fromkeys(c.seq.request.request_id for c in chunks))
            if len(ids) == 1:
                failed = self._fail_request(ids[0], exc)
                return [failed] if failed is not None else []
            first = set(ids[: len(ids) // 2])
            return (self._run_split([c for c in chunks if c.seq.request.request_id in first])
                    + self._run_split([c for c in chunks if c.seq.request.request_id not in first]))
        return self._resolve(self._mark_launched(step))

    def _fail_request(self, request_id: str, exc: BaseException) -> RequestOutput | None:
        """One request broke a step (its parameters, its detokenization...): it alone fails."""
        seqs = self._requests.pop(request_id, None)
        if seqs is None:
            return None
        log.error("request %s failed in the engine (%s: %s); the others go on", request_id, type(exc).__name__, exc,
                  exc_info=exc)
        for seq in seqs:
            seq.drop_pending_tokens()
            if not seq.is_finished:
                self._finish(seq, "error", None)
        return RequestOutput(request_id, seqs[0].request.prompt_token_ids, (), True,
                             metrics=request_metrics(seqs, True), error=f"{type(exc).__name__}: {exc}")

    def _may_schedule_ahead(self, in_flight: PendingStep) -> bool:
        return self.overlap and not any(seq.params.uses_penalties for seq in in_flight.rows)

    def _mark_launched(self, step: PendingStep) -> PendingStep:
        """Advance the sequences by the launched step; each sampled token is a placeholder until resolved."""
        for chunk in step.schedule.chunks:
            seq = chunk.seq
            if seq.is_finished:  # stopped by the step resolved meanwhile
                continue
            seq.num_computed = chunk.end
            if seq in step.rows:
                step.token_index[seq] = seq.num_tokens
                seq.token_ids.append(PLACEHOLDER_TOKEN)
                seq.num_pending_tokens += 1
        return step

    def _resolve(self, step: PendingStep) -> list[RequestOutput]:
        """Wait for a launched step's tokens; stop sequences on stop tokens and length; report."""
        waited = time.perf_counter()
        result = step.wait()
        self.wait_seconds += time.perf_counter() - waited
        self.last_resolved = step.schedule
        sampled, failed = [], []
        caching, now = self.blocks.enable_prefix_caching, time.monotonic()
        # (this loop runs for every sequence of every step: checks that are mostly false come first)
        for chunk in step.schedule.chunks:
            seq = chunk.seq
            if seq.is_finished:  # aborted or stopped while the step ran
                continue
            try:
                if caching and seq.status is Status.RUNNING:  # not preempted since: still holds the blocks
                    seq.block_keys += self.blocks.cache_full_blocks(seq.block_ids, seq.token_ids, chunk.end,
                                                                    seq.block_keys)
                if seq.request.params.prompt_logprobs is not None:
                    self._collect_prompt_logprobs(seq, result.prompt_logprobs.get(seq, {}))
                sampled_token = result.tokens.get(seq)
                if sampled_token is not None:
                    self._accept_token(seq, step.token_index[seq], *sampled_token, now)
                    sampled.append(seq)
            except Exception as exc:  # noqa: BLE001 (this request alone fails)
                failed.append(self._fail_request(seq.request.request_id, exc))
        return self._report(sampled) + [f for f in failed if f is not None]

    def _accept_token(self, seq: Sequence, index: int, token: int, logprob, now: float) -> None:
        """The sampled token replaces its placeholder (the last token id of the sequence)."""
        seq.token_ids[index] = token
        seq.num_pending_tokens -= 1
        if logprob is not None:
            seq.logprobs.append(logprob)
        seq.last_token_time = now
        seq.first_token_time = seq.first_token_time or now
        params = seq.params
        if seq.num_output_tokens >= params.min_tokens:
            if not params.ignore_eos and token in seq.request.eos_token_ids:
                self._finish(seq, "stop", None)
            elif token in seq.request.stop_token_ids:
                self._finish(seq, "stop", token)
        if not seq.is_finished and seq.num_tokens >= seq.request.max_total_tokens:
            self._finish(seq, "length", None)

    def _collect_prompt_logprobs(self, seq: Sequence, by_position: dict) -> None:
        if seq.params.prompt_logprobs is None or seq.index != 0:
            return
        if seq.prompt_logprobs is None:
            seq.prompt_logprobs = [None]  # nothing scores the first prompt token
        while len(seq.prompt_logprobs) in by_position:  # positions already collected are skipped
            seq.prompt_logprobs.append(by_position[len(seq.prompt_logprobs)])

    def _finish(self, seq: Sequence, reason: str, stop_reason: str | int | None) -> None:
        seq.finish_reason, seq.stop_reason = reason, stop_reason
        self.scheduler.finish(seq)

    # ---- reports --------------------------------------------------------------------------------

    def _report(self, seqs: list[Sequence]) -> list[RequestOutput]:
        """Detokenize what the sequences generated, apply stop strings, build the reports.

        A ``FINAL_ONLY`` request is detokenized once when it finishes (every step only if it has
        stop strings to find) and reported once, when all its sequences have finished."""
        touched: dict[str, list[Sequence]] = {}
        reports = []
        for seq in seqs:
            current = self._requests.get(seq.request.request_id)
            if current is None or seq not in current:  # aborted (or failed) meanwhile
                continue
            params = seq.request.params
            final_only = params.output_kind is RequestOutputKind.FINAL_ONLY
            if final_only and not seq.is_finished and not params.stop:
                continue  # nothing to detokenize or report before it finishes
            try:
                detokenize(seq, self._finish)  # (may finish it: a stop string)
            except Exception as exc:  # noqa: BLE001 (this request alone fails)
                touched.pop(seq.request.request_id, None)
                reports.append(self._fail_request(seq.request.request_id, exc))
                continue
            if not final_only or all(s.is_finished for s in current):
                touched[seq.request.request_id] = current
        for rid, request_seqs in touched.items():
            try:
                reports.append(self._request_output(rid, request_seqs))
            except Exception as exc:  # noqa: BLE001
                reports.append(self._fail_request(rid, exc))
        return [r for r in reports if r is not None]

    def _request_output(self, request_id: str, seqs: list[Sequence]) -> RequestOutput:
        """The delta report of one request; a finished request is forgotten here."""
        report = request_output(request_id, seqs)
        if report.finished:
            del self._requests[request_id]
        return report

    # ---- validation -----------------------------------------------------------------------------

    def _total_tokens(self, prompt: tuple[int, ...], params: SamplingParams) -> int:
        if params.max_tokens is None:
            return self.max_total_tokens
        return len(prompt) + params.max_tokens

    def check_request(self, prompt: Seq[int], params: SamplingParams) -> None:
        """Raise ``ValueError`` (a client error) if this request can never be served."""
        check_request(prompt, params, self.request_bounds, self.tokenizer is not None)

    @property
    def request_bounds(self) -> RequestBounds:
        return RequestBounds(self.model.vocab_size, self.model.max_seq_len, self.blocks.num_blocks,
                             self.blocks.block_size)


def _from_first_token(chunk: ScheduledChunk) -> ScheduledChunk:
    """The chunk widened back to the sequence's first token. A launch that raised may have run the
    forward (a sampling error comes after it): KV writes repeat harmlessly, but a recurrent state
    would be advanced twice. From the first token, every state starts from zero again."""
    return ScheduledChunk(chunk.seq, 0, chunk.end, chunk.end if chunk.seq.wants_prompt_logprobs else chunk.num_logits)


def freeze_long_lived_objects() -> None:
    """Take everything alive now (the compiled graph's nodes, imported modules, the tokenizer) out
    of the garbage collector's scans. Its full collections walk every tracked object; with those
    they took ~30% of the host's time per step at 490 sequences (``bench/probes/engine_host.py``), and
    the step waits for them; in the API process of a split server one stalled the event loop 193 ms
    in the first load after start-up (8B, H100, 2026-12-07). What is allocated from now on is
    collected as usual."""
    gc.collect()
    gc.freeze()


def raise_if_device_fault(exc: BaseException) -> None:
    """Re-raise CUDA errors: they leave the device unusable for every request (sticky), so there is
    no single request to blame and the engine must stop. Anything else may be one request's fault."""
    if isinstance(exc, torch.AcceleratorError) or "CUDA error" in str(exc):
        raise exc


def eos_token_ids(hf_config: Any, tokenizer: Any) -> set[int]:
    """End-of-sequence ids from the model config and the tokenizer."""
    eos = getattr(hf_config, "eos_token_id", None)
    ids = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    if tokenizer is not None and getattr(tokenizer, "eos_token_id", None) is not None:
        ids.add(tokenizer.eos_token_id)
    return ids
