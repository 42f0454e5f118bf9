"""The model runner: a :class:`Schedule` in, sampled tokens (on their way to the host) out.

It speaks only the ``CompiledModel`` contract: a list of ``SequenceChunk`` per step, logits rows
back. :meth:`ModelRunner.launch` queues the forward and the sampling on the device and returns at
once (on CUDA); :meth:`PendingStep.wait` is where the host waits for the step's results.

A step may be launched while the previous one is still running (async scheduling): the tokens the
previous step is sampling are placeholders in the sequences (``PLACEHOLDER_TOKEN``), and the model
reads them from that step's device tensor of sampled ids (``DeferredTokens``).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch

from autodeploy.compiled import CompiledModel
from autodeploy.kvcache.metadata import DeferredTokens, SequenceChunk

from .outputs import TokenLogprob
from .sampler import PendingTokens, Sampler, prompt_logprobs, to_device
from .scheduler import Schedule
from .sequence import Sequence


@dataclass(frozen=True)
class StepResult:
    """Per sequence: the token it sampled (with its log-probabilities when asked), and the
    prompt log-probabilities computed this step, keyed by the position of the scored token."""

    tokens: dict[Sequence, tuple[int, TokenLogprob | None]] = field(default_factory=dict)
    prompt_logprobs: dict[Sequence, dict[int, TokenLogprob]] = field(default_factory=dict)


@dataclass(frozen=True)
class _PromptRows:
    seq: Sequence
    first_position: int  # position of the first scored token (the one after the first row)
    num_rows: int


class PendingStep:
    """A launched step. ``rows`` maps each sampling sequence to its row of ``device_token_ids``;
    the engine records in ``token_index`` where each one's placeholder token sits."""

    def __init__(self, schedule: Schedule, sampled: list[Sequence], prompt_rows: list[_PromptRows],
                 pending: PendingTokens, device_token_ids: torch.Tensor | None):
        self.schedule = schedule
        self._sampled, self._prompt_rows, self._pending = sampled, prompt_rows, pending
        self.rows = {seq: row for row, seq in enumerate(sampled)}
        self.device_token_ids = device_token_ids
        self.token_index: dict[Sequence, int] = {}
        self._result: StepResult | None = None

    def wait(self) -> StepResult:
        """The step's results (waited for once; structured outputs may ask before the engine does)."""
        if self._result is None:
            self._result = self._wait()
        return self._result

    def _wait(self) -> StepResult:
        host = self._pending.wait()
        result = StepResult()
        for row, seq in enumerate(self._sampled):
            result.tokens[seq] = (host["token_ids"][row], _logprob_at(host, "", row, seq.params.logprobs))
        offset = 0
        for rows in self._prompt_rows:
            k = rows.seq.params.prompt_logprobs
            result.prompt_logprobs[rows.seq] = {
                rows.first_position + i: _logprob_at(host, "prompt_", offset + i, k, rows.seq.token_ids[rows.first_position + i])
                for i in range(rows.num_rows)
            }
            offset += rows.num_rows
        return result


class ModelRunner:
    def __init__(self, model: CompiledModel, sampler: Sampler):
        self.model = model
        self.sampler = sampler

    def launch(self, schedule: Schedule, previous: PendingStep | None = None) -> PendingStep:
        """Queue ``schedule``; placeholders of tokens that ``previous`` samples are read on the device."""
        chunks = [
            SequenceChunk(tuple(c.seq.token_ids[c.start : c.end]), c.start, tuple(c.seq.block_ids), c.num_logits,
                          c.seq.state_slot)
            for c in schedule.chunks
        ]
        deferred = _deferred_tokens(schedule, previous) if previous is not None and previous.token_index else None
        logits = self.model(chunks, deferred)  # decode steps replay a CUDA graph when one is captured
        last_rows = [end - 1 for end in itertools.accumulate(c.num_logits for c in schedule.chunks)]
        sampling = [(row, c.seq) for row, c in zip(last_rows, schedule.chunks) if c.samples]
        tensors: dict[str, torch.Tensor] = {}
        if sampling:
            rows = [row for row, _ in sampling]
            sample_logits = logits if rows == list(range(logits.shape[0])) else logits[self._index(rows)]
            tensors.update(self.sampler.sample(sample_logits, [seq for _, seq in sampling], previous))
        prompt_rows = self._prompt_logprobs(schedule.chunks, last_rows, logits, tensors)
        return PendingStep(schedule, [seq for _, seq in sampling], prompt_rows, PendingTokens(tensors),
                           tensors.get("token_ids"))

    def _prompt_logprobs(self, chunks, last_rows, logits, tensors) -> list[_PromptRows]:
        """Rows that score prompt tokens: position p's logits give the log-probability of token p + 1."""
        wanted, rows, next_ids = [], [], []
        for chunk, last in zip(chunks, last_rows):
            if chunk.num_logits == 1:
                continue
            first_row = last - chunk.num_logits + 1
            n = min(chunk.end, chunk.seq.num_prompt_tokens - 1) - chunk.start
            if n <= 0:
                continue
            wanted.append(_PromptRows(chunk.seq, chunk.start + 1, n))
            rows.extend(range(first_row, first_row + n))
            next_ids.extend(chunk.seq.token_ids[chunk.start + 1 : chunk.start + 1 + n])
        if wanted:
            k = max(r.seq.params.prompt_logprobs for r in wanted)
            tensors.update(prompt_logprobs(logits[self._index(rows)], self._index(next_ids), k))
        return wanted

    def _index(self, values: list[int]) -> torch.Tensor:
        return to_device(values, torch.int64, self.model.device)


def _deferred_tokens(schedule: Schedule, previous: PendingStep) -> DeferredTokens | None:
    """Where this step's inputs are tokens that ``previous`` is still sampling."""
    positions, rows, offset = [], [], 0
    for chunk in schedule.chunks:
        index = previous.token_index.get(chunk.seq)
        if index is not None and chunk.start <= index < chunk.end:
            positions.append(offset + index - chunk.start)
            rows.append(previous.rows[chunk.seq])
        offset += chunk.num_tokens
    if not positions:
        return None
    return DeferredTokens(previous.device_token_ids, tuple(positions), tuple(rows))


def _logprob_at(host: dict[str, list], prefix: str, row: int, k: int | None, token_id: int | None = None):
    if k is None:
        return None
    top = ()
    if k > 0:
        top = tuple(zip(host[f"{prefix}top_token_id"][row][:k], host[f"{prefix}top_logprob"][row][:k]))
    chosen = host[f"{prefix}token_ids"][row] if token_id is None else token_id
    return TokenLogprob(chosen, host[f"{prefix}logprob"][row], top)
