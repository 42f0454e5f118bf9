"""The messages between the API process and the engine process, and their wire format.

Both directions are msgpack through ``msgspec`` (no pickle: a peer's bytes are decoded into these
types only, and a malformed message is an error, not code). A request crosses as its prompt token
ids and its :class:`SamplingParams` (a frozen dataclass msgspec encodes field by field and validates
again on decode); the engine's reports cross as :class:`WireOutput`, a :class:`RequestOutput`
without the prompt token ids (the API process has them; sending them with every step's delta would
cost more than the rest of the message) and without text (the API process detokenizes).
"""

from __future__ import annotations

from typing import Union

import msgspec

from autodeploy.sampling_params import SamplingParams

from .engine import EngineStats
from .outputs import CompletionOutput, RequestMetrics, RequestOutput, TokenLogprob

# ---- API process -> engine process ----------------------------------------------------------------


class AddRequest(msgspec.Struct, tag=True, array_like=True):
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float


class AbortRequests(msgspec.Struct, tag=True, array_like=True):
    request_ids: list[str]


class StopSequences(msgspec.Struct, tag=True, array_like=True):
    """Sequences the API process stopped (a stop string completed in its detokenizer)."""

    stops: list[tuple[str, int, str]]  # (request id, choice index, the stop string)


class Shutdown(msgspec.Struct, tag=True, array_like=True):
    pass


Command = Union[AddRequest, AbortRequests, StopSequences, Shutdown]

# ---- engine process -> API process ----------------------------------------------------------------


class WireSequence(msgspec.Struct, array_like=True):
    index: int
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None


class WireOutput(msgspec.Struct, array_like=True):
    request_id: str
    outputs: list[WireSequence]
    finished: bool
    prompt_logprobs: list[TokenLogprob | None] | None = None
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = None
    error: str | None = None


class EngineInfo(msgspec.Struct, array_like=True):
    """What the API process needs of the engine: the request bounds, the report, the tokenizer's place."""

    pid: int
    model_dir: str  # the resolved checkpoint (a .gguf input converted): the tokenizer's default place
    vocab_size: int
    max_seq_len: int
    max_total_tokens: int
    num_blocks: int
    block_size: int
    report: str
    eos_token_ids: list[int]  # the grammar compiler's stop tokens (structured outputs are checked here too)
    grammar_compile_timeout: float | None


class Ready(msgspec.Struct, tag=True, array_like=True):
    info: EngineInfo


class StartupFailed(msgspec.Struct, tag=True, array_like=True):
    message: str


class StepOutputs(msgspec.Struct, tag=True, array_like=True):
    outputs: list[WireOutput]
    stats: EngineStats | None = None  # the engine's stats after the step (for /metrics and /health)


class Rejected(msgspec.Struct, tag=True, array_like=True):
    """A request the engine could not add: ``client_error`` is a 400 (else a 500)."""

    request_id: str
    message: str
    client_error: bool


class Heartbeat(msgspec.Struct, tag=True, array_like=True):
    stats: EngineStats


class EngineFailed(msgspec.Struct, tag=True, array_like=True):
    """The engine stopped (a device fault, a dead tensor-parallel rank); the process exits after this."""

    message: str


Event = Union[Ready, StartupFailed, StepOutputs, Rejected, Heartbeat, EngineFailed]


class Codec:
    """One encoder and the decoder of what this side receives (``msgspec`` reuses their buffers)."""

    def __init__(self, receives):
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(receives)

    def encode(self, message) -> bytes:
        return self._encoder.encode(message)

    def decode(self, data: bytes):
        return self._decoder.decode(data)


def to_wire(out: RequestOutput) -> WireOutput:
    seqs = [WireSequence(c.index, list(c.token_ids), list(c.logprobs) if c.logprobs is not None else None,
                         c.finish_reason, c.stop_reason) for c in out.outputs]
    prompt_logprobs = list(out.prompt_logprobs) if out.prompt_logprobs is not None else None
    return WireOutput(out.request_id, seqs, out.finished, prompt_logprobs, out.num_cached_tokens, out.metrics,
                      out.error)


def from_wire(out: WireOutput, prompt_token_ids: tuple[int, ...]) -> RequestOutput:
    choices = tuple(CompletionOutput(s.index, "", tuple(s.token_ids), tuple(s.logprobs) if s.logprobs is not None
                                     else None, s.finish_reason, s.stop_reason) for s in out.outputs)
    prompt_logprobs = tuple(out.prompt_logprobs) if out.prompt_logprobs is not None else None
    return RequestOutput(out.request_id, prompt_token_ids, choices, out.finished, prompt_logprobs,
                         out.num_cached_tokens, out.metrics, out.error)
