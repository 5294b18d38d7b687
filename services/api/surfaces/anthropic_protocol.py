"""The Anthropic Messages API's request and response shapes (POST /v1/messages).

Only what kvserve serves is declared; the request fields it cannot honour are refused with a
400 naming them (messages.py), never dropped. Errors use Anthropic's body:
`{"type": "error", "error": {"type": "invalid_request_error", "message": ...}}`.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec

from kvserve.services.api.serving.latency_targets import LatencyTargets
from kvserve.services.api.serving.protocol import Int64


class TextBlock(msgspec.Struct, tag="text", tag_field="type", kw_only=True):
    text: str
    cache_control: dict[str, Any] | None = None  # a breakpoint (surfaces/anthropic_cache.py)


class ImageBlock(msgspec.Struct, tag="image", tag_field="type", kw_only=True):
    source: dict[str, Any]
    cache_control: dict[str, Any] | None = None


class DocumentBlock(msgspec.Struct, tag="document", tag_field="type", kw_only=True):
    source: dict[str, Any]
    cache_control: dict[str, Any] | None = None


class ToolUseBlock(msgspec.Struct, tag="tool_use", tag_field="type", kw_only=True):
    id: str
    name: str
    input: dict[str, Any]
    cache_control: dict[str, Any] | None = None


class ToolResultBlock(msgspec.Struct, tag="tool_result", tag_field="type", kw_only=True):
    tool_use_id: str
    content: str | list[TextBlock | ImageBlock] | None = None
    is_error: bool = False
    cache_control: dict[str, Any] | None = None


class ThinkingBlock(msgspec.Struct, tag="thinking", tag_field="type", kw_only=True):
    thinking: str
    signature: str | None = None


class RedactedThinkingBlock(msgspec.Struct, tag="redacted_thinking", tag_field="type"):
    data: str


ContentBlock = (
    TextBlock
    | ImageBlock
    | DocumentBlock
    | ToolUseBlock
    | ToolResultBlock
    | ThinkingBlock
    | RedactedThinkingBlock
)


class InputMessage(msgspec.Struct, kw_only=True):
    role: Literal["user", "assistant"]
    content: str | list[ContentBlock]


class Tool(msgspec.Struct, kw_only=True):
    name: str
    input_schema: dict[str, Any]
    description: str | None = None
    type: str | None = None  # "custom" or absent; server tools are refused
    cache_control: dict[str, Any] | None = None


class ToolChoice(msgspec.Struct, kw_only=True):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class CountTokensRequest(msgspec.Struct, kw_only=True):
    """POST /v1/messages/count_tokens."""

    model: str
    messages: list[InputMessage]
    system: str | list[TextBlock] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: dict[str, Any] | None = None


class MessagesRequest(CountTokensRequest, kw_only=True):
    """POST /v1/messages."""

    max_tokens: Int64
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = None
    top_p: float | None = None
    top_k: Int64 | None = None
    metadata: dict[str, Any] | None = None
    service_tier: str | None = None
    # kvserve's latency targets for this request (serving/latency_targets.py).
    slo: LatencyTargets | None = None
    # One automatic breakpoint on the last cacheable block (surfaces/anthropic_cache.py).
    cache_control: dict[str, Any] | None = None


# --------------------------------------------------------------------------- responses


class TextOut(msgspec.Struct, tag="text", tag_field="type"):
    text: str


class ThinkingOut(msgspec.Struct, tag="thinking", tag_field="type"):
    thinking: str
    signature: str = ""  # kvserve signs nothing: an earlier turn's thinking is dropped anyway


class ToolUseOut(msgspec.Struct, tag="tool_use", tag_field="type"):
    id: str
    name: str
    input: dict[str, Any]


class CacheCreation(msgspec.Struct):
    """The written prompt tokens by the TTL of the breakpoint they were written for."""

    ephemeral_5m_input_tokens: int = 0
    ephemeral_1h_input_tokens: int = 0


class Usage(msgspec.Struct):
    """Anthropic's usage: input_tokens counts the prompt tokens past the last breakpoint
    (or, without breakpoints, those the prefix cache did not serve)."""

    input_tokens: int
    output_tokens: int
    cache_creation_input_tokens: int = 0
    cache_read_input_tokens: int = 0
    cache_creation: CacheCreation = msgspec.field(default_factory=CacheCreation)


class MessageResponse(msgspec.Struct, tag="message", tag_field="type"):
    id: str
    model: str
    content: list[ThinkingOut | TextOut | ToolUseOut]
    stop_reason: str | None
    stop_sequence: str | None
    usage: Usage
    role: str = "assistant"


class CountTokensResponse(msgspec.Struct):
    input_tokens: int


class ErrorDetail(msgspec.Struct):
    type: str
    message: str


class ErrorBody(msgspec.Struct, tag="error", tag_field="type"):
    error: ErrorDetail


# Anthropic's error types by HTTP status (what its SDK maps back to exception classes).
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    409: "invalid_request_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
}


def error_body(status_code: int, message: str) -> ErrorBody:
    return ErrorBody(ErrorDetail(ERROR_TYPES.get(status_code, "api_error"), message))
