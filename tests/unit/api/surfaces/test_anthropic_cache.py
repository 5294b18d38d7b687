"""Anthropic cache_control: breakpoints in order and their 400s, offsets by the common
prefix, and the usage accounting of reads and writes by TTL."""

from __future__ import annotations

import msgspec
import pytest

from kvserve.services.api.serving.errors import APIError
from kvserve.services.api.serving.prompt_cache import cache_usage, make_pin
from kvserve.services.api.surfaces.anthropic_cache import (
    breakpoint_offsets,
    common_prefix_len,
    find_breakpoints,
)
from kvserve.services.api.surfaces.anthropic_protocol import MessagesRequest

FIVE = {"type": "ephemeral"}
HOUR = {"type": "ephemeral", "ttl": "1h"}


def _request(**fields) -> MessagesRequest:
    body = {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}
    return msgspec.convert(body | fields, MessagesRequest)


def _tool(name: str, cache_control=None) -> dict:
    tool = {"name": name, "input_schema": {"type": "object"}}
    return tool | ({"cache_control": cache_control} if cache_control else {})


def test_breakpoints_come_tools_then_system_then_messages():
    request = _request(
        tools=[_tool("a"), _tool("b", HOUR)],
        system=[
            {"type": "text", "text": "s1", "cache_control": HOUR},
            {"type": "text", "text": "s2"},
        ],
        messages=[
            {"role": "user", "content": [{"type": "text", "text": "q", "cache_control": FIVE}]},
            {"role": "assistant", "content": "a"},
            {"role": "user", "content": "next"},
        ],
    )
    found = find_breakpoints(request)
    assert [ttl for ttl, _ in found] == ["1h", "1h", "5m"]
    tools_cut, system_cut, message_cut = (cut for _, cut in found)
    assert [t.name for t in tools_cut.tools] == ["a", "b"] and tools_cut.messages == []
    assert [b.text for b in system_cut.system] == ["s1"] and system_cut.messages == []
    assert len(message_cut.messages) == 1


def test_top_level_cache_control_marks_the_last_block_once():
    assert [ttl for ttl, _ in find_breakpoints(_request(cache_control=HOUR))] == ["1h"]
    marked = [{"role": "user", "content": [{"type": "text", "text": "q", "cache_control": FIVE}]}]
    assert len(find_breakpoints(_request(messages=marked, cache_control=FIVE))) == 1


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"tools": [_tool(str(i), FIVE) for i in range(5)]}, "A maximum of 4 blocks"),
        ({"tools": [_tool("a", FIVE)], "cache_control": HOUR}, "ttl='1h'"),
        ({"cache_control": {"type": "ephemeral", "ttl": "10m"}}, "must be '5m' or '1h'"),
        ({"cache_control": {"type": "persistent"}}, "only 'ephemeral'"),
    ],
)
def test_invalid_placements_are_400s(fields, message):
    with pytest.raises(APIError) as info:
        find_breakpoints(_request(**fields))
    assert info.value.status_code == 400 and message in info.value.message


def test_offsets_are_where_the_cut_rendering_parts_from_the_prompt():
    request = _request(tools=[_tool("a", HOUR)], cache_control=FIVE)
    prompt = list(range(100))
    rendered = {0: list(range(40)) + [999], 1: list(range(100)) + [7]}
    calls = iter(range(2))
    offsets = breakpoint_offsets(
        find_breakpoints(request), prompt, lambda cut: rendered[next(calls)]
    )
    assert offsets == [(40, "1h"), (100, "5m")]
    assert common_prefix_len([1, 2, 3], [1, 2, 4]) == 2


def test_usage_reads_whole_breakpoints_and_splits_writes_by_ttl():
    pins = [make_pin(40, "1h"), make_pin(100, "5m")]
    first = cache_usage(pins, num_cached_tokens=0, block_size=16)
    assert (first.read, first.created, first.cached_prefix) == (0, {"1h": 40, "5m": 60}, 100)
    # 96 tokens hit: every full block of the 100-token breakpoint, so all of it is read.
    second = cache_usage(pins, num_cached_tokens=96, block_size=16)
    assert (second.read, second.created) == (100, {})
    partial = cache_usage(pins, num_cached_tokens=48, block_size=16)
    assert (partial.read, partial.created) == (40, {"5m": 60})
    assert cache_usage([make_pin(10, "5m")], 0, 16).cached_prefix == 0  # under one block
