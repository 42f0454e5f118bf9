"""Structured outputs in the engine: grammars compiled (cached) where the sampler runs, one xgrammar matcher
per sequence, and each step's allowed-token bitmask applied to the logits on the device.

A request carries its grammar as text (``SamplingParams.structured``). :class:`GrammarCompiler` turns it
into xgrammar's ``CompiledGrammar`` against the tokenizer's vocabulary (LRU-cached; failures cached too, so
a bad grammar sent again costs nothing). With a deadline it compiles in a worker process that is killed
when the deadline passes (``grammar_worker.py``); without one (offline ``LLM``) in this process.

Per step (:meth:`StructuredOutputs.bitmask`, called by the sampler after the forward was queued, so the
host does this while the device computes the logits): each structured sequence's matcher first consumes the
tokens it has not seen (with async scheduling the previous step's token comes from that step's results,
the one wait the step would do anyway), then writes its row of the ``[rows, ceil(V / 32)]`` int32 bitmask
(bit ``t`` of a row: token ``t`` allowed). :func:`apply_token_bitmask` unpacks it on the device and sets
the disallowed logits to -inf before penalties, temperature and the draw, so every sampling mode obeys the
grammar, and log-probabilities are those of the constrained distribution (as vLLM reports them). Matchers
live as long as their sequence (a weak mapping): preemption keeps them (a recomputed sequence has the same
tokens), aborts and finished requests drop them.
"""

from __future__ import annotations

import collections
import concurrent.futures
import logging
import threading
import weakref
from typing import TYPE_CHECKING, Any, Sequence as Seq

import torch

from autodeploy.sampling_params import StructuredOutput

from .grammar_worker import GrammarError, GrammarWorker, compile_with

if TYPE_CHECKING:
    from .runner import PendingStep
    from .sequence import Sequence

log = logging.getLogger("autodeploy.serve.structured")

INSTALL_HINT = "structured outputs need xgrammar: pip install xgrammar"
CACHE_ENTRIES = 512
CACHE_BYTES = 1 << 30
FAILURE_CACHE_ENTRIES = 1024
BATCH_FILL_MIN_ROWS = 8  # from this many structured rows on, xgrammar fills the bitmask rows on threads

__all__ = ["GrammarCompiler", "GrammarError", "StructuredOutputs", "apply_token_bitmask"]


def _xgrammar():
    try:
        import xgrammar
    except ImportError as exc:
        raise GrammarError(f"{INSTALL_HINT} ({exc})") from None
    return xgrammar


class GrammarCompiler:
    """``StructuredOutput`` -> xgrammar ``CompiledGrammar`` for one tokenizer, cached; thread-safe.

    ``timeout`` (seconds): compile in an isolated worker process under that deadline (the server); None:
    in this process, without one (trusted callers). ``vocab_size`` is the model's (the logits' width).
    """

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: Seq[int] = (), timeout: float | None = None):
        self.tokenizer, self.vocab_size, self.timeout = tokenizer, vocab_size, timeout
        self._stop_token_ids = sorted(set(stop_token_ids)) or None
        self._cache_lock, self._compile_lock = threading.Lock(), threading.Lock()
        self._compiled: collections.OrderedDict[StructuredOutput, Any] = collections.OrderedDict()
        self._failed: collections.OrderedDict[StructuredOutput, str] = collections.OrderedDict()
        self._info = None
        self._local = None  # xgrammar.GrammarCompiler, for compiles in this process
        self._worker: GrammarWorker | None = None
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="autodeploy-grammar")

    @property
    def tokenizer_info(self):
        if self._info is None:
            xgr = _xgrammar()
            self._info = xgr.TokenizerInfo.from_huggingface(self.tokenizer, vocab_size=self.vocab_size,
                                                            stop_token_ids=self._stop_token_ids)
        return self._info

    def compile(self, spec: StructuredOutput):
        """The compiled grammar (cached); ``GrammarError`` with the reason when it cannot be compiled.
        A cached grammar never waits for a compile in progress."""
        cached = self._cached(spec)
        if cached is not None:
            return cached
        with self._compile_lock:
            cached = self._cached(spec)  # (compiled meanwhile by another caller)
            if cached is not None:
                return cached
            try:
                compiled = self._compile(spec)
            except GrammarError as exc:
                with self._cache_lock:
                    _remember(self._failed, spec, str(exc), FAILURE_CACHE_ENTRIES)
                raise
        with self._cache_lock:
            _remember(self._compiled, spec, compiled, CACHE_ENTRIES)
            while len(self._compiled) > 1 and sum(g.memory_size_bytes for g in self._compiled.values()) > CACHE_BYTES:
                self._compiled.popitem(last=False)
        return compiled

    def _cached(self, spec: StructuredOutput):
        with self._cache_lock:
            if spec in self._failed:
                raise GrammarError(self._failed[spec])
            compiled = self._compiled.get(spec)
            if compiled is not None:
                self._compiled.move_to_end(spec)
            return compiled

    def compile_soon(self, spec: StructuredOutput) -> concurrent.futures.Future:
        """Compile on the compiler's thread (a cached grammar is ready at once)."""
        return self._pool.submit(self.compile, spec)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        with self._compile_lock:
            if self._worker is not None:
                self._worker.close()

    def _compile(self, spec: StructuredOutput):
        xgr = _xgrammar()
        if self.timeout is None:
            if self._local is None:
                self._local = xgr.GrammarCompiler(self.tokenizer_info, max_threads=1, cache_enabled=False)
            return compile_with(self._local, spec.kind, spec.spec)
        if self._worker is None:
            self._worker = GrammarWorker(self.tokenizer_info.serialize_json())
        serialized = self._worker.compile(spec.kind, spec.spec, self.timeout)
        return xgr.CompiledGrammar.deserialize_json(serialized, self.tokenizer_info)


