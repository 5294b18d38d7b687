"""Tool calling in the api: tool_choice checks, the grammar of `required`, the parsers of
`auto`, and streamed tool calls that add up to the non-streamed ones."""

from __future__ import annotations

import json

import jsonschema
import msgspec
import pytest

from kvserve.services.api.parsers.tool_calls import (
    ToolCallOutput,
    required_calls_schema,
    resolve_tool_choice,
    tool_constraint,
)
from kvserve.services.api.parsers.tool_registry import TOOL_PARSERS
from kvserve.services.api.serving.errors import APIError
from kvserve.services.api.serving.protocol import ChatCompletionRequest
from kvserve.shared.api_config import FrontendConfig

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"location": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
            "required": ["location", "unit"],
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time"}}
AUTO = FrontendConfig(enable_auto_tool_choice=True, tool_call_parser="hermes")


def chat_request(**fields) -> ChatCompletionRequest:
    body = {"messages": [{"role": "user", "content": "hi"}], **fields}
    return msgspec.convert(body, ChatCompletionRequest)


@pytest.mark.parametrize(
    "fields, frontend, expected",
    [
        ({}, FrontendConfig(), "none"),
        ({"tools": [WEATHER], "tool_choice": "none"}, FrontendConfig(), "none"),
        ({"tools": [WEATHER]}, AUTO, "auto"),
        ({"tools": [WEATHER], "tool_choice": "required"}, FrontendConfig(), "required"),
        (
            {
                "tools": [WEATHER],
                "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
            },
            FrontendConfig(),
            "get_weather",
        ),
    ],
)
def test_tool_choice_resolves(fields, frontend, expected):
    assert resolve_tool_choice(chat_request(**fields), frontend) == expected


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"tool_choice": "required"}, "`tools` must be set"),
        ({"tools": [WEATHER]}, "requires --enable-auto-tool-choice"),
        ({"tools": [WEATHER], "tool_choice": "sometimes"}, "is not one of"),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "'nope', which `tools` does not define",
        ),
    ],
)
def test_bad_tool_choices_are_400s(fields, message):
    with pytest.raises(APIError) as info:
        resolve_tool_choice(chat_request(**fields), FrontendConfig())
    assert info.value.status_code == 400 and info.value.param == "tool_choice"
    assert message in info.value.message


def test_required_schema_takes_any_tool_and_hoists_defs():
    with_defs = {
        "type": "function",
        "function": {
            "name": "book",
            "parameters": {
                "type": "object",
                "properties": {"when": {"$ref": "#/$defs/date"}},
                "required": ["when"],
                "$defs": {"date": {"type": "string", "pattern": "^[0-9]{4}$"}},
            },
        },
    }
    request = chat_request(tools=[WEATHER, TIME, with_defs], tool_choice="required")
    schema = required_calls_schema(request.tools, parallel=True)
    validator = jsonschema.Draft202012Validator(schema)
    calls = [
        {"name": "get_weather", "parameters": {"location": "Paris", "unit": "c"}},
        {"name": "get_time", "parameters": {}},
        {"name": "book", "parameters": {"when": "2026"}},
    ]
    assert validator.is_valid(calls)
    assert not validator.is_valid([])
    assert not validator.is_valid([{"name": "book", "parameters": {"when": "May"}}])
    assert not validator.is_valid([{"name": "get_weather", "parameters": {"location": "x"}}])
    single = required_calls_schema(request.tools, parallel=False)
    assert not jsonschema.Draft202012Validator(single).is_valid(calls)
    named = tool_constraint(
        chat_request(
            tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "get_weather"}}
        ),
        "get_weather",
    )
    assert named.json == WEATHER["function"]["parameters"]


