"""Reasoning out of generated text: ``<think>`` ... ``</think>`` becomes ``reasoning_content``, selected by
``--reasoning-parser`` (vLLM's names).

- ``deepseek_r1``: everything before ``</think>`` is reasoning (the chat template may already have written
  ``<think>`` into the prompt, so the output need not start with it); an output without ``</think>`` is all
  reasoning (cut off while thinking).
- ``qwen3``: reasoning only in an output that starts with ``<think>`` or has ``</think>``; otherwise
  (``enable_thinking: false`` in ``chat_template_kwargs``) the whole output is content. (A template that
  writes ``<think>`` into the prompt needs ``deepseek_r1``: streamed, its reasoning would start as content.)

``split(text, final)`` reads a prefix of the output into (reasoning, content), holding back the end of the
text that may be the start of ``</think>``; :class:`ReasoningStream` turns successive splits into deltas.
The content then goes through the tool-call parser, if any.
"""

from __future__ import annotations

from .tool_parsers import held_back

START, END = "<think>", "</think>"


class ReasoningParser:
    all_reasoning_without_end = True  # deepseek_r1: no end marker means the model is (still) thinking

    def split(self, text: str, final: bool) -> tuple[str, str]:
        stripped = text.lstrip()
        if not final and START.startswith(stripped):
            return "", ""  # nothing yet, or the start of <think>
        end = text.find(END)
        if end >= 0:
            return _strip_start(text[:end]), text[end + len(END) :].lstrip("\n")
        if not (self.all_reasoning_without_end or stripped.startswith(START)):
            return "", text
        body = _strip_start(text)
        return (body if final else body[: len(body) - held_back(body, END)]), ""


class Qwen3ReasoningParser(ReasoningParser):
    all_reasoning_without_end = False


def _strip_start(text: str) -> str:
    stripped = text.lstrip()
    return stripped[len(START) :].lstrip("\n") if stripped.startswith(START) else text


REASONING_PARSERS: dict[str, type[ReasoningParser]] = {"deepseek_r1": ReasoningParser, "qwen3": Qwen3ReasoningParser}


def reasoning_parser(name: str) -> ReasoningParser:
    try:
        return REASONING_PARSERS[name]()
    except KeyError:
        raise ValueError(f"unknown reasoning parser '{name}'; choose one of {', '.join(REASONING_PARSERS)}") from None


class ReasoningStream:
    """One choice's streamed split: :meth:`update` with the text so far gives (new reasoning, content so far)."""

    def __init__(self, parser: ReasoningParser):
        self.parser = parser
        self._reasoning_sent = 0

    def update(self, text: str, final: bool = False) -> tuple[str, str]:
        reasoning, content = self.parser.split(text, final)
        new = reasoning[self._reasoning_sent :]
        self._reasoning_sent = max(self._reasoning_sent, len(reasoning))
        return new, content
