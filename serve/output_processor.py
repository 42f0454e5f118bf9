"""The API process's half of the engine's reports when the engine runs in a process of its own:
detokenization and stop strings.

The engine process sends token ids only (no text, no prompt). Here each choice of a request gets its
:class:`IncrementalDetokenizer`, fed as the engine's deltas arrive, exactly as the engine feeds it
when it runs in this process: the same stop-string search (after ``min_tokens``), the same cut of the
tokens after the one that completed a stop string, the same held-back tail while streaming. A choice
ended here by a stop string is reported finished at once; the engine is told to stop it
(:attr:`Processed.stops`), and whatever it generated for that choice meanwhile is dropped, as is its
own final report of a request that ended here. A detokenizer that raises fails its request alone
(:attr:`Processed.aborts` frees it in the engine).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass, field
from typing import Any

from autodeploy.sampling_params import SamplingParams

from .detokenizer import IncrementalDetokenizer
from .engine_protocol import WireOutput, WireSequence, from_wire
from .outputs import CompletionOutput, RequestOutput

log = logging.getLogger("autodeploy.serve.output_processor")


@dataclass
class _Choice:
    detokenizer: IncrementalDetokenizer | None  # None: no text wanted (detokenize=False, or no tokenizer)
    num_tokens: int = 0  # generated tokens received so far
    finished: bool = False


@dataclass
class _Request:
    prompt_token_ids: tuple[int, ...]
    params: SamplingParams
    choices: list[_Choice]


@dataclass
class Processed:
    outputs: list[RequestOutput] = field(default_factory=list)
    stops: list[tuple[str, int, str]] = field(default_factory=list)  # (request id, choice, stop string)
    aborts: list[str] = field(default_factory=list)  # requests that failed here: free them in the engine


class OutputProcessor:
    """Turns the engine process's token deltas into the reports the handlers stream."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self._requests: dict[str, _Request] = {}
        self._ended_here: set[str] = set()  # finished here; the engine's last report is still to come

    def add(self, request_id: str, prompt_token_ids: tuple[int, ...], params: SamplingParams) -> None:
        tokenizer = self.tokenizer if params.detokenize else None
        choices = [_Choice(IncrementalDetokenizer(tokenizer, prompt_token_ids, params.skip_special_tokens, params.stop,
                                                  params.include_stop_str_in_output) if tokenizer is not None else None)
                   for _ in range(params.n)]
        self._requests[request_id] = _Request(prompt_token_ids, params, choices)

    def forget(self, request_id: str) -> None:
        """The request's stream is gone (its client left): the engine's reports of it pass through."""
        self._requests.pop(request_id, None)

    @property
    def num_requests(self) -> int:
        return len(self._requests)

    def process(self, outputs: list[WireOutput]) -> Processed:
        processed = Processed()
        for wire in outputs:
            if wire.request_id in self._ended_here:
                if wire.finished:
                    self._ended_here.discard(wire.request_id)
                continue
            request = self._requests.get(wire.request_id)
            if request is None or wire.error is not None:  # aborted by its client, or failed in the engine
                self._requests.pop(wire.request_id, None)
                processed.outputs.append(from_wire(wire, request.prompt_token_ids if request else ()))
                continue
            try:
                processed.outputs.append(self._report(wire, request, processed.stops))
            except Exception as exc:  # noqa: BLE001 (this request alone fails)
                processed.outputs.append(self._fail(wire, request, exc))
                processed.aborts.append(wire.request_id)
        return processed

    def _report(self, wire: WireOutput, request: _Request, stops: list) -> RequestOutput:
        choices = tuple(self._choice(wire.request_id, seq, request, stops) for seq in wire.outputs
                        if not request.choices[seq.index].finished)
        finished = all(c.finished for c in request.choices)
        metrics = wire.metrics
        if finished:
            del self._requests[wire.request_id]
            if not wire.finished:
                self._ended_here.add(wire.request_id)
                if metrics is not None:
                    metrics = dataclasses.replace(metrics, finished_time=time.monotonic())
        return RequestOutput(wire.request_id, request.prompt_token_ids, choices, finished,
                             tuple(wire.prompt_logprobs) if wire.prompt_logprobs is not None else None,
                             wire.num_cached_tokens, metrics)

    def _choice(self, request_id: str, seq: WireSequence, request: _Request, stops: list) -> CompletionOutput:
        choice = request.choices[seq.index]
        tokens, logprobs = seq.token_ids, seq.logprobs
        finish_reason, stop_reason = seq.finish_reason, seq.stop_reason
        text = ""
        if choice.detokenizer is not None:
            stopped_by_token = finish_reason == "stop" and not isinstance(stop_reason, str)
            cut = choice.detokenizer.add_tokens(tokens, choice.num_tokens, request.params.min_tokens, stopped_by_token)
            if cut is not None:
                kept = cut[0] - choice.num_tokens
                tokens, logprobs = tokens[:kept], logprobs[:kept] if logprobs is not None else None
                if finish_reason is None:
                    stops.append((request_id, seq.index, cut[1]))
                finish_reason, stop_reason = "stop", cut[1]
        choice.num_tokens += len(tokens)
        choice.finished = finish_reason is not None
        if choice.detokenizer is not None:
            text = choice.detokenizer.take_new_text(choice.finished)
        return CompletionOutput(seq.index, text, tuple(tokens), tuple(logprobs) if logprobs is not None else None,
                                finish_reason, stop_reason)

    def _fail(self, wire: WireOutput, request: _Request, exc: BaseException) -> RequestOutput:
        log.error("request %s failed in the API process (%s: %s); the others go on", wire.request_id,
                  type(exc).__name__, exc, exc_info=exc)
        del self._requests[wire.request_id]
        if not wire.finished:
            self._ended_here.add(wire.request_id)
        return RequestOutput(wire.request_id, request.prompt_token_ids, (), True, metrics=wire.metrics,
                             error=f"{type(exc).__name__}: {exc}")
