"""What a step's sequences report: their new tokens detokenized (a stop string found there ends the
sequence), and each request's delta ``RequestOutput`` since its last report, with its metrics.

The engine (``engine.py``) calls these for every sequence of every step with per-step reports: they
read plain attributes, no properties, and copy only what is new."""

from __future__ import annotations

import time
from collections.abc import Callable

from .outputs import CompletionOutput, RequestMetrics, RequestOutput
from .sequence import Sequence, Status

Finish = Callable[[Sequence, str, str | int | None], None]


def detokenize(seq: Sequence, finish: Finish) -> None:
    """Feed the sequence's new tokens to its detokenizer; a completed stop string cuts the sequence
    there and, if it was still running, ends it through ``finish`` (the scheduler's bookkeeping)."""
    if seq.detokenizer.tokenizer is None:  # detokenize=False: no text, so no stop string to find
        seq.num_detokenized = len(seq.token_ids) - len(seq.request.prompt_token_ids)
        return
    new = seq.token_ids[seq.num_prompt_tokens + seq.num_detokenized :]  # not output_token_ids: no full copy
    stopped_by_token = seq.finish_reason == "stop" and not isinstance(seq.stop_reason, str)
    cut = seq.detokenizer.add_tokens(new, seq.num_detokenized, seq.params.min_tokens, stopped_by_token)
    if cut is not None:
        produced, stop = cut
        del seq.token_ids[seq.num_prompt_tokens + produced :]
        del seq.logprobs[produced:]
        if seq.is_finished:
            seq.finish_reason, seq.stop_reason = "stop", stop
        else:
            finish(seq, "stop", stop)
    seq.num_detokenized = seq.num_output_tokens


def request_output(request_id: str, seqs: list[Sequence]) -> RequestOutput:
    """The delta report of one request's sequences (``finished`` once all of them have)."""
    num_prompt = len(seqs[0].request.prompt_token_ids)
    outputs = tuple(_delta(s, num_prompt) for s in seqs
                    if s.num_reported < len(s.token_ids) - num_prompt
                    or (s.status is Status.FINISHED and not s.reported_finish))
    first = seqs[0]
    prompt_logprobs = None
    if first.prompt_logprobs is not None and not first.sent_prompt_logprobs and first.num_reported > 0:
        prompt_logprobs, first.sent_prompt_logprobs = tuple(first.prompt_logprobs), True
    finished = all(s.status is Status.FINISHED for s in seqs)
    return RequestOutput(request_id, first.request.prompt_token_ids, outputs, finished, prompt_logprobs,
                         first.num_cached_tokens, request_metrics(seqs, finished))


def _delta(seq: Sequence, num_prompt: int) -> CompletionOutput:
    finished = seq.status is Status.FINISHED
    start = seq.num_reported
    seq.num_reported, seq.reported_finish = len(seq.token_ids) - num_prompt, finished
    return CompletionOutput(
        index=seq.index,
        text=seq.detokenizer.take_new_text(finished),
        token_ids=tuple(seq.token_ids[num_prompt + start :]),
        logprobs=tuple(seq.logprobs[start:]) if seq.request.params.logprobs is not None else None,
        finish_reason=seq.finish_reason,
        stop_reason=seq.stop_reason,
    )


def request_metrics(seqs: list[Sequence], finished: bool) -> RequestMetrics:
    if len(seqs) == 1:  # the common case, on the per-token path
        seq = seqs[0]
        return RequestMetrics(seq.request.arrival_time, seq.first_scheduled_time, seq.first_token_time,
                              time.monotonic() if finished else None)
    return RequestMetrics(
        arrival_time=seqs[0].request.arrival_time,
        first_scheduled_time=min((s.first_scheduled_time for s in seqs if s.first_scheduled_time), default=None),
        first_token_time=min((s.first_token_time for s in seqs if s.first_token_time), default=None),
        finished_time=time.monotonic() if finished else None,
    )
