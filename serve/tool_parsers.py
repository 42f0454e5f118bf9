"""Tool calls out of generated text: one parser per format, selected by ``--tool-call-parser`` (vLLM's names).

- ``hermes`` (Hermes, Qwen 2.5/3): ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, repeated;
  the text before the first one is the message content.
- ``llama3_json`` (Llama 3.1-3.3): the whole output is ``{"name": ..., "parameters": {...}}`` (after an
  optional ``<|python_tag|>``), several separated by ``;``; an output that starts otherwise is content.
- ``mistral``: ``[TOOL_CALLS]`` then a JSON array of calls, or (newer tokenizers) ``name[ARGS]{...}``.

Two more parse the output of grammar-enforced tool choices: ``required`` (a JSON array of
``{"name", "parameters"}`` objects) and a named function (the output is its arguments).

Each parser reads a prefix of the output (``parse(text, final)``) into the content that is safe to send
(a partial marker at the end is held back) and the calls so far (:class:`~.partial_json.PartialCall`);
:class:`ToolCallStream` turns successive parses into OpenAI's streaming deltas and :func:`extract_tool_calls`
gives the final message's calls (all complete with valid JSON arguments, or none: then the whole text is
content, as vLLM does).
"""

from __future__ import annotations

import secrets
import string
from dataclasses import dataclass, field

from .partial_json import PartialCall, is_valid_json, scan_call, scan_calls, skip_whitespace, value_end


@dataclass(frozen=True)
class ParsedOutput:
    content: str
    calls: list[PartialCall] = field(default_factory=list)


def held_back(text: str, marker: str) -> int:
    """Length of the longest end of ``text`` that may be the start of ``marker`` (not yet sendable)."""
    for length in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-length:]):
            return length
    return 0


def _content_before(text: str, marker: str, final: bool) -> tuple[str, int]:
    """The content before ``marker`` and the marker's index (-1: absent; the held-back tail stays unsent)."""
    index = text.find(marker)
    if index >= 0:
        return text[:index], index
    return (text if final else text[: len(text) - held_back(text, marker)]), -1


class ToolParser:
    """Reads tool calls out of a model's output; ``keeps_special_tokens``: its markers are special tokens."""

    keeps_special_tokens = False

    def parse(self, text: str, final: bool) -> ParsedOutput:
        raise NotImplementedError

    def new_call_id(self) -> str:
        return f"call_{secrets.token_hex(12)}"


class HermesParser(ToolParser):
    START, END = "<tool_call>", "</tool_call>"
    keeps_special_tokens = True

    def parse(self, text: str, final: bool) -> ParsedOutput:
        content, i = _content_before(text, self.START, final)
        calls: list[PartialCall] = []
        while i >= 0 and text.startswith(self.START, i):
            i = skip_whitespace(text, i + len(self.START))
            if i >= len(text):
                break
            if text[i] != "{":
                calls.append(PartialCall(None, "", False))  # not a call: the final extraction rejects it
                break
            call, end = scan_call(text, i)
            calls.append(call)
            if end is None:
                break
            i = skip_whitespace(text, end)
            i = skip_whitespace(text, i + len(self.END)) if text.startswith(self.END, i) else -1
        return ParsedOutput(content, calls)


class Llama3JsonParser(ToolParser):
    TAG = "<|python_tag|>"

    def parse(self, text: str, final: bool) -> ParsedOutput:
        i = skip_whitespace(text, 0)
        if text.startswith(self.TAG, i):
            i = skip_whitespace(text, i + len(self.TAG))
        elif not final and self.TAG.startswith(text[i:]):
            return ParsedOutput("")  # nothing but (the start of) the tag yet
        if i >= len(text):
            return ParsedOutput("" if not final else text)
        if text[i] != "{":
            return ParsedOutput(text)
        calls, end = scan_calls(text, i, ";")
        if end is not None and end < len(text):
            calls.append(PartialCall(None, "", False))  # text after the calls: not this format
        return ParsedOutput("", calls)


