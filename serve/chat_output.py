"""One chat choice's output read as a message: reasoning (``--reasoning-parser``), then tool calls (the
request's :class:`~.tools.ToolPlan`) out of what remains, the rest content; whole, or as streaming deltas."""

from __future__ import annotations

from .protocol import ChatMessageOut, DeltaMessage, FunctionCallOut, ToolCallOut
from .reasoning import ReasoningParser, ReasoningStream
from .tool_parsers import ToolCallStream, extract_tool_calls
from .tools import ToolPlan


class ChoiceReader:
    """Reads one choice; make one per choice (streaming keeps what was sent)."""

    def __init__(self, plan: ToolPlan, reasoning: ReasoningParser | None):
        self.plan, self.reasoning = plan, reasoning
        self._text = ""
        self._content_sent = 0
        self._reasoning_stream = ReasoningStream(reasoning) if reasoning is not None else None
        self._tool_stream = ToolCallStream(plan.parser) if plan.parser is not None else None

    @property
    def plain(self) -> bool:
        return self.reasoning is None and self.plan.parser is None

    def message(self, text: str) -> tuple[ChatMessageOut, bool]:
        """The whole message, and whether it holds tool calls."""
        reasoning, content = self.reasoning.split(text, final=True) if self.reasoning is not None else (None, text)
        calls = []
        if self.plan.parser is not None:
            content, calls = extract_tool_calls(self.plan.parser, content)
        tool_calls = [ToolCallOut(id=c.id, function=FunctionCallOut(name=c.name, arguments=c.arguments)) for c in calls]
        return ChatMessageOut(content=content, reasoning_content=reasoning or None, tool_calls=tool_calls), bool(calls)

    def delta(self, text: str, final: bool) -> DeltaMessage:
        """The delta of ``text`` (the new text of this output); ``final``: the choice's last output."""
        if self.plain:
            return DeltaMessage(content=text)
        self._text += text
        reasoning, content = (self._reasoning_stream.update(self._text, final) if self._reasoning_stream is not None
                              else ("", self._text))
        calls: list[dict] = []
        if self._tool_stream is not None:
            new_content, calls = self._tool_stream.update(content, final)
        else:
            new_content = content[self._content_sent :]
            self._content_sent = max(self._content_sent, len(content))
        quiet = not (reasoning or calls)
        return DeltaMessage(content=new_content if new_content or quiet else None, reasoning_content=reasoning or None,
                            tool_calls=calls or None)

    @property
    def made_tool_calls(self) -> bool:
        return self._tool_stream is not None and self._tool_stream.num_calls > 0


def chat_finish_reason(reason: str | None, plan: ToolPlan, made_tool_calls: bool) -> str | None:
    """``tool_calls`` when a choice stopped after calling tools (auto and required choices, as OpenAI)."""
    if reason == "stop" and made_tool_calls and plan.finish_as_tool_calls:
        return "tool_calls"
    return reason