def _remember(cache: collections.OrderedDict, key, value, max_entries: int) -> None:
    cache[key] = value
    while len(cache) > max_entries:
        cache.popitem(last=False)


class _SequenceGrammar:
    """One sequence's matcher and how many of its generated tokens it has consumed."""

    __slots__ = ("matcher", "consumed")

    def __init__(self, matcher):
        self.matcher, self.consumed = matcher, 0


class StructuredOutputs:
    """The engine's structured sequences: their matchers, and each step's bitmask of allowed tokens."""

    def __init__(self, compiler: GrammarCompiler):
        self.compiler = compiler
        self._grammars: weakref.WeakKeyDictionary[Sequence, _SequenceGrammar] = weakref.WeakKeyDictionary()
        self._batch_matcher = None

    def prepare(self, spec: StructuredOutput) -> None:
        """A request arrived: compile its grammar on the compiler's thread while its prompt is prefilled (its
        first token waits for it)."""
        self.compiler.compile_soon(spec)

    def bitmask(self, seqs: Seq[Sequence], previous: PendingStep | None) -> tuple[list[int], torch.Tensor] | None:
        """(rows, host bitmask) for the structured rows of ``seqs``; None when no row is structured. ``previous``
        is the step still in flight (async scheduling), whose sampled tokens the matchers consume first."""
        rows = [row for row, seq in enumerate(seqs) if seq.params.structured is not None]
        if not rows:
            return None
        words = (self.compiler.vocab_size + 31) // 32
        pin = torch.cuda.is_available()
        host = torch.full((len(rows), words), -1, dtype=torch.int32, pin_memory=pin)
        live, live_rows = [], []
        for i, row in enumerate(rows):
            grammar = self._catch_up(seqs[row], previous)
            if not grammar.matcher.is_terminated():  # (a finished grammar's sequence is ending: any row will do)
                live.append(grammar.matcher)
                live_rows.append(i)
        self._fill(live, host, live_rows)
        return rows, host

    def _catch_up(self, seq: Sequence, previous: PendingStep | None) -> _SequenceGrammar:
        grammar = self._grammars.get(seq)
        if grammar is None:
            compiled = self.compiler.compile(seq.params.structured)
            grammar = self._grammars[seq] = _SequenceGrammar(_xgrammar().GrammarMatcher(compiled))
        first_output = seq.num_prompt_tokens
        known = seq.num_tokens - seq.num_pending_tokens
        for index in range(first_output + grammar.consumed, seq.num_tokens):
            token = seq.token_ids[index] if index < known else _in_flight_token(seq, index, previous)
            if not grammar.matcher.is_terminated() and not grammar.matcher.accept_token(token):
                raise GrammarError(f"the grammar does not allow token {token} (generated token {index - first_output}); "
                                   "an all-excluding mask (min_tokens against a finished grammar?)")
            grammar.consumed += 1
        return grammar

    def _fill(self, matchers: list, host: torch.Tensor, rows: list[int]) -> None:
        if len(matchers) >= BATCH_FILL_MIN_ROWS:
            xgr = _xgrammar()
            if self._batch_matcher is None:
                self._batch_matcher = xgr.BatchGrammarMatcher(max_threads="auto")
            self._batch_matcher.batch_fill_next_token_bitmask(matchers, host, rows)
            return
        for matcher, row in zip(matchers, rows):
            matcher.fill_next_token_bitmask(host, row)


def _in_flight_token(seq: Sequence, index: int, previous: PendingStep | None) -> int:
    """The value of a placeholder token: sampled by the step in flight (waiting for it is the one sync)."""
    if previous is None or previous.token_index.get(seq) != index:
        raise RuntimeError(f"token {index} of a structured sequence is a placeholder no step in flight samples")
    return previous.wait().tokens[seq][0]


_SHIFTS: dict[torch.device, torch.Tensor] = {}


def apply_token_bitmask(logits: torch.Tensor, rows: list[int], host_bitmask: torch.Tensor) -> torch.Tensor:
    """``logits`` [B, V] with the tokens each bitmask row disallows at -inf in row ``rows[i]`` (a new tensor:
    the logits may be a CUDA graph's output buffer). The bitmask travels to the device without blocking."""
    device, vocab = logits.device, logits.shape[-1]
    shifts = _SHIFTS.get(device)
    if shifts is None:
        shifts = _SHIFTS[device] = torch.arange(32, dtype=torch.int32, device=device)
    bitmask = host_bitmask.to(device, non_blocking=True)
    allowed = ((bitmask[:, :, None] >> shifts) & 1).flatten(1)[:, :vocab].bool()
    if len(rows) == logits.shape[0]:
        return logits.masked_fill(~allowed, float("-inf"))
    index = torch.tensor(rows, dtype=torch.int64).to(device, non_blocking=True)
    return logits.index_put((index,), logits[index].masked_fill(~allowed, float("-inf")))
