"""The OpenAI Responses API's request and response shapes (POST /v1/responses).

The request declares every field OpenAI's documents name, so that one kvserve cannot honour is
refused with a 400 naming it (responses.py), never dropped; a field it does not know
at all is a 400 too (forbid_unknown_fields). `input` items stay JSON objects here: a message
may come without its "type", and responses.py reads each kind.
"""

from __future__ import annotations

from typing import Any

import msgspec

from kvserve.services.api.serving.latency_targets import LatencyTargets
from kvserve.services.api.serving.protocol import Int64


class FunctionTool(msgspec.Struct, kw_only=True):
    """A tool of the request; only type "function" is served (others: a 400)."""

    type: str
    name: str | None = None
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ResponsesRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """POST /v1/responses."""

    model: str | None = None
    input: str | list[dict[str, Any]] = ""
    instructions: str | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None
    max_output_tokens: Int64 | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    store: bool = True
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    service_tier: str | None = None
    # kvserve's latency targets for this request (serving/latency_targets.py).
    slo: LatencyTargets | None = None
    # Asked-for features kvserve does not have: a 400 unless absent or at their defaults.
    include: list[str] | None = None
    truncation: str | None = None
    reasoning: dict[str, Any] | None = None
    background: bool | None = None
    top_logprobs: Int64 | None = None
    max_tool_calls: Int64 | None = None
    prompt: dict[str, Any] | None = None
    conversation: str | dict[str, Any] | None = None
    stream_options: dict[str, Any] | None = None
    # vLLM's extra, with --reasoning-parser: the engine ends the thinking after this many.
    thinking_token_budget: Int64 | None = None


class InputTokensDetails(msgspec.Struct):
    cached_tokens: int


class OutputTokensDetails(msgspec.Struct):
    reasoning_tokens: int = 0


class ResponseUsage(msgspec.Struct):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class OutputText(msgspec.Struct, tag="output_text", tag_field="type"):
    text: str
    annotations: list[Any] = msgspec.field(default_factory=list)
    logprobs: list[Any] = msgspec.field(default_factory=list)


class MessageItem(msgspec.Struct, tag="message", tag_field="type"):
    id: str
    content: list[OutputText]
    status: str = "completed"
    role: str = "assistant"


class FunctionCallItem(msgspec.Struct, tag="function_call", tag_field="type"):
    id: str
    call_id: str
    name: str
    arguments: str
    status: str = "completed"


class ReasoningText(msgspec.Struct, tag="reasoning_text", tag_field="type"):
    text: str


class ReasoningItem(msgspec.Struct, tag="reasoning", tag_field="type"):
    """The thinking (--reasoning-parser), as is: kvserve writes no summaries."""

    id: str
    content: list[ReasoningText]
    summary: list[Any] = msgspec.field(default_factory=list)
    status: str = "completed"


OutputItem = ReasoningItem | MessageItem | FunctionCallItem


class IncompleteDetails(msgspec.Struct):
    reason: str


class ResponseObject(msgspec.Struct, tag="response", tag_field="object", kw_only=True):
    """A response, whole (and what GET /v1/responses/{id} returns while it is stored)."""

    id: str
    created_at: int
    status: str  # in_progress | completed | incomplete
    model: str
    output: list[OutputItem]
    usage: ResponseUsage | None
    instructions: str | None
    tools: list[dict[str, Any]]
    tool_choice: str | dict[str, Any]
    parallel_tool_calls: bool
    temperature: float | None
    top_p: float | None
    max_output_tokens: int | None
    previous_response_id: str | None
    text: dict[str, Any]
    metadata: dict[str, str]
    store: bool
    error: dict[str, Any] | None = None
    incomplete_details: IncompleteDetails | None = None
    truncation: str = "disabled"
    reasoning: dict[str, Any] | None = None
    user: str | None = None
    service_tier: str = "default"
