"""``POST /v1/completions``: prompts (text or token ids, one or many) -> completions.

Choice ``i * n + j`` is choice ``j`` of prompt ``i``. With ``echo`` the prompt text comes first,
and with ``echo`` and ``logprobs`` the prompt tokens' log-probabilities too, the first one null
(lm-eval's loglikelihood relies on this).
"""

from __future__ import annotations

import asyncio
from typing import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from .errors import bad_request
from .outputs import CompletionOutput, RequestOutput, TokenLogprob
from .protocol import (CompletionChoice, CompletionLogprobs, CompletionRequest, CompletionResponse, UsageInfo,
                       new_id)
from .serving_common import SSE_DONE, ServerState, admit, collect, compile_grammar, merge_streams, sse, sse_error
from .tokenizer import token_strings


async def create_completion(body: CompletionRequest, raw_request: Request, state: ServerState):
    engine = state.require_engine()
    state.check_model(body.model)
    try:
        prompts = body.prompts()
    except ValueError as exc:
        raise bad_request(str(exc), "prompt") from None
    state.limits.check_stop(body.stop)
    state.limits.check_sequences(len(prompts), body.n)
    token_lists = await asyncio.gather(*(state.preprocess.encode(p, body.add_special_tokens) for p in prompts))
    params = [admit(state, engine, ids, body.to_sampling_params, body.max_tokens, "prompt") for ids in token_lists]
    await state.preprocess.prepare_stop_strings(params[0].stop)
    await compile_grammar(state, engine, params[0])
    request_id = new_id("cmpl")
    streams = [engine.generate(f"{request_id}-{i}", ids, p) for i, (ids, p) in enumerate(zip(token_lists, params))]
    view = _CompletionView(body, state, request_id, prompts)
    if body.stream:
        return StreamingResponse(view.stream(streams), media_type="text/event-stream")
    outputs = await collect(streams, raw_request)
    return JSONResponse(view.response(outputs).model_dump())


class _CompletionView:
    """Formats engine outputs of one completion request, streamed or whole."""

    def __init__(self, body: CompletionRequest, state: ServerState, request_id: str, prompts: list):
        self.body, self.state, self.request_id, self.prompts = body, state, request_id, prompts
        self.n = body.n
        self._offsets: dict[tuple[int, int], int] = {}

    def response(self, outputs: list[RequestOutput]) -> CompletionResponse:
        choices, completion_tokens = [], 0
        for i, out in enumerate(outputs):
            for choice in out.outputs:
                choices.append(self._choice(i, out, choice, first=True))
                completion_tokens += len(choice.token_ids)
        return CompletionResponse(id=self.request_id, model=self.state.served_model_name, choices=choices,
                                  usage=self._usage(outputs, completion_tokens))

    async def stream(self, streams) -> AsyncIterator[str]:
        prompt_tokens, completion_tokens, seen = {}, 0, set()
        try:
            async for i, out in merge_streams(streams):
                prompt_tokens[i] = len(out.prompt_token_ids)
                choices = []
                for choice in out.outputs:
                    key = (i, choice.index)
                    choices.append(self._choice(i, out, choice, first=key not in seen))
                    seen.add(key)
                    completion_tokens += len(choice.token_ids)
                if choices:
                    chunk = CompletionResponse(id=self.request_id, model=self.state.served_model_name, choices=choices)
                    yield sse(chunk, exclude={"usage"})
            if self.body.include_usage:
                usage = UsageInfo(prompt_tokens=sum(prompt_tokens.values()), completion_tokens=completion_tokens,
                                  total_tokens=sum(prompt_tokens.values()) + completion_tokens)
                yield sse(CompletionResponse(id=self.request_id, model=self.state.served_model_name, choices=[],
                                             usage=usage))
        except Exception as exc:  # noqa: BLE001 (the status line is sent: report in the stream)
            yield sse_error(exc)
        yield SSE_DONE

    def _choice(self, i: int, out: RequestOutput, choice: CompletionOutput, first: bool) -> CompletionChoice:
        echo = self.body.echo and first
        text = (self._prompt_text(i, out) if echo else "") + choice.text
        logprobs = None
        if self.body.logprobs is not None:
            entries: list[TokenLogprob | None] = list(choice.logprobs or ())
            ids = [e.token_id for e in entries]
            if echo:
                prompt_entries = list(out.prompt_logprobs or [None] * len(out.prompt_token_ids))
                entries, ids = [None] + prompt_entries[1:] + entries, list(out.prompt_token_ids) + ids
            logprobs = self._logprobs((i, choice.index), entries, ids)
        return CompletionChoice(index=i * self.n + choice.index, text=text, logprobs=logprobs,
                                finish_reason=choice.finish_reason, stop_reason=choice.stop_reason)

    def _prompt_text(self, i: int, out: RequestOutput) -> str:
        prompt = self.prompts[i]
        if isinstance(prompt, str):
            return prompt
        tokenizer = self.state.tokenizer
        return tokenizer.decode(list(out.prompt_token_ids)) if tokenizer is not None else ""

    def _logprobs(self, key: tuple[int, int], entries: list[TokenLogprob | None], ids: list[int]) -> CompletionLogprobs:
        """The OpenAI completions shape; ``text_offset`` continues across a stream's chunks."""
        tokenizer = self.state.tokenizer
        strings = token_strings(tokenizer, ids)
        result = CompletionLogprobs(tokens=strings)
        offset = self._offsets.get(key, 0)
        for entry, token in zip(entries, strings):
            result.text_offset.append(offset)
            offset += len(token)
            if entry is None:
                result.token_logprobs.append(None)
                result.top_logprobs.append(None)
                continue
            result.token_logprobs.append(entry.logprob)
            top: dict[str, float] = {}
            for text, (_, logprob) in zip(token_strings(tokenizer, [t for t, _ in entry.top]), entry.top):
                top.setdefault(text, logprob)  # tokens with the same text: keep the likelier
            top.setdefault(token, entry.logprob)  # the chosen token is always listed
            result.top_logprobs.append(top)
        self._offsets[key] = offset
        return result

    def _usage(self, outputs: list[RequestOutput], completion_tokens: int) -> UsageInfo:
        prompt_tokens = sum(len(o.prompt_token_ids) for o in outputs)
        cached = sum(o.num_cached_tokens for o in outputs)
        return UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                         total_tokens=prompt_tokens + completion_tokens,
                         prompt_tokens_details={"cached_tokens": cached} if cached else None)
