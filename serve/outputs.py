"""What the engine reports: per-step deltas of each request, and their accumulation.

The engine emits a :class:`RequestOutput` whenever a request's sequences produced tokens or
finished; its ``outputs`` hold only what is new (deltas), so streaming sends them as they are.
:class:`OutputAccumulator` merges the deltas of one request into the final result (offline
``LLM.generate`` and non-streaming HTTP responses).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace


@dataclass(frozen=True)
class TokenLogprob:
    """Log-probability of one chosen token and the most likely alternatives at that position."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # (token id, logprob), most likely first


@dataclass(frozen=True)
class CompletionOutput:
    """One choice (sequence) of a request. In a delta, only what is new since the last report."""

    index: int
    text: str
    token_ids: tuple[int, ...]
    logprobs: tuple[TokenLogprob, ...] | None = None
    finish_reason: str | None = None  # "stop", "length", "abort"
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(frozen=True)
class RequestMetrics:
    """Timestamps of one request (``time.monotonic()`` seconds); ``finished_time`` once finished."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None


@dataclass(frozen=True)
class RequestOutput:
    """A report about one request: new text/tokens of its choices, and whether all finished."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    outputs: tuple[CompletionOutput, ...]
    finished: bool
    prompt_logprobs: tuple[TokenLogprob | None, ...] | None = None  # first entry None (nothing before it)
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = None
    error: str | None = None  # the request failed in the engine (the others go on); finished is true


@dataclass
class OutputAccumulator:
    """Merges the delta reports of one request into complete choices."""

    request_id: str
    prompt_token_ids: tuple[int, ...] = ()
    prompt_logprobs: tuple[TokenLogprob | None, ...] | None = None
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = None
    finished: bool = False
    choices: dict[int, CompletionOutput] = field(default_factory=dict)

    def add(self, delta: RequestOutput) -> None:
        self.prompt_token_ids = delta.prompt_token_ids
        self.prompt_logprobs = delta.prompt_logprobs or self.prompt_logprobs
        self.num_cached_tokens = max(self.num_cached_tokens, delta.num_cached_tokens)
        self.metrics = delta.metrics or self.metrics
        self.finished = delta.finished
        for out in delta.outputs:
            self.choices[out.index] = _merge(self.choices.get(out.index), out)

    def result(self) -> RequestOutput:
        return RequestOutput(
            request_id=self.request_id,
            prompt_token_ids=self.prompt_token_ids,
            outputs=tuple(self.choices[i] for i in sorted(self.choices)),
            finished=self.finished,
            prompt_logprobs=self.prompt_logprobs,
            num_cached_tokens=self.num_cached_tokens,
            metrics=self.metrics,
        )


def _merge(old: CompletionOutput | None, new: CompletionOutput) -> CompletionOutput:
    if old is None:
        return new
    logprobs = None if old.logprobs is None and new.logprobs is None else (old.logprobs or ()) + (new.logprobs or ())
    return replace(
        old,
        text=old.text + new.text,
        token_ids=old.token_ids + new.token_ids,
        logprobs=logprobs,
        finish_reason=new.finish_reason,
        stop_reason=new.stop_reason,
    )