@pytest.mark.parametrize(
    "parser, text, content, calls",
    [
        (
            "hermes",
            'Let me check.\n<tool_call>\n{"name": "get_weather", '
            '"arguments": {"location": "Paris"}}\n</tool_call>\n'
            '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>',
            "Let me check.\n",
            [("get_weather", {"location": "Paris"}), ("get_time", {})],
        ),
        ("hermes", "no calls here", "no calls here", []),
        ("hermes", "<tool_call>{not json</tool_call>", "<tool_call>{not json</tool_call>", []),
        (
            "llama3_json",
            '<|python_tag|>{"name": "get_weather", "parameters": {"location": "Oslo"}}; '
            '{"name": "get_time", "parameters": {}}',
            None,
            [("get_weather", {"location": "Oslo"}), ("get_time", {})],
        ),
        ("llama3_json", "The answer is {1}.", "The answer is {1}.", []),
        (
            "pythonic",
            '[get_weather(location="Rome", unit="c"), get_time()]',
            None,
            [("get_weather", {"location": "Rome", "unit": "c"}), ("get_time", {})],
        ),
        ("pythonic", "[1, 2] are numbers", "[1, 2] are numbers", []),
    ],
)
def test_parsers_find_calls_or_leave_content(parser, text, content, calls):
    extracted = TOOL_PARSERS[parser]().extract(text)
    assert extracted.content == content
    assert [(name, json.loads(arguments)) for name, arguments in extracted.calls] == calls


def stream_in_pieces(output: ToolCallOutput, text: str, size: int):
    """Feed `text` in pieces as the stream would; returns (content, calls by index)."""
    content, calls = "", {}
    pieces = [text[i : i + size] for i in range(0, len(text), size)] or [""]
    for number, piece in enumerate(pieces):
        delta_content, deltas = output.update(piece, finished=number == len(pieces) - 1)
        content += delta_content or ""
        for delta in deltas:
            call = calls.setdefault(delta.index, {"name": None, "arguments": ""})
            if delta.function.name:
                call["name"] = delta.function.name
            call["arguments"] += delta.function.arguments or ""
    return content or None, [(c["name"], json.loads(c["arguments"])) for c in calls.values()]


@pytest.mark.parametrize(
    "choice, parser, text",
    [
        (
            "auto",
            "hermes",
            'I will call it. <tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call>',
        ),
        ("auto", "hermes", "plain <tool_ text that only looks like a call"),
        ("auto", "llama3_json", '  {"name": "f", "parameters": {"a": [1, 2]}}'),
        ("auto", "pythonic", '[f(a="x, y")]'),
        (
            "required",
            None,
            '[{"name": "f", "parameters": {"s": "a]}"}}, {"name": "g", "parameters": {}}]',
        ),
        ("get_weather", None, '{"location": "Paris", "unit": "c"}'),
    ],
)
@pytest.mark.parametrize("size", [1, 3, 1000])
def test_streamed_tool_calls_add_up_to_the_whole_result(choice, parser, text, size):
    content, calls = ToolCallOutput(choice, parser).result(text)
    expected = (content, [(c.function.name, json.loads(c.function.arguments)) for c in calls])
    assert stream_in_pieces(ToolCallOutput(choice, parser), text, size) == expected
    assert all(c.id.startswith("chatcmpl-tool-") for c in calls)


def test_finish_reason_is_tool_calls_for_complete_outputs_with_unnamed_calls():
    output = ToolCallOutput("required")
    assert output.finish_reason("stop", 1) == "tool_calls"
    assert output.finish_reason("length", 1) == "length"
    assert output.finish_reason("stop", 0) == "stop"
    # A named tool_choice: "stop", as OpenAI and vLLM say.
    assert ToolCallOutput("get_weather").finish_reason("stop", 1) == "stop"


def test_without_parallel_tool_calls_auto_keeps_the_first_call():
    text = (
        '<tool_call>{"name": "f", "arguments": {}}</tool_call>'
        '<tool_call>{"name": "g", "arguments": {}}</tool_call>'
    )
    _, calls = ToolCallOutput("auto", "hermes", parallel=False).result(text)
    assert [c.function.name for c in calls] == ["f"]
    _, streamed = stream_in_pieces(ToolCallOutput("auto", "hermes", parallel=False), text, 5)
    assert [name for name, _ in streamed] == ["f"]
    assert len(ToolCallOutput("auto", "hermes").result(text)[1]) == 2
