"""Tool calls and reasoning through the openai client against a live server of the tiny model.

``required`` and named choices are forced by the grammar, so any model produces valid calls. For ``auto``
the tiny random model would never write a call on its own: its output is forced with a grammar into the
Hermes format, so the whole path (engine, parser, response, streaming deltas) runs as with a real model.
"""

from __future__ import annotations

import json

import jsonschema_rs
import openai
import pytest

from autodeploy.serve.tools import ToolSettings

from conftest import chat_reply, serving

WEATHER_PARAMETERS = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                                       "days": {"type": "integer", "minimum": 1, "maximum": 9}},
                      "required": ["city", "days"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                           "parameters": WEATHER_PARAMETERS}},
         {"type": "function", "function": {"name": "get_time", "parameters": {
             "type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}},
             "required": ["zone"], "additionalProperties": False}}}]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
# what a Hermes-format model writes when it calls a tool, forced here (the tiny model is random)
HERMES_CALL = ('<think>hm</think>Checking.<tool_call>\\n{\\"name\\": \\"get_time\\", \\"arguments\\": '
               '{\\"zone\\": \\"CET\\"}}\\n</tool_call>')


@pytest.fixture(scope="module")
def client(compiled, tokenizer):
    with serving(compiled, tokenizer, tools=ToolSettings(True, "hermes"), reasoning_parser="deepseek_r1") as live:
        yield openai.OpenAI(base_url=f"{live.url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def plain_client(compiled, tokenizer):
    with serving(compiled, tokenizer) as live:
        yield openai.OpenAI(base_url=f"{live.url}/v1", api_key="unused", max_retries=0)


def _create(client, stream: bool, **kwargs):
    return chat_reply(client, stream, **(dict(model="tiny", messages=MESSAGES, tools=TOOLS, max_tokens=120,
                                              temperature=0) | kwargs))


def _valid(calls) -> bool:
    return all(jsonschema_rs.is_valid(SCHEMAS[name], json.loads(arguments)) for _, name, arguments in calls)


@pytest.mark.parametrize("stream", [False, True])
def test_required_choice_makes_valid_calls(client, stream):
    (content, calls, _), finish = _create(client, stream, tool_choice="required", parallel_tool_calls=False)
    assert finish == "tool_calls" and content is None
    assert len(calls) == 1 and calls[0][1] in SCHEMAS and calls[0][0].startswith("call_") and _valid(calls)


@pytest.mark.parametrize("stream", [False, True])
def test_named_choice_calls_that_function(client, stream):
    choice = {"type": "function", "function": {"name": "get_weather"}}
    (content, calls, _), finish = _create(client, stream, tool_choice=choice)
    assert finish == "stop" and content is None
    assert [name for _, name, _ in calls] == ["get_weather"] and _valid(calls)


@pytest.mark.parametrize("stream", [False, True])
def test_auto_choice_reads_the_models_calls(client, stream):
    (content, calls, reasoning), finish = _create(client, stream, extra_body={"guided_grammar": f'root ::= "{HERMES_CALL}"'})
    assert (content, reasoning, finish) == ("Checking.", "hm", "tool_calls")
    assert [(name, json.loads(arguments)) for _, name, arguments in calls] == [("get_time", {"zone": "CET"})]


@pytest.mark.parametrize("stream", [False, True])
def test_auto_choice_without_calls_is_content(client, stream):
    (content, calls, reasoning), finish = _create(
        client, stream, extra_body={"guided_grammar": 'root ::= "<think>x</think>Sunny, 20 C."'})
    assert (content, calls, reasoning, finish) == ("Sunny, 20 C.", [], "x", "stop")


@pytest.mark.parametrize("stream", [False, True])
def test_reasoning_without_tools(client, stream):
    """--reasoning-parser alone: the thinking is reasoning_content, the rest content (forced, the model is random)."""
    (content, calls, reasoning), finish = chat_reply(
        client, stream, model="tiny", messages=MESSAGES, max_tokens=60, temperature=0,
        extra_body={"guided_grammar": 'root ::= "<think>\\n2 < 3, so</think>\\n\\nThree."'})
    assert (content, calls, reasoning, finish) == ("Three.", [], "2 < 3, so", "stop")


def test_required_calls_of_n_choices_streamed_and_whole(client):
    """``n`` = 2 sampled choices (seeded): each one's calls valid, and its stream (deltas by choice index) equal
    to its whole message."""
    args = dict(model="tiny", messages=MESSAGES, tools=TOOLS, tool_choice="required", parallel_tool_calls=False, n=2,
                temperature=1.0, seed=5, max_tokens=120)
    whole = client.chat.completions.create(**args)
    streamed: dict[int, dict[int, list[str]]] = {0: {}, 1: {}}
    for chunk in client.chat.completions.create(stream=True, **args):
        for choice in chunk.choices:
            for call in choice.delta.tool_calls or []:
                name_and_arguments = streamed[choice.index].setdefault(call.index, ["", ""])
                name_and_arguments[0] += call.function.name or ""
                name_and_arguments[1] += call.function.arguments or ""
    assert len(whole.choices) == 2
    for choice in whole.choices:
        calls = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls]
        assert choice.finish_reason == "tool_calls" and len(calls) == 1 and _valid([(None, *c) for c in calls])
        assert [tuple(c) for _, c in sorted(streamed[choice.index].items())] == calls


