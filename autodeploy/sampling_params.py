"""``SamplingParams``: how one request is decoded (public API, consumed by the engine).

Field names and meanings follow vLLM's ``SamplingParams``, which OpenAI-compatible clients assume.
Values are checked once, here; everything downstream trusts them. The bounds below are what the
engine's tensors can hold (token ids and counts go into int32/int64 tensors, seeds into a
``torch.Generator``); the HTTP request models take their limits from here, so ``/openapi.json``
shows the same numbers.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

MAX_LOGPROBS = 20  # most top-logprobs a request may ask for (OpenAI allows 20 in chat)
MAX_INT32 = 2**31 - 1  # token ids, top_k, max_tokens, min_tokens: int32/int64 tensors and index math
MAX_TOKEN_ID = MAX_INT32
MAX_SEED = 2**63 - 1 - 1024  # seed + choice index (n <= MAX_N) stays a valid Generator seed
MAX_N = 128  # choices per request over HTTP
MAX_REPETITION_PENALTY = 100.0  # logits are divided/multiplied by it in float32
MAX_STOP_TOKEN_IDS = 1024  # stop_token_ids per request (each a set lookup per generated token)
GREEDY_TEMPERATURE = 1e-5  # temperatures below this decode greedily


STRUCTURED_KINDS = ("json", "json_object", "regex", "choice", "grammar")


@dataclass(frozen=True)
class StructuredOutput:
    """A grammar the output must follow, as plain text (it crosses process boundaries as is; the engine
    compiles it, cached, where it samples).

    ``kind`` says how ``spec`` reads: ``json`` a JSON schema (serialized), ``json_object`` any JSON object
    (``spec`` empty), ``regex`` a regular expression, ``choice`` a JSON array of the allowed strings,
    ``grammar`` an EBNF (GBNF) grammar whose start rule is ``root``.
    """

    kind: str
    spec: str = ""

    def __post_init__(self) -> None:
        if self.kind not in STRUCTURED_KINDS:
            raise ValueError(f"structured output kind must be one of {', '.join(STRUCTURED_KINDS)}, got '{self.kind}'")
        if not isinstance(self.spec, str) or (not self.spec and self.kind != "json_object"):
            raise ValueError(f"a '{self.kind}' structured output needs its spec as a non-empty string")


class RequestOutputKind(enum.Enum):
    """When the engine reports a request: a delta after every step that produced tokens
    (streaming), or once, complete, when it finishes (``LLM.generate``, the offline benchmark:
    no per-step report objects, which at hundreds of sequences cost the host more than the rest
    of a step)."""

    DELTA = "delta"
    FINAL_ONLY = "final_only"


@dataclass(frozen=True)
class SamplingParams:
    """Decoding options of one request; invalid combinations raise ``ValueError``.

    ``max_tokens=None`` generates up to the model's ``max_seq_len``. ``top_k`` 0 (or -1) and
    ``top_p`` 1 disable those filters; ``temperature`` 0 is greedy. ``logprobs=k`` returns the
    sampled token's log-probability and the ``k`` most likely ones at each generated position;
    ``prompt_logprobs=k`` does the same for every prompt token after the first. A ``seed`` makes
    sampling reproducible; with ``n > 1`` choice ``i`` uses ``seed + i``. ``output_kind`` says
    whether the request is reported after every step or only when it finishes. ``structured`` constrains
    the output to a grammar (JSON schema, regex, choice, EBNF): each token is sampled among those it allows.
    """

    n: int = 1
    max_tokens: int | None = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    detokenize: bool = True
    output_kind: RequestOutputKind = RequestOutputKind.DELTA
    structured: StructuredOutput | None = None

    def __post_init__(self) -> None:
        # Accept the spellings clients send (a single stop string, lists, top_k=-1), store one form.
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop or ()))
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids or ()))
        if self.top_k == -1:
            object.__setattr__(self, "top_k", 0)
        object.__setattr__(self, "output_kind", RequestOutputKind(self.output_kind))
        if self.structured is not None and not isinstance(self.structured, StructuredOutput):
            raise ValueError(f"structured must be a StructuredOutput, got {type(self.structured).__name__}")
        for problem in _problems(self):
            raise ValueError(problem)

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def uses_penalties(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    @property
    def uses_top_k_top_p(self) -> bool:
        return self.top_k > 0 or self.top_p < 1.0


def _problems(p: SamplingParams):
    """Every reason ``p`` is invalid, as messages naming the field."""
    if p.n < 1:
        yield f"n must be at least 1, got {p.n}"
    if p.max_tokens is not None and p.max_tokens < 1:
        yield f"max_tokens must be at least 1, got {p.max_tokens}"
    if p.min_tokens < 0 or (p.max_tokens is not None and p.min_tokens > p.max_tokens):
        yield f"min_tokens must be in [0, max_tokens], got {p.min_tokens}"
    if not (math.isfinite(p.temperature) and p.temperature >= 0):
        yield f"temperature must be a finite non-negative number, got {p.temperature}"
    if not 0 < p.top_p <= 1:  # (false for NaN too, as below)
        yield f"top_p must be in (0, 1], got {p.top_p}"
    if not 0 <= p.top_k <= MAX_INT32:
        yield f"top_k must be 0 or -1 (disabled) or a positive number up to {MAX_INT32}, got {p.top_k}"
    for name in ("max_tokens", "min_tokens"):
        if (getattr(p, name) or 0) > MAX_INT32:
            yield f"{name} must be at most {MAX_INT32}, got {getattr(p, name)}"
    if not 0 <= p.min_p <= 1:
        yield f"min_p must be in [0, 1], got {p.min_p}"
    for name in ("presence_penalty", "frequency_penalty"):
        if not -2 <= getattr(p, name) <= 2:
            yield f"{name} must be in [-2, 2], got {getattr(p, name)}"
    if not 0 < p.repetition_penalty <= MAX_REPETITION_PENALTY:
        yield f"repetition_penalty must be in (0, {MAX_REPETITION_PENALTY:g}], got {p.repetition_penalty}"
    for name in ("logprobs", "prompt_logprobs"):
        value = getattr(p, name)
        if value is not None and not 0 <= value <= MAX_LOGPROBS:
            yield f"{name} must be in [0, {MAX_LOGPROBS}], got {value}"
    if any(not s for s in p.stop):
        yield "stop strings must not be empty"
    if any(not 0 <= t <= MAX_TOKEN_ID for t in p.stop_token_ids):
        yield f"stop_token_ids must be in [0, {MAX_TOKEN_ID}]"
    if len(p.stop_token_ids) > MAX_STOP_TOKEN_IDS:
        yield f"at most {MAX_STOP_TOKEN_IDS} stop_token_ids, got {len(p.stop_token_ids)}"
    if p.seed is not None and not 0 <= p.seed <= MAX_SEED:
        yield f"seed must be in [0, {MAX_SEED}], got {p.seed}"
