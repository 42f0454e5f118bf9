"""Tool-call and reasoning parsers on fixed model outputs: the final message, and streaming (fed in pieces of
every size) that adds up to exactly the same message, name before arguments, no marker leaking into content."""

from __future__ import annotations

import json

import pytest

from autodeploy.serve.partial_json import scan_call, value_end
from autodeploy.serve.reasoning import ReasoningStream, reasoning_parser
from autodeploy.serve.tool_parsers import (NamedCallParser, RequiredCallsParser, ToolCallStream, extract_tool_calls,
                                           held_back, tool_parser)

WEATHER = '{"name": "get_weather", "arguments": {"city": "Paris \\"FR\\" {x}", "days": [1, 2]}}'
SEARCH = '{"name": "search", "arguments": {"q": "a,b}"}}'
CASES = {
    "hermes": (f"Let me check.\n<tool_call>\n{WEATHER}\n</tool_call>\n<tool_call>\n{SEARCH}\n</tool_call>",
               "Let me check."),
    "llama3_json": ('<|python_tag|>' + WEATHER.replace('"arguments"', '"parameters"') + "; " + SEARCH, None),
    "mistral": (f"Sure[TOOL_CALLS][{WEATHER}, {SEARCH}]", "Sure"),
    "mistral_args": ('[TOOL_CALLS]get_weather[ARGS]{"city": "Paris \\"FR\\" {x}", "days": [1, 2]}'
                     '[TOOL_CALLS]search[ARGS]{"q": "a,b}"}', None),
}
EXPECTED = [("get_weather", {"city": 'Paris "FR" {x}', "days": [1, 2]}), ("search", {"q": "a,b}"})]


def _parser(case: str):
    return tool_parser("mistral" if case.startswith("mistral") else case)


def _calls(calls) -> list:
    return [(c.name, json.loads(c.arguments)) for c in calls]


def _stream(parser, text: str, step: int):
    """Feed ``text`` in pieces of ``step`` characters; returns (content, calls as the OpenAI client rebuilds them)."""
    stream, content, calls = ToolCallStream(parser), "", {}
    for end in range(step, len(text) + step, step):
        new_content, deltas = stream.update(text[:end], final=end >= len(text))
        content += new_content
        for delta in deltas:
            call = calls.setdefault(delta["index"], {"arguments": ""})
            if "id" in delta:
                assert "name" not in call and delta["type"] == "function" and delta["function"]["arguments"] == ""
                call.update(id=delta["id"], name=delta["function"]["name"])
            assert "name" in call  # the name comes before any argument piece
            call["arguments"] += delta["function"]["arguments"]
    return content, [calls[i] for i in sorted(calls)]


@pytest.mark.parametrize("case", CASES)
def test_tool_calls_whole_and_streamed(case):
    text, content = CASES[case]
    got_content, calls = extract_tool_calls(_parser(case), text)
    assert got_content == content and _calls(calls) == EXPECTED
    assert all(c.id for c in calls) and len({c.id for c in calls}) == 2
    for step in (1, 3, 7, len(text)):
        streamed_content, streamed = _stream(_parser(case), text, step)
        assert [(c["name"], json.loads(c["arguments"])) for c in streamed] == EXPECTED
        assert streamed_content.strip() == (content or "")
        assert "<tool" not in streamed_content and "[TOOL" not in streamed_content


@pytest.mark.parametrize("case, text", [
    ("hermes", "Just text, with a < and a <tool that is no call."),
    ("llama3_json", "The answer is {not a call}."),
    ("mistral", "No calls [TOOL here."),
])
def test_plain_text_is_content(case, text):
    assert extract_tool_calls(_parser(case), text) == (text, [])
    assert _stream(_parser(case), text, 1) == (text, [])


@pytest.mark.parametrize("case, text", [
    ("hermes", '<tool_call>\n{"name": "f", "arguments": {"a": 1}\n</tool_call>'),  # unclosed object
    ("hermes", '<tool_call>\n{"arguments": {"a": 1}}\n</tool_call>'),  # no name
    ("hermes", '<tool_call>\n{"name": 5, "arguments": {"a": 1}}\n</tool_call>'),  # a name that is no string
    ("llama3_json", '{"name": "f", "parameters": {"a": 1}} and then some text'),
])
def test_broken_calls_leave_the_text_as_content(case, text):
    assert extract_tool_calls(_parser(case), text) == (text, [])


def test_required_and_named_outputs():
    text = '[{"name": "get_weather", "parameters": {"city": "Oslo"}}, {"name": "search", "parameters": {}}]'
    _, calls = extract_tool_calls(RequiredCallsParser(), text)
    assert _calls(calls) == [("get_weather", {"city": "Oslo"}), ("search", {})]
    assert [c["name"] for c in _stream(RequiredCallsParser(), text, 2)[1]] == ["get_weather", "search"]
    _, calls = extract_tool_calls(NamedCallParser("get_weather"), '{"city": "Oslo"}')
    assert _calls(calls) == [("get_weather", {"city": "Oslo"})]
    assert _stream(NamedCallParser("f"), '{"a": [1, 2]}', 1)[1][0]["arguments"] == '{"a": [1, 2]}'
    assert extract_tool_calls(RequiredCallsParser(), '[{"name": "f", "para')[1] == []  # cut off by max_tokens


def test_quoted_arguments_are_unwrapped():
    call, end = scan_call('{"name": "f", "arguments": "{\\"a\\": 1}"}', 0)
    assert (call.name, call.arguments, call.complete, end) == ("f", '{"a": 1}', True, 40)


def test_partial_json_scanning():
    assert value_end('"a\\"b" x', 0) == 6
    assert value_end('{"a": "}", "b": [1, {"c": "]"}]} tail', 0) == 32
    assert value_end('{"a": "}"', 0) is None and value_end("12", 0) is None and value_end("12,", 0) == 2
    assert held_back("text <tool_", "<tool_call>") == 6 and held_back("text", "<tool_call>") == 0


REASONING = "<think>\nLet me think: 2 < 3.\n</think>\n\nThe answer is 3."


@pytest.mark.parametrize("name, text, expected", [
    ("deepseek_r1", REASONING, ("Let me think: 2 < 3.\n", "The answer is 3.")),
    ("deepseek_r1", "Thinking without a start tag</think>Answer", ("Thinking without a start tag", "Answer")),
    ("deepseek_r1", "<think>cut off while thinking", ("cut off while thinking", "")),
    ("qwen3", REASONING, ("Let me think: 2 < 3.\n", "The answer is 3.")),
    ("qwen3", "No thinking at all <b>.", ("", "No thinking at all <b>.")),
])
def test_reasoning_whole_and_streamed(name, text, expected):
    assert reasoning_parser(name).split(text, final=True) == expected
    for step in (1, 2, 5):
        stream, reasoning, content = ReasoningStream(reasoning_parser(name)), "", ""
        for end in range(step, len(text) + step, step):
            new, content_so_far = stream.update(text[:end], final=end >= len(text))
            reasoning += new
            assert expected[1].startswith(content_so_far)  # content sent is never taken back
            content = content_so_far
        assert (reasoning, content) == expected


def test_unknown_parsers_are_refused():
    with pytest.raises(ValueError, match="choose one of hermes, llama3_json, mistral"):
        tool_parser("nope")
    with pytest.raises(ValueError, match="choose one of deepseek_r1, qwen3"):
        reasoning_parser("nope")
