"""Reading a function call out of JSON text that is still being generated.

A tool call arrives token by token: ``{"name": "get_weather", "arguments": {"city": "Pa``. The scanner here
finds, in a prefix of JSON text, the call's name once its string is complete and the raw text of its
arguments so far. Streaming sends the name once, then the arguments' raw text piece by piece: every piece
is a prefix of the final arguments text (the text only grows and the value's start does not move), so the
pieces concatenate to exactly the final, valid JSON.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

NAME_KEYS = ("name",)
ARGUMENT_KEYS = ("arguments", "parameters")
WHITESPACE = " \t\n\r"


@dataclass(frozen=True)
class PartialCall:
    """A function call as far as it has been generated. ``arguments``: raw JSON text (a prefix of it while
    ``complete`` is false); ``complete``: the call's object (and so both fields) has been closed."""

    name: str | None
    arguments: str
    complete: bool


def skip_whitespace(text: str, i: int) -> int:
    while i < len(text) and text[i] in WHITESPACE:
        i += 1
    return i


def string_end(text: str, i: int) -> int | None:
    """Index after the string literal starting at ``text[i] == '"'``; None while it is unfinished."""
    i += 1
    while i < len(text):
        if text[i] == "\\":
            i += 2
            continue
        if text[i] == '"':
            return i + 1
        i += 1
    return None


def value_end(text: str, i: int) -> int | None:
    """Index after the JSON value starting at ``text[i]``; None while it is unfinished (a number at the
    very end of the text may still grow, so it is unfinished too)."""
    if i >= len(text):
        return None
    if text[i] == '"':
        return string_end(text, i)
    if text[i] in "{[":
        depth = 0
        while i < len(text):
            char = text[i]
            if char == '"':
                end = string_end(text, i)
                if end is None:
                    return None
                i = end
                continue
            if char in "{[":
                depth += 1
            elif char in "}]":
                depth -= 1
                if depth == 0:
                    return i + 1
            i += 1
        return None
    while i < len(text) and text[i] not in ",}]" + WHITESPACE:
        i += 1
    return i if i < len(text) else None


def scan_call(text: str, i: int) -> tuple[PartialCall, int | None]:
    """The call whose JSON object starts at ``text[i] == '{'``, and the index after it (None: unfinished).
    A call whose arguments are a JSON string (some models quote them) gives that string's content once
    it is complete."""
    name, arguments, i = None, "", i + 1
    while True:
        i = skip_whitespace(text, i)
        if i >= len(text):
            return PartialCall(name, arguments, False), None
        if text[i] == "}":
            return PartialCall(name, arguments, True), i + 1
        if text[i] == ",":
            i += 1
            continue
        key_end = string_end(text, i) if text[i] == '"' else None
        if key_end is None:
            return PartialCall(name, arguments, False), None
        key = json.loads(text[i:key_end])
        i = skip_whitespace(text, key_end)
        if i >= len(text) or text[i] != ":":
            return PartialCall(name, arguments, False), None
        start = skip_whitespace(text, i + 1)
        end = value_end(text, start)
        if key in NAME_KEYS and end is not None:
            value = json.loads(text[start:end])
            name = value if isinstance(value, str) else None  # (a call named by a number is not a call)
        elif key in ARGUMENT_KEYS:
            arguments = _arguments_text(text[start:end] if end is not None else text[start:], end is not None)
        if end is None:
            return PartialCall(name, arguments, False), None
        i = end


def _arguments_text(raw: str, complete: bool) -> str:
    if not raw.startswith('"'):
        return raw
    return json.loads(raw) if complete else ""  # a quoted arguments string is sent whole, once complete


def scan_calls(text: str, i: int, separator: str, closing: str = "") -> tuple[list[PartialCall], int | None]:
    """Consecutive call objects from ``text[i]``, separated by ``separator`` (and whitespace), up to
    ``closing`` (or the end of the text); returns them and the index after ``closing`` (None: unfinished)."""
    calls: list[PartialCall] = []
    while True:
        i = skip_whitespace(text, i)
        if i >= len(text):
            return calls, None
        if closing and text.startswith(closing, i):
            return calls, i + len(closing)
        if separator and text.startswith(separator, i):
            i += len(separator)
            continue
        if text[i] != "{":
            return calls, i  # not a call: the caller decides (trailing text, or an invalid output)
        call, end = scan_call(text, i)
        calls.append(call)
        if end is None:
            return calls, None
        i = end


def is_valid_json(text: str) -> bool:
    try:
        json.loads(text)
    except (json.JSONDecodeError, TypeError):
        return False
    return True