def test_a_tool_round_trip(client):
    """The call and its result go back in the history (assistant tool_calls, a tool message) and the model answers."""
    first = client.chat.completions.create(model="tiny", messages=MESSAGES, tools=TOOLS, tool_choice="required",
                                           parallel_tool_calls=False, max_tokens=120, temperature=0)
    call = first.choices[0].message.tool_calls[0]
    history = MESSAGES + [first.choices[0].message.model_dump(exclude_none=True),
                          {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature": 21})}]
    reply = client.chat.completions.create(model="tiny", messages=history, tools=TOOLS, tool_choice="none",
                                           max_tokens=8, temperature=0, extra_body={"ignore_eos": True})
    assert reply.usage.prompt_tokens > first.usage.prompt_tokens  # the tool's answer reached the prompt
    assert reply.choices[0].finish_reason == "length" and reply.usage.completion_tokens == 8
    assert reply.choices[0].message.content is not None and not reply.choices[0].message.tool_calls


@pytest.mark.parametrize("kwargs, message", [
    (dict(tool_choice={"type": "function", "function": {"name": "nope"}}), "'nope', which is not among the tools"),
    (dict(tools=None, tool_choice="required"), "tool_choice needs tools"),
    (dict(tool_choice="required", response_format={"type": "json_object"}), "cannot be combined"),
    (dict(messages=MESSAGES + [{"role": "assistant", "tool_calls": [{"id": "1", "type": "function",
                                                                      "function": {"name": "f", "arguments": "{x"}}]}],
          tool_choice="none"), "arguments of 'f' are not valid JSON"),
])
def test_bad_tool_requests_are_400(client, kwargs, message):
    with pytest.raises(openai.BadRequestError, match=message):
        client.chat.completions.create(**(dict(model="tiny", messages=MESSAGES, tools=TOOLS, max_tokens=4) | kwargs))


def test_auto_needs_the_servers_flags(plain_client):
    with pytest.raises(openai.BadRequestError, match="--enable-auto-tool-choice and --tool-call-parser"):
        plain_client.chat.completions.create(model="tiny", messages=MESSAGES, tools=TOOLS, max_tokens=4)
    reply = plain_client.chat.completions.create(model="tiny", messages=MESSAGES, tools=TOOLS, tool_choice="required",
                                                 parallel_tool_calls=False, max_tokens=120, temperature=0)
    assert reply.choices[0].finish_reason == "tool_calls"  # forced choices need no flag


def test_serve_flags_in_vllm_spelling(capsys):
    import yaml

    from autodeploy.cli import main

    argv = ["serve", "ckpt", "--print_config", "--enable-auto-tool-choice", "--tool-call-parser", "mistral",
            "--reasoning-parser", "qwen3", "--grammar-compile-timeout", "3", "--max-grammar-chars", "500"]
    assert main(argv) == 0
    config = yaml.safe_load(capsys.readouterr().out)
    assert (config["enable_auto_tool_choice"], config["tool_call_parser"], config["reasoning_parser"]) == (
        True, "mistral", "qwen3")
    assert (config["limits"]["grammar_compile_timeout"], config["limits"]["max_grammar_chars"]) == (3.0, 500)
    for flags, message in ((["--tool-call-parser", "nope"], "unknown tool call parser 'nope'; choose one of hermes"),
                           (["--reasoning-parser", "nope"], "unknown reasoning parser 'nope'; choose one of deepseek_r1"),
                           (["--enable-auto-tool-choice"], "--enable-auto-tool-choice needs --tool-call-parser")):
        assert main(["serve", "ckpt", "--print_config", *flags]) == 2
        assert message in capsys.readouterr().err
