"""Requests and their sequences: the engine's mutable per-request state.

A request with ``n`` choices owns ``n`` sequences that share the prompt. A sequence is a growing
list of token ids (prompt, then generated) plus how many of them are in the KV cache
(``num_computed``) and the blocks that hold them. Prefill, chunked prefill, decode and recompute
after preemption are all the same thing: run ``token_ids[num_computed:]`` (or a chunk of it).

With async scheduling the last token id may still be on the device (sampled by the step in flight):
it is a placeholder until the engine resolves it, and ``num_pending_tokens`` says so.
"""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field
from typing import Any

import torch

from autodeploy.sampling_params import SamplingParams

from .detokenizer import IncrementalDetokenizer
from .outputs import TokenLogprob

_seq_counter = itertools.count()


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(frozen=True)
class Request:
    """What was asked: immutable for the life of the request."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    params: SamplingParams
    arrival_time: float
    eos_token_ids: frozenset[int] = frozenset()
    max_total_tokens: int = 0  # prompt + generated tokens may not exceed this
    stop_token_ids: frozenset[int] = frozenset()  # params.stop_token_ids as a set: one lookup per token


@dataclass(eq=False)
class Sequence:
    """One choice of a request, as the scheduler and sampler see it."""

    request: Request
    index: int
    token_ids: list[int]
    detokenizer: IncrementalDetokenizer
    generator: torch.Generator | None = None
    seq_id: int = field(default_factory=lambda: next(_seq_counter))
    status: Status = Status.WAITING
    num_computed: int = 0
    num_pending_tokens: int = 0  # trailing token ids that the step in flight is still sampling
    block_ids: list[int] = field(default_factory=list)
    block_keys: list[bytes] = field(default_factory=list)
    state_slot: int = -1  # its slot in the state pool while running (models with recurrent/conv state)
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache at first admission
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob | None] | None = None  # filled while prefilling when asked
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    num_detokenized: int = 0  # generated tokens already fed to the detokenizer
    num_reported: int = 0  # generated tokens already reported
    reported_finish: bool = False
    sent_prompt_logprobs: bool = False
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None

    @property
    def params(self) -> SamplingParams:
        return self.request.params

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.request.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_uncomputed(self) -> int:
        return len(self.token_ids) - self.num_computed

    @property
    def awaits_last_token(self) -> bool:
        """Its final token is still being sampled: there is nothing left to schedule for it."""
        return self.num_pending_tokens > 0 and self.num_tokens >= self.request.max_total_tokens

    def drop_pending_tokens(self) -> None:
        if self.num_pending_tokens:
            del self.token_ids[-self.num_pending_tokens :]
            self.num_pending_tokens = 0

    @property
    def is_finished(self) -> bool:
        return self.status is Status.FINISHED

    @property
    def wants_prompt_logprobs(self) -> bool:
        """Still collecting prompt log-probabilities (only the first choice collects them)."""
        return (
            self.params.prompt_logprobs is not None
            and self.index == 0
            and (self.prompt_logprobs is None or len(self.prompt_logprobs) < self.num_prompt_tokens)
        )


def new_sequences(request: Request, tokenizer: Any) -> list[Sequence]:
    """The ``n`` sequences of a request, each with its own detokenizer and (seeded) generator."""
    params = request.params
    return [
        Sequence(
            request=request,
            index=i,
            token_ids=list(request.prompt_token_ids),
            detokenizer=IncrementalDetokenizer(
                tokenizer if params.detokenize else None,
                request.prompt_token_ids,
                params.skip_special_tokens,
                params.stop,
                params.include_stop_str_in_output,
            ),
        )
        for i in range(params.n)
    ]
