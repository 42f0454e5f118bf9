"""Tool calling in ``/v1/chat/completions``: the request's ``tools`` and ``tool_choice``, and how the reply is read.

- ``none``: the tools still reach the chat template (as in vLLM), the reply is plain content.
- ``auto`` (the default when tools are given): the model decides; its output is read by the server's
  ``--tool-call-parser``, which needs ``--enable-auto-tool-choice`` (as vLLM: a 400 otherwise).
- ``required``: the grammar engine forces a JSON array of at least one ``{"name", "parameters"}`` object,
  ``name`` one of the tools and ``parameters`` its schema (one call only with ``parallel_tool_calls: false``).
- a named function: the grammar forces that function's arguments (its ``parameters`` schema).

``required`` and named choices work with any model and need no parser flag: the output cannot be anything
else. Tools are rendered by the model's chat template (``apply_chat_template(tools=...)``); a template that
ignores them leaves the model unaware of them, though ``required``/named still produce valid calls.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from autodeploy.sampling_params import StructuredOutput

from .tool_parsers import NamedCallParser, RequiredCallsParser, ToolParser, tool_parser

ANY_OBJECT: dict[str, Any] = {"type": "object"}


class _Loose(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)


class FunctionDefinition(_Loose):
    name: str = Field(pattern=r"^[a-zA-Z0-9_.\-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDefinition(_Loose):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class FunctionName(_Loose):
    name: str


class NamedToolChoice(_Loose):
    type: Literal["function"] = "function"
    function: FunctionName


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


@dataclass(frozen=True)
class ToolSettings:
    """The server's tool-calling flags (vLLM's)."""

    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None


@dataclass(frozen=True)
class ToolPlan:
    """How one request's output is read: the grammar that forces tool calls (if any), the parser, whether
    the finish reason becomes ``tool_calls`` when calls come out, and whether special tokens must stay in
    the text (the parser's markers are special tokens)."""

    structured: StructuredOutput | None
    parser: ToolParser | None
    finish_as_tool_calls: bool
    keep_special_tokens: bool = False


NO_TOOLS = ToolPlan(None, None, False)


def plan_tools(tools: list[ToolDefinition] | None, choice: ToolChoice | None, parallel: bool | None,
               settings: ToolSettings) -> ToolPlan:
    """``ValueError`` (a 400) for a choice this server or request cannot honour."""
    if not tools:
        if choice not in (None, "none"):
            raise ValueError("tool_choice needs tools")
        return NO_TOOLS
    choice = "auto" if choice is None else choice
    if choice == "none":
        return NO_TOOLS
    if choice == "auto":
        if not (settings.enable_auto_tool_choice and settings.tool_call_parser):
            raise ValueError('"auto" tool choice requires the server to run with --enable-auto-tool-choice and '
                             '--tool-call-parser (or send tool_choice "required", a named function, or "none")')
        parser = tool_parser(settings.tool_call_parser)
        return ToolPlan(None, parser, True, parser.keeps_special_tokens)
    if choice == "required":
        return ToolPlan(StructuredOutput("json", json.dumps(required_calls_schema(tools, parallel))),
                        RequiredCallsParser(), True)
    function = next((t.function for t in tools if t.function.name == choice.function.name), None)
    if function is None:
        raise ValueError(f"tool_choice names the function '{choice.function.name}', which is not among the tools")
    return ToolPlan(StructuredOutput("json", json.dumps(function.parameters or ANY_OBJECT)),
                    NamedCallParser(function.name), False)


def required_calls_schema(tools: list[ToolDefinition], parallel: bool | None) -> dict[str, Any]:
    """The JSON schema of a non-empty array of calls of these tools (at most one when not parallel)."""
    calls = [{"type": "object",
              "properties": {"name": {"type": "string", "enum": [t.function.name]},
                             "parameters": t.function.parameters or ANY_OBJECT},
              "required": ["name", "parameters"], "additionalProperties": False} for t in tools]
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": calls[0] if len(calls) == 1 else {"anyOf": calls}}
    if parallel is False:
        schema["maxItems"] = 1
    return schema


def message_for_template(message: dict[str, Any]) -> dict[str, Any]:
    """An assistant message's ``tool_calls`` as chat templates read them (HF's convention: ``arguments`` a
    dict, content a string), and a tool message's fields unchanged."""
    calls = message.get("tool_calls")
    if not calls:
        return message
    if not isinstance(calls, list):
        raise ValueError("an assistant message's tool_calls must be a list")
    converted = []
    for call in calls:
        function = dict((call or {}).get("function") or {})
        if not isinstance(function.get("name"), str):
            raise ValueError("every tool call in the messages needs function.name")
        arguments = function.get("arguments", "{}")
        if isinstance(arguments, str):
            try:
                function["arguments"] = json.loads(arguments or "{}")
            except json.JSONDecodeError as exc:
                raise ValueError(f"tool call arguments of '{function['name']}' are not valid JSON: {exc}") from None
        converted.append({**call, "function": function})
    return {**message, "content": message.get("content") or "", "tool_calls": converted}
