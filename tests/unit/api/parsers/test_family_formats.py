"""Every family's tool-call and reasoning format (family_formats.py holds the reference
texts): parsed whole, streamed split anywhere (a hypothesis property: the streamed pieces add
up to the whole parse), malformed calls kept as content, and the special-token flag."""

from __future__ import annotations

import json

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvserve.services.api.parsers.reasoning_parsers import ReasoningSplitter
from kvserve.services.api.parsers.reasoning_registry import REASONING_PARSERS, get_reasoning_parser
from kvserve.services.api.parsers.tool_calls import ToolCallOutput
from kvserve.services.api.parsers.tool_registry import TOOL_PARSERS
from kvserve.services.api.serving.protocol import ChatTool
from kvserve.shared.parser_names import (
    HARMONY_REASONING_PARSER,
    HARMONY_TOOL_PARSER,
    REASONING_PARSER_NAMES,
    TOOL_CALL_PARSER_NAMES,
)
from tests.unit.api.parsers.family_formats import (
    MALFORMED,
    REASONING_FORMATS,
    TOOL_FORMATS,
    TOOLS,
    ReasoningFormat,
    ToolFormat,
)

CHAT_TOOLS = msgspec.convert(TOOLS, list[ChatTool])


def split_at(text: str, cuts: list[int]) -> list[str]:
    """text cut at the given offsets (any order, repeats allowed: empty deltas happen too)."""
    bounds = [0, *sorted(c % (len(text) + 1) for c in cuts), len(text)]
    return [text[a:b] for a, b in zip(bounds, bounds[1:])]


def streamed_calls(output: ToolCallOutput, pieces: list[str]):
    content, calls = "", {}
    for number, piece in enumerate(pieces):
        delta_content, deltas = output.update(piece, finished=number == len(pieces) - 1)
        content += delta_content or ""
        for delta in deltas:
            call = calls.setdefault(delta.index, {"name": None, "arguments": ""})
            call["name"] = delta.function.name or call["name"]
            call["arguments"] += delta.function.arguments or ""
    return content or None, [(c["name"], json.loads(c["arguments"])) for c in calls.values()]


@pytest.mark.parametrize("case", TOOL_FORMATS, ids=lambda c: c.parser)
def test_reference_tool_calls_parse_whole(case: ToolFormat):
    content, calls = ToolCallOutput("auto", case.parser, tools=CHAT_TOOLS).result(case.text)
    assert content == case.content
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == case.calls


@pytest.mark.parametrize("case", TOOL_FORMATS, ids=lambda c: c.parser)
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cuts=st.lists(st.integers(min_value=0, max_value=10_000), max_size=12))
def test_reference_tool_calls_stream_split_anywhere(case: ToolFormat, cuts):
    output = ToolCallOutput("auto", case.parser, tools=CHAT_TOOLS)
    assert streamed_calls(output, split_at(case.text, cuts)) == (case.content, case.calls)


@pytest.mark.parametrize("case", TOOL_FORMATS, ids=lambda c: c.parser)
def test_reference_tool_calls_stream_char_by_char(case: ToolFormat):
    output = ToolCallOutput("auto", case.parser, tools=CHAT_TOOLS)
    assert streamed_calls(output, list(case.text)) == (case.content, case.calls)


@pytest.mark.parametrize("parser, text", MALFORMED)
def test_malformed_calls_come_back_as_content(parser, text):
    content, calls = ToolCallOutput("auto", parser, tools=CHAT_TOOLS).result(text)
    assert (content, calls) == (text, [])
    assert streamed_calls(ToolCallOutput("auto", parser, tools=CHAT_TOOLS), list(text)) == (
        text,
        [],
    )


def test_parallel_false_keeps_the_first_call():
    case = TOOL_FORMATS[0]
    _, calls = ToolCallOutput("auto", case.parser, False, CHAT_TOOLS).result(case.text)
    assert [c.function.name for c in calls] == ["get_weather"]


def test_schema_types_bare_values_and_unknown_types_stay_text():
    text = (
        "<tool_call>\n<function=get_weather>\n<parameter=city>\n42\n</parameter>\n"
        "<parameter=days>\nsoon\n</parameter>\n<parameter=extra>\n1\n</parameter>\n"
        "</function>\n</tool_call>"
    )
    _, calls = ToolCallOutput("auto", "qwen3_xml", tools=CHAT_TOOLS).result(text)
    assert json.loads(calls[0].function.arguments) == {"city": "42", "days": "soon", "extra": "1"}


def test_markers_that_are_special_tokens_are_flagged():
    assert {n for n, p in TOOL_PARSERS.items() if p.needs_special_tokens} == {"mistral", "kimi_k2"}
    assert {n for n, p in REASONING_PARSERS.items() if p.needs_special_tokens} == {
        "kimi_k2",
        "mistral",
    }
    # Every flag name has a parser: a text one in the registries, or harmony's package.
    assert set(TOOL_PARSERS) | {HARMONY_TOOL_PARSER} == set(TOOL_CALL_PARSER_NAMES)
    assert set(REASONING_PARSERS) | {HARMONY_REASONING_PARSER} == set(REASONING_PARSER_NAMES)


def reasoning_split(case: ReasoningFormat, pieces: list[str]):
    parser = get_reasoning_parser(case.parser)
    assert parser is not None
    if not parser.starts_thinking(case.template_kwargs):
        return None, "".join(pieces) or None
    splitter, reasoning, content = ReasoningSplitter(parser), "", ""
    for number, piece in enumerate(pieces):
        r, c = splitter.feed(piece, final=number == len(pieces) - 1)
        reasoning, content = reasoning + r, content + c
    return reasoning or None, content or None


@pytest.mark.parametrize("case", REASONING_FORMATS, ids=lambda c: c.parser)
def test_reference_reasoning_splits_whole_and_char_by_char(case: ReasoningFormat):
    expected = (case.reasoning, case.content)
    assert reasoning_split(case, [case.text]) == expected
    assert reasoning_split(case, list(case.text)) == expected


@pytest.mark.parametrize("case", REASONING_FORMATS, ids=lambda c: c.parser)
@settings(max_examples=40, deadline=None)
@given(cuts=st.lists(st.integers(min_value=0, max_value=10_000), max_size=10))
def test_reference_reasoning_streams_split_anywhere(case: ReasoningFormat, cuts):
    assert reasoning_split(case, split_at(case.text, cuts)) == (case.reasoning, case.content)


@pytest.mark.parametrize("parser", sorted(TOOL_PARSERS))
def test_every_format_takes_tool_choice_none_required_and_named(parser):
    """none leaves the family's markup as content; required and a named function read the
    JSON their grammar writes (resolve_tool_choice / tool_constraint), whatever the format."""
    markup = next((c.text for c in TOOL_FORMATS if c.parser == parser), "<tool_call>x")
    assert ToolCallOutput("none", parser, tools=CHAT_TOOLS).result(markup) == (markup, [])
    required = '[{"name": "get_weather", "parameters": {"city": "Oslo"}}]'
    _, calls = ToolCallOutput("required", parser, tools=CHAT_TOOLS).result(required)
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        ("get_weather", {"city": "Oslo"})
    ]
    _, calls = ToolCallOutput("get_weather", parser, tools=CHAT_TOOLS).result('{"city": "Oslo"}')
    assert [c.function.name for c in calls] == ["get_weather"]