class MistralParser(ToolParser):
    MARKER, ARGS = "[TOOL_CALLS]", "[ARGS]"
    keeps_special_tokens = True

    def parse(self, text: str, final: bool) -> ParsedOutput:
        content, i = _content_before(text, self.MARKER, final)
        if i < 0:
            return ParsedOutput(content)
        i = skip_whitespace(text, i + len(self.MARKER))
        if text.startswith("[", i):
            calls, _ = scan_calls(text, i + 1, ",", "]")
            return ParsedOutput(content, calls)
        return ParsedOutput(content, self._name_args_calls(text, i))

    def _name_args_calls(self, text: str, i: int) -> list[PartialCall]:
        calls = []
        while i < len(text):
            args_at = text.find(self.ARGS, i)
            if args_at < 0:
                break
            start = args_at + len(self.ARGS)
            end = value_end(text, start)
            calls.append(PartialCall(text[i:args_at].strip(), text[start:end] if end else text[start:], end is not None))
            if end is None:
                break
            i = skip_whitespace(text, end)
            if text.startswith(self.MARKER, i):
                i = skip_whitespace(text, i + len(self.MARKER))
        return calls

    def new_call_id(self) -> str:
        # Mistral's chat templates require ids of 9 letters and digits
        return "".join(secrets.choice(string.ascii_letters + string.digits) for _ in range(9))


class RequiredCallsParser(ToolParser):
    """``tool_choice: "required"``: the grammar made the output a JSON array of ``{"name", "parameters"}``."""

    def parse(self, text: str, final: bool) -> ParsedOutput:
        i = skip_whitespace(text, 0)
        if i >= len(text) or text[i] != "[":
            return ParsedOutput("", [PartialCall(None, "", False)] if final else [])
        calls, _ = scan_calls(text, i + 1, ",", "]")
        return ParsedOutput("", calls)


class NamedCallParser(ToolParser):
    """A named ``tool_choice``: the grammar made the whole output that function's arguments."""

    def __init__(self, name: str):
        self.name = name

    def parse(self, text: str, final: bool) -> ParsedOutput:
        return ParsedOutput("", [PartialCall(self.name, text, final)])


TOOL_PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesParser,
    "llama3_json": Llama3JsonParser,
    "mistral": MistralParser,
}


def tool_parser(name: str) -> ToolParser:
    try:
        return TOOL_PARSERS[name]()
    except KeyError:
        raise ValueError(f"unknown tool call parser '{name}'; choose one of {', '.join(TOOL_PARSERS)}") from None


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text


def extract_tool_calls(parser: ToolParser, text: str) -> tuple[str | None, list[ToolCall]]:
    """The final message: its content (None when empty) and its calls, all valid, or none (then the whole
    text is content)."""
    parsed = parser.parse(text, final=True)
    calls = [c for c in parsed.calls]
    valid = all(c.complete and c.name and is_valid_json(c.arguments or "{}") for c in calls)
    if not calls or not valid:
        return (text or None), []
    content = parsed.content.strip() or None
    return content, [ToolCall(parser.new_call_id(), c.name, c.arguments or "{}") for c in calls]


@dataclass
class _SentCall:
    id: str
    arguments_sent: int = 0


class ToolCallStream:
    """One choice's streamed message: each :meth:`update` with the text so far gives the new content and
    the tool-call deltas OpenAI's clients expect (a call's id, type and name first, then argument pieces)."""

    def __init__(self, parser: ToolParser):
        self.parser = parser
        self._content_sent = 0
        self._calls: list[_SentCall] = []

    @property
    def num_calls(self) -> int:
        return len(self._calls)

    def update(self, text: str, final: bool = False) -> tuple[str, list[dict]]:
        parsed = self.parser.parse(text, final)
        content = parsed.content[self._content_sent :]
        self._content_sent = max(self._content_sent, len(parsed.content))
        deltas = []
        for index, call in enumerate(parsed.calls):
            if index == len(self._calls):
                if not call.name:
                    break  # its name is still being generated: nothing of it can be sent yet
                self._calls.append(_SentCall(self.parser.new_call_id()))
                deltas.append({"index": index, "id": self._calls[index].id, "type": "function",
                               "function": {"name": call.name, "arguments": ""}})
            sent = self._calls[index]
            if len(call.arguments) > sent.arguments_sent:
                deltas.append({"index": index, "function": {"arguments": call.arguments[sent.arguments_sent :]}})
                sent.arguments_sent = len(call.arguments)
        return content, deltas
