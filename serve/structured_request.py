"""The request fields that ask for structured output, as OpenAI and vLLM spell them, -> one ``StructuredOutput``.

- OpenAI: ``response_format: {"type": "json_object"}`` or ``{"type": "json_schema", "json_schema": {"name",
  "schema", "strict"}}`` (the schema is enforced whether ``strict`` is set or not);
- vLLM's ``structured_outputs: {"json" | "regex" | "choice" | "grammar" | "json_object"}``, and its older
  ``guided_json`` / ``guided_regex`` / ``guided_choice`` / ``guided_grammar`` (EBNF/GBNF).

At most one of them per request; anything this server cannot honour is a ``ValueError`` (a 400) naming it.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from autodeploy.sampling_params import StructuredOutput

BACKENDS = (None, "auto", "xgrammar")


class _Loose(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False, populate_by_name=True)


class JsonSchemaFormat(_Loose):
    name: str = Field("response", max_length=64)
    description: str | None = None
    schema_: dict[str, Any] | bool | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Loose):
    type: Literal["text", "json_object", "json_schema", "structural_tag"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsParams(_Loose):
    """vLLM's ``structured_outputs`` request field."""

    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: Any = None
    whitespace_pattern: str | None = None


class StructuredFields(_Loose):
    """Mixed into the completion and chat request models."""

    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsParams | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None
    guided_whitespace_pattern: str | None = None

    def structured_output(self) -> StructuredOutput | None:
        """The one grammar these fields ask for (None: free text); ``ValueError`` for what is refused."""
        if self.guided_decoding_backend not in BACKENDS:
            raise ValueError(f"guided_decoding_backend '{self.guided_decoding_backend}' is not available: this server "
                             "uses xgrammar")
        if self.guided_whitespace_pattern is not None:
            raise ValueError("guided_whitespace_pattern is not supported (xgrammar decides the whitespace)")
        asked = [(name, spec) for name, spec in self._candidates() if spec is not None]
        if len(asked) > 1:
            raise ValueError(f"ask for one structured output at a time, got {', '.join(name for name, _ in asked)}")
        return asked[0][1] if asked else None

    def _candidates(self):
        yield "response_format", _from_response_format(self.response_format)
        if self.structured_outputs is not None:
            yield "structured_outputs", _from_structured_outputs(self.structured_outputs)
        yield "guided_json", None if self.guided_json is None else _json_schema(self.guided_json, "guided_json")
        yield "guided_regex", None if self.guided_regex is None else StructuredOutput("regex", self.guided_regex)
        yield "guided_choice", None if self.guided_choice is None else _choice(self.guided_choice, "guided_choice")
        yield "guided_grammar", None if self.guided_grammar is None else StructuredOutput("grammar", self.guided_grammar)


def _from_response_format(fmt: ResponseFormat | None) -> StructuredOutput | None:
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return StructuredOutput("json_object")
    if fmt.type == "structural_tag":
        raise ValueError("response_format type 'structural_tag' is not supported")
    if fmt.json_schema is None or fmt.json_schema.schema_ is None:
        raise ValueError("response_format of type json_schema needs json_schema.schema")
    return _json_schema(fmt.json_schema.schema_, "response_format.json_schema.schema")


def _from_structured_outputs(params: StructuredOutputsParams) -> StructuredOutput:
    if params.structural_tag is not None:
        raise ValueError("structured_outputs.structural_tag is not supported")
    if params.whitespace_pattern is not None:
        raise ValueError("structured_outputs.whitespace_pattern is not supported (xgrammar decides the whitespace)")
    asked = [StructuredOutput("json_object")] if params.json_object else []
    if params.json_ is not None:
        asked.append(_json_schema(params.json_, "structured_outputs.json"))
    if params.regex is not None:
        asked.append(StructuredOutput("regex", params.regex))
    if params.choice is not None:
        asked.append(_choice(params.choice, "structured_outputs.choice"))
    if params.grammar is not None:
        asked.append(StructuredOutput("grammar", params.grammar))
    if len(asked) != 1:
        raise ValueError("structured_outputs needs exactly one of json, regex, choice, grammar, json_object")
    return asked[0]


def _json_schema(schema: dict[str, Any] | str | bool, field: str) -> StructuredOutput:
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{field} is not valid JSON: {exc}") from None
    if not isinstance(schema, (dict, bool)):
        raise ValueError(f"{field} must be a JSON schema (an object)")
    return StructuredOutput("json", json.dumps(schema))


def _choice(choices: list[str], field: str) -> StructuredOutput:
    if not choices or not all(choices):
        raise ValueError(f"{field} needs a non-empty list of non-empty strings")
    return StructuredOutput("choice", json.dumps(choices))
