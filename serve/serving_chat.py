"""``POST /v1/chat/completions``: messages -> the tokenizer's chat template -> a reply.

Streaming sends, per choice, a first chunk with ``delta: {"role": "assistant", "content": ""}``,
then content deltas, then the finish reason; with ``stream_options.include_usage`` one last chunk
with no choices and the usage. Tool calls (``tools``, ``tool_choice``) and reasoning
(``--reasoning-parser``) are read out of the output by ``chat_output`` (deltas of ``tool_calls`` and
``reasoning_content`` when streaming).
"""

from __future__ import annotations

from typing import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from .chat_output import ChoiceReader, chat_finish_reason
from .errors import bad_request
from .outputs import CompletionOutput, RequestOutput, TokenLogprob
from .protocol import (ChatChoice, ChatCompletionChunk, ChatCompletionRequest, ChatCompletionResponse, ChatLogprobs,
                       ChatStreamChoice, ChatTokenLogprob, ChatTopLogprob, DeltaMessage, UsageInfo, new_id)
from .reasoning import reasoning_parser
from .serving_common import SSE_DONE, ServerState, admit, collect, compile_grammar, sse, sse_error
from .tokenizer import token_strings
from .tools import ToolPlan, plan_tools


async def create_chat_completion(body: ChatCompletionRequest, raw_request: Request, state: ServerState):
    engine = state.require_engine()
    state.check_model(body.model)
    state.limits.check_stop(body.stop)
    state.limits.check_sequences(1, body.n)
    try:
        messages = [m.for_template() for m in body.messages]
    except ValueError as exc:
        raise bad_request(str(exc), "messages") from None
    try:
        plan = plan_tools(body.tools, body.tool_choice, body.parallel_tool_calls, state.tools)
    except ValueError as exc:
        raise bad_request(str(exc), "tool_choice") from None
    prompt_ids = await state.preprocess.chat(
        messages, add_generation_prompt=body.add_generation_prompt, continue_final_message=body.continue_final_message,
        tools=body.template_tools(), chat_template=body.chat_template, template_kwargs=body.chat_template_kwargs,
    )
    params = admit(state, engine, prompt_ids, lambda max_tokens: body.to_sampling_params(max_tokens, plan),
                   body.requested_max_tokens(), "messages")
    await state.preprocess.prepare_stop_strings(params.stop)
    await compile_grammar(state, engine, params)
    request_id = new_id("chatcmpl")
    stream = engine.generate(request_id, prompt_ids, params)
    view = _ChatView(body, state, request_id, plan, params.structured is not None)
    if body.stream:
        return StreamingResponse(view.stream(stream), media_type="text/event-stream")
    (output,) = await collect([stream], raw_request)
    return JSONResponse(view.response(output).model_dump())


class _ChatView:
    def __init__(self, body: ChatCompletionRequest, state: ServerState, request_id: str, plan: ToolPlan,
                 structured: bool):
        self.body, self.state, self.request_id, self.plan = body, state, request_id, plan
        self.structured = structured
        self._readers: dict[int, ChoiceReader] = {}

    def _reader(self, index: int) -> ChoiceReader:
        if index not in self._readers:
            self._readers[index] = ChoiceReader(self.plan, self._reasoning_parser())
        return self._readers[index]

    def _reasoning_parser(self):
        if not self.state.reasoning_parser:
            return None
        parser = reasoning_parser(self.state.reasoning_parser)
        if self.structured:  # a grammar covers the whole output: no </think> means no reasoning at all
            parser.all_reasoning_without_end = False
        return parser

    def response(self, out: RequestOutput) -> ChatCompletionResponse:
        choices = []
        for c in out.outputs:
            message, called = self._reader(c.index).message(c.text)
            choices.append(ChatChoice(index=c.index, message=message, logprobs=self._logprobs(c),
                                      finish_reason=chat_finish_reason(c.finish_reason, self.plan, called),
                                      stop_reason=c.stop_reason))
        completion_tokens = sum(len(c.token_ids) for c in out.outputs)
        return ChatCompletionResponse(id=self.request_id, model=self.state.served_model_name, choices=choices,
                                      usage=_usage(out, completion_tokens))

    async def stream(self, stream: AsyncIterator[RequestOutput]) -> AsyncIterator[str]:
        started: set[int] = set()
        completion_tokens, last = 0, None
        try:
            async for out in stream:
                last = out
                for choice in out.outputs:
                    if choice.index not in started:
                        started.add(choice.index)
                        yield self._chunk(ChatStreamChoice(index=choice.index,
                                                           delta=DeltaMessage(role="assistant", content="")))
                    completion_tokens += len(choice.token_ids)
                    reader = self._reader(choice.index)
                    delta = reader.delta(choice.text, final=choice.finish_reason is not None)
                    finish_reason = chat_finish_reason(choice.finish_reason, self.plan, reader.made_tool_calls)
                    yield self._chunk(ChatStreamChoice(index=choice.index, delta=delta, logprobs=self._logprobs(choice),
                                                       finish_reason=finish_reason, stop_reason=choice.stop_reason))
            if self.body.include_usage and last is not None:
                yield sse(ChatCompletionChunk(id=self.request_id, model=self.state.served_model_name, choices=[],
                                              usage=_usage(last, completion_tokens)))
        except Exception as exc:  # noqa: BLE001 (the status line is sent: report in the stream)
            yield sse_error(exc)
        yield SSE_DONE

    def _chunk(self, choice: ChatStreamChoice) -> str:
        chunk = ChatCompletionChunk(id=self.request_id, model=self.state.served_model_name, choices=[choice])
        return sse(chunk, exclude={"usage"})

    def _logprobs(self, choice: CompletionOutput) -> ChatLogprobs | None:
        if not self.body.logprobs:
            return None
        return ChatLogprobs(content=[self._entry(e) for e in choice.logprobs or ()])

    def _entry(self, entry: TokenLogprob) -> ChatTokenLogprob:
        tokenizer = self.state.tokenizer
        (token,) = token_strings(tokenizer, [entry.token_id])
        top_strings = token_strings(tokenizer, [t for t, _ in entry.top])
        top = [ChatTopLogprob(token=s, logprob=lp, bytes=list(s.encode())) for s, (_, lp) in zip(top_strings, entry.top)]
        return ChatTokenLogprob(token=token, logprob=entry.logprob, bytes=list(token.encode()), top_logprobs=top)


def _usage(out: RequestOutput, completion_tokens: int) -> UsageInfo:
    prompt_tokens = len(out.prompt_token_ids)
    return UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                     total_tokens=prompt_tokens + completion_tokens,
                     prompt_tokens_details={"cached_tokens": out.num_cached_tokens} if out.num_cached_tokens else None)
