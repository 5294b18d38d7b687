"""Anthropic `cache_control` on /v1/messages: the request's breakpoints, checked, and the
prompt token offset of each.

A breakpoint is a `cache_control` {"type": "ephemeral", "ttl": "5m" | "1h"} on a tool, a
system block or a message content block (a string content is one block), taken in
Anthropic's order: tools, then system, then messages. A top-level `cache_control` adds one
automatic breakpoint on the last cacheable block (the last message's last block), unless
that block has one already. At most 4 breakpoints, and a 1h one never after a 5m one:
anything else is Anthropic's 400.

A breakpoint's offset is where the prefix up to and including its block ends in the
prompt's tokens: the request cut after that block is rendered by the same chat template,
and the offset is the length of its longest common prefix with the full prompt (the cut
rendering closes its last turn differently; the common run ends where they part).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import msgspec

from kvserve.services.api.serving.errors import APIError
from kvserve.services.api.surfaces.anthropic_protocol import (
    CountTokensRequest,
    InputMessage,
    MessagesRequest,
)

MAX_BREAKPOINTS = 4
TTLS = ("5m", "1h")

# (TTL class, the request cut after the marked block)
Breakpoint = tuple[str, CountTokensRequest]


def ttl_of(cache_control: dict[str, Any] | None, param: str) -> str | None:
    """The TTL class of one `cache_control` (None when absent).

    Raises:
        APIError: 400 for a type other than ephemeral or a TTL other than 5m / 1h.
    """
    if cache_control is None:
        return None
    if cache_control.get("type") != "ephemeral":
        raise APIError(400, f"{param}.type: only 'ephemeral' is supported", param)
    ttl = cache_control.get("ttl", "5m")
    if ttl not in TTLS:
        raise APIError(400, f"{param}.ttl: must be '5m' or '1h', got {ttl!r}", param)
    return ttl


def find_breakpoints(request: MessagesRequest) -> list[Breakpoint]:
    """The request's breakpoints in Anthropic's order, checked.

    Raises:
        APIError: 400 for a bad cache_control, a fifth breakpoint, or a 1h after a 5m.
    """
    found = [*_tool_breakpoints(request), *_system_breakpoints(request)]
    found += _message_breakpoints(request)
    automatic = ttl_of(request.cache_control, "cache_control")
    if automatic is not None and request.messages and not _last_block_marked(request):
        found.append((automatic, _cut(request)))
    if len(found) > MAX_BREAKPOINTS:
        raise APIError(
            400,
            f"A maximum of {MAX_BREAKPOINTS} blocks with cache_control may be provided. "
            f"Found {len(found)}.",
        )
    ttls = [ttl for ttl, _ in found]
    if "5m" in ttls and "1h" in ttls[ttls.index("5m") :]:
        raise APIError(
            400,
            "a ttl='1h' cache_control block must not come after a ttl='5m' cache_control "
            "block. Note that blocks are processed in the following order: `tools`, "
            "`system`, `messages`.",
        )
    return found


def _tool_breakpoints(request: MessagesRequest) -> list[Breakpoint]:
    tools = request.tools or []
    return [
        (ttl, _cut(request, tools=tools[: index + 1], system=None, messages=[]))
        for index, tool in enumerate(tools)
        if (ttl := ttl_of(tool.cache_control, f"tools.{index}.cache_control")) is not None
    ]


def _system_breakpoints(request: MessagesRequest) -> list[Breakpoint]:
    if not isinstance(request.system, list):
        return []
    blocks = request.system
    return [
        (ttl, _cut(request, system=blocks[: index + 1], messages=[]))
        for index, block in enumerate(blocks)
        if (ttl := ttl_of(block.cache_control, f"system.{index}.cache_control")) is not None
    ]


def _message_breakpoints(request: MessagesRequest) -> list[Breakpoint]:
    found: list[Breakpoint] = []
    for index, message in enumerate(request.messages):
        if isinstance(message.content, str):
            continue
        for block_index, block in enumerate(message.content):
            param = f"messages.{index}.content.{block_index}.cache_control"
            ttl = ttl_of(getattr(block, "cache_control", None), param)
            if ttl is not None:
                cut_message = msgspec.structs.replace(
                    message, content=message.content[: block_index + 1]
                )
                found.append(
                    (ttl, _cut(request, messages=[*request.messages[:index], cut_message]))
                )
    return found


def _last_block_marked(request: MessagesRequest) -> bool:
    content = request.messages[-1].content
    return not isinstance(content, str) and getattr(content[-1], "cache_control", None) is not None


def _cut(request: MessagesRequest, **fields: Any) -> CountTokensRequest:
    """The request with `fields` replaced: the prefix up to a breakpoint."""
    return CountTokensRequest(
        model=request.model,
        messages=fields.get("messages", request.messages),
        system=fields.get("system", request.system),
        tools=fields.get("tools", request.tools),
        tool_choice=request.tool_choice,
        thinking=request.thinking,
    )


def common_prefix_len(left: list[int], right: list[int]) -> int:
    """How many leading tokens the two sequences share."""
    length = 0
    for a, b in zip(left, right):
        if a != b:
            break
        length += 1
    return length


def breakpoint_offsets(
    breakpoints: list[Breakpoint],
    prompt_token_ids: list[int],
    render: Callable[[CountTokensRequest], list[int]],
) -> list[tuple[int, str]]:
    """(token offset, TTL class) of each breakpoint, shortest first, one per offset.

    Args:
        breakpoints: from find_breakpoints.
        prompt_token_ids: the full prompt.
        render: the chat template's tokens of a cut request, without a generation prompt.
    """
    offsets: dict[int, str] = {}
    for ttl, cut in breakpoints:
        if not cut.messages:  # tools or system only: a template needs a turn to render
            cut = msgspec.structs.replace(cut, messages=[InputMessage(role="user", content="")])
        offset = common_prefix_len(render(cut), prompt_token_ids)
        offsets.setdefault(offset, ttl)
    return sorted(offsets.items())
