"""Bodies of the OpenAI surface's own routes: completions, chat completions (whole and
streamed), tokenize and detokenize, one msgspec Struct each.

The shapes every surface shares (the chat request the others translate into, tool calls,
usage, prompt logprobs, the model list) and how a body decodes are serving/protocol.py's.
Responses follow OpenAI's shapes, plus vLLM's extras: `stop_reason` on each choice,
`prompt_logprobs` (on each completion choice, on the chat response) and
`usage.prompt_tokens_details.cached_tokens`.
"""

from __future__ import annotations

import msgspec
from msgspec import UNSET, UnsetType

from kvserve.services.api.serving.protocol import (
    ChatMessage,
    DeltaToolCall,
    Int64,
    PromptLogprobsBody,
    SamplingRequest,
    ToolCall,
    UsageInfo,
    now_seconds,
)


class CompletionRequest(SamplingRequest, kw_only=True):
    """POST /v1/completions. `prompt`: a string, a list of strings, a list of token ids or a
    list of token-id lists (msgspec allows one array type per union, so the list's items are
    checked for consistency by the server)."""

    prompt: str | list[str | Int64 | list[Int64]]
    max_tokens: Int64 | None = None  # None: up to max_model_len
    logprobs: Int64 | None = None
    echo: bool = False
    suffix: str | None = None  # refused when set (UNSUPPORTED_FIELDS)
    best_of: Int64 | None = None  # refused unless it equals n


class TokenizeRequest(msgspec.Struct, kw_only=True):
    """POST /tokenize: either `prompt` or `messages` (vLLM's shape)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(msgspec.Struct, kw_only=True):
    model: str | None = None
    tokens: list[Int64]


class CompletionLogprobs(msgspec.Struct):
    text_offset: list[int] = []
    token_logprobs: list[float | None] = []
    tokens: list[str] = []
    top_logprobs: list[dict[str, float] | None] = []


class CompletionChoice(msgspec.Struct):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: str | None
    stop_reason: int | str | None = None
    # Non-streamed choices only (null unless asked for); left out of stream chunks.
    prompt_logprobs: PromptLogprobsBody | None | UnsetType = UNSET


class CompletionResponse(msgspec.Struct, kw_only=True):
    id: str
    object: str = "text_completion"
    created: int = msgspec.field(default_factory=now_seconds)
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo


class CompletionStreamResponse(msgspec.Struct, kw_only=True):
    id: str
    object: str = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    # UNSET (left out) unless stream_options.include_usage; then null until the last chunk.
    usage: UsageInfo | None | UnsetType = UNSET


class TopLogprob(msgspec.Struct):
    token: str
    logprob: float
    bytes: list[int] | None


class ChatLogprobEntry(msgspec.Struct):
    token: str
    logprob: float
    bytes: list[int] | None
    top_logprobs: list[TopLogprob]


class ChatLogprobs(msgspec.Struct):
    content: list[ChatLogprobEntry] | None


class ChatResponseMessage(msgspec.Struct):
    role: str
    content: str | None
    tool_calls: list[ToolCall] = []
    # The thinking, split off by --reasoning-parser (absent without one): `reasoning` as
    # vLLM >= 0.11 names it, and `reasoning_content`, its older name, which clients still read.
    reasoning: str | None | msgspec.UnsetType = msgspec.UNSET
    reasoning_content: str | None | msgspec.UnsetType = msgspec.UNSET


class ChatChoice(msgspec.Struct):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None
    finish_reason: str | None
    stop_reason: int | str | None = None


class ChatCompletionResponse(msgspec.Struct, kw_only=True):
    id: str
    object: str = "chat.completion"
    created: int = msgspec.field(default_factory=now_seconds)
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo
    prompt_logprobs: PromptLogprobsBody | None = None


class DeltaMessage(msgspec.Struct, omit_defaults=True):
    role: str | None = None
    content: str | None = None
    reasoning: str | None = None  # vLLM's name, and its older one below: the same text
    reasoning_content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatStreamChoice(msgspec.Struct):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None
    finish_reason: str | None
    stop_reason: int | str | None = None


class ChatCompletionStreamResponse(msgspec.Struct, kw_only=True):
    id: str
    object: str = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None | UnsetType = UNSET


class TokenizeResponse(msgspec.Struct):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeResponse(msgspec.Struct):
    prompt: str
