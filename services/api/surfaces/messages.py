"""POST /v1/messages and /v1/messages/count_tokens: the Anthropic Messages API over the chat
path.

A Messages request becomes a chat completions request (system prompt, content blocks, tools,
tool_choice, stop sequences), which the chat handler validates, templates and submits; its
output comes back as Anthropic content blocks (text, tool_use), stop reasons and usage, or
as Anthropic's stream events:

    message_start, ping, (content_block_start, content_block_delta..., content_block_stop)...,
    message_delta (stop_reason, usage), message_stop

Mapped: `tool_choice` auto / any / tool / none -> "auto" / "required" / a named function /
"none" (auto needs --enable-auto-tool-choice and --tool-call-parser, as in chat);
`disable_parallel_tool_use` -> parallel_tool_calls false; `tool_result` blocks -> `tool`
messages; `tool_use` blocks -> an assistant's tool calls; `metadata.user_id` -> `user`.
With --reasoning-parser, the reply's thinking comes back as a `thinking` block (streamed as
`thinking_delta`s); `thinking: {"type": "enabled", "budget_tokens": N}` is the engine's
thinking budget, `{"type": "disabled"}` asks the template not to think (enable_thinking
false). Image blocks of user turns (base64 or url sources) become chat image_url parts, for a
vision model (services/api/serving/multimodal.py). Refused with a 400 naming the field: documents,
`thinking` enabled without a reasoning parser, server tools, a `service_tier` other than auto /
standard_only. Earlier turns' thinking blocks are dropped from the prompt.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import AsyncGenerator, Iterator
from typing import Any, NamedTuple

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from kvserve.services.api.parsers.tool_calls import resolve_tool_choice, tools_for_template
from kvserve.services.api.serving.base import (
    SSEResponse,
    run_until_disconnected,
)
from kvserve.services.api.serving.errors import APIError
from kvserve.services.api.serving.outputs import RequestOutput
from kvserve.services.api.serving.prompt_cache import (
    REQUEST_PINS,
    RequestPins,
    cache_usage,
    make_pin,
)
from kvserve.services.api.serving.protocol import ChatCompletionRequest, DeltaToolCall, ToolCall
from kvserve.services.api.surfaces.anthropic_cache import (
    Breakpoint,
    breakpoint_offsets,
    find_breakpoints,
)
from kvserve.services.api.surfaces.anthropic_protocol import (
    CacheCreation,
    CountTokensRequest,
    CountTokensResponse,
    DocumentBlock,
    ImageBlock,
    InputMessage,
    MessageResponse,
    MessagesRequest,
    RedactedThinkingBlock,
    TextBlock,
    TextOut,
    ThinkingBlock,
    ThinkingOut,
    Tool,
    ToolChoice,
    ToolResultBlock,
    ToolUseBlock,
    ToolUseOut,
    Usage,
    error_body,
)
from kvserve.services.api.surfaces.chat import (
    ChatDelta,
    OpenAIServingChat,
    PreparedChat,
)
from kvserve.shared.logging import init_logger
from kvserve.shared.messages import PromptPin

logger = init_logger(__name__)

_TOOL_CHOICES = {"auto": "auto", "any": "required", "none": "none"}


def _text_of(
    blocks: str | list[TextBlock] | list[TextBlock | ImageBlock] | None, param: str
) -> str:
    if blocks is None or isinstance(blocks, str):
        return blocks or ""
    if any(isinstance(block, ImageBlock) for block in blocks):
        raise APIError(400, "image content needs a vision model; this one reads text", param)
    return "\n".join(block.text for block in blocks if isinstance(block, TextBlock))


def _chat_messages(request: CountTokensRequest) -> list[dict[str, Any]]:
    """The conversation as chat completions messages."""
    messages: list[dict[str, Any]] = []
    system = _text_of(request.system, "system")
    if system:
        messages.append({"role": "system", "content": system})
    for message in request.messages:
        messages.extend(_chat_message(message))
    return messages


def _chat_message(message: InputMessage) -> list[dict[str, Any]]:
    if isinstance(message.content, str):
        return [{"role": message.role, "content": message.content}]
    texts: list[str] = []
    parts: list[dict[str, Any]] = []  # text and images in order, once there is an image
    calls: list[dict[str, Any]] = []
    results: list[dict[str, Any]] = []
    for block in message.content:
        if isinstance(block, TextBlock):
            texts.append(block.text)
            parts.append({"type": "text", "text": block.text})
        elif isinstance(block, ImageBlock) and message.role == "user":
            parts.append({"type": "image_url", "image_url": {"url": _image_url(block)}})
        elif isinstance(block, (ImageBlock, DocumentBlock)):
            raise APIError(
                400,
                "document content (and images outside user turns) are not supported",
                "messages",
            )
        elif isinstance(block, ToolUseBlock):
            if message.role != "assistant":
                raise APIError(400, "tool_use blocks belong to assistant messages", "messages")
            arguments = json.dumps(block.input)
            function = {"name": block.name, "arguments": arguments}
            calls.append({"id": block.id, "type": "function", "function": function})
        elif isinstance(block, ToolResultBlock):
            if message.role != "user":
                raise APIError(400, "tool_result blocks belong to user messages", "messages")
            content = _text_of(block.content, "messages")
            results.append({"role": "tool", "tool_call_id": block.tool_use_id, "content": content})
        else:  # an earlier turn's (redacted) thinking: no reasoning parser to render it
            assert isinstance(block, (ThinkingBlock, RedactedThinkingBlock))
    text = "\n".join(texts)
    if message.role == "assistant":
        entry: dict[str, Any] = {"role": "assistant", "content": text}
        if calls:
            entry["tool_calls"] = calls
        return [entry]
    # A user turn answers its tool calls first, then says whatever else it says.
    if len(parts) > len(
        texts
    ):  # images: the chat path loads them (services/api/serving/multimodal.py)
        return [*results, {"role": "user", "content": parts}]
    return results + ([{"role": "user", "content": text}] if texts or not results else [])


def _image_url(block: ImageBlock) -> str:
    """An Anthropic image source as a chat image_url: base64 data as a data: URL, a url
    source as itself (refused by the chat path when remote)."""
    source = block.source
    kind = source.get("type")
    if kind == "base64":
        media_type, data = source.get("media_type"), source.get("data")
        if not isinstance(media_type, str) or not isinstance(data, str):
            raise APIError(400, "a base64 image source needs media_type and data", "messages")
        return f"data:{media_type};base64,{data}"
    if kind == "url" and isinstance(source.get("url"), str):
        return source["url"]
    raise APIError(400, f"image source type {kind!r} is not supported (base64, url)", "messages")


def to_chat_request(
    request: CountTokensRequest, reasoning_parser: bool = False
) -> ChatCompletionRequest:
    """The chat completions request a Messages (or count_tokens) request asks for.

    Args:
        reasoning_parser: the server splits thinking (--reasoning-parser).

    Raises:
        APIError: 400 for what kvserve cannot honour (module docstring).
    """
    fields: dict[str, Any] = {"model": request.model, "messages": _chat_messages(request)}
    thinking = request.thinking or {}
    if thinking.get("type") == "disabled":
        fields["chat_template_kwargs"] = {"enable_thinking": False}
    elif thinking:
        if not reasoning_parser:
            raise APIError(
                400,
                "extended thinking needs a reasoning parser (--reasoning-parser), which this "
                "server does not have",
                "thinking",
            )
        budget = thinking.get("budget_tokens")
        if budget is not None:
            fields["thinking_token_budget"] = budget
    if request.tools:
        fields["tools"] = _chat_tools(request.tools)
    if request.tool_choice is not None:
        fields |= _tool_choice_fields(request.tool_choice)
    if isinstance(request, MessagesRequest):
        if request.service_tier not in (None, "auto", "standard_only"):
            raise APIError(400, f"service_tier {request.service_tier!r}", "service_tier")
        fields |= {
            "max_tokens": request.max_tokens,
            "stream": request.stream,
            "temperature": request.temperature,
            "top_p": request.top_p,
            "top_k": request.top_k,
            "stop": request.stop_sequences,
        }
        user = (request.metadata or {}).get("user_id")
        if isinstance(user, str):
            fields["user"] = user
    try:
        return msgspec.convert(fields, ChatCompletionRequest)
    except msgspec.ValidationError as exc:
        raise APIError(400, f"invalid request: {exc}") from None


def _chat_tools(tools: list[Tool]) -> list[dict[str, Any]]:
    """Anthropic's client tools as chat function tools; a server tool is a 400."""
    for tool in tools:
        if tool.type not in (None, "custom"):
            raise APIError(400, f"server tool {tool.type!r} is not supported", "tools")
    return [
        {
            "type": "function",
            "function": {
                "name": tool.name,
                "description": tool.description,
                "parameters": tool.input_schema,
            },
        }
        for tool in tools
    ]


def _tool_choice_fields(choice: ToolChoice) -> dict[str, Any]:
    """Anthropic's tool_choice as the chat request's tool_choice and parallel_tool_calls."""
    fields: dict[str, Any] = {}
    if choice.type == "tool":
        if not choice.name:
            raise APIError(400, 'tool_choice {"type": "tool"} needs a name', "tool_choice")
        fields["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
    else:
        fields["tool_choice"] = _TOOL_CHOICES[choice.type]
    if choice.disable_parallel_tool_use:
        fields["parallel_tool_calls"] = False
    return fields


def _tool_input(call: ToolCall) -> dict[str, Any]:
    try:
        arguments = json.loads(call.function.arguments)
    except ValueError:
        arguments = None
    return arguments if isinstance(arguments, dict) else {}


def _stop(completion, num_calls: int) -> tuple[str | None, str | None]:
    """(stop_reason, stop_sequence) of a finished choice."""
    if completion.finish_reason == "length":
        return "max_tokens", None
    if num_calls:
        return "tool_use", None
    if isinstance(completion.stop_reason, str):  # a stop sequence matched
        return "stop_sequence", completion.stop_reason
    return "end_turn", None


class PromptCache(NamedTuple):
    """A request's breakpoints as pins (shortest first) and the engine's block size."""

    pins: list[PromptPin]
    block_size: int


NO_CACHE = PromptCache([], 16)


def _usage(
    final: RequestOutput | None,
    num_prompt_tokens: int,
    num_output_tokens: int,
    cache: PromptCache = NO_CACHE,
) -> Usage:
    """Anthropic's usage. With breakpoints, as Anthropic counts them (prompt_cache.cache_usage):
    the prefix up to the last breakpoint is read or written (by TTL), input_tokens is the
    rest. Without, input_tokens excludes the prompt tokens the prefix cache served, which are
    cache_read_input_tokens."""
    cached = final.num_cached_tokens if final is not None else 0
    if not cache.pins:
        return Usage(num_prompt_tokens - cached, num_output_tokens, 0, cached)
    counted = cache_usage(cache.pins, cached, cache.block_size)
    created = counted.created or {}
    return Usage(
        num_prompt_tokens - counted.cached_prefix,
        num_output_tokens,
        sum(created.values()),
        counted.read,
        CacheCreation(created.get("5m", 0), created.get("1h", 0)),
    )


def _event(name: str, body: dict[str, Any]) -> bytes:
    return b"event: " + name.encode() + b"\ndata: " + msgspec.json.encode(body) + b"\n\n"


class AnthropicServingMessages:
    """The Messages API over the chat handler (its checks, template, tool parsing)."""

    def __init__(self, chat: OpenAIServingChat):
        self.chat = chat

    def count_tokens(self, request: CountTokensRequest) -> CountTokensResponse:
        chat_request = to_chat_request(request, self.chat.splits_reasoning)
        self.chat.check_model(chat_request.model)
        tool_choice = resolve_tool_choice(chat_request, self.chat.frontend)
        token_ids = self.chat.prompt_token_ids(chat_request, tool_choice, {})
        return CountTokensResponse(len(token_ids))

    async def create_message(self, request: MessagesRequest, raw_request: Request) -> Response:
        breakpoints = find_breakpoints(request)
        # max_tokens 0 writes the cache and generates nothing (a pre-warm): the engine runs
        # the prompt and one token, which the reply leaves out.
        prewarm = request.max_tokens == 0
        if prewarm and request.stream:
            raise APIError(400, "max_tokens 0 (a cache pre-warm) cannot stream", "max_tokens")
        submitted = msgspec.structs.replace(request, max_tokens=1) if prewarm else request
        chat_request = to_chat_request(submitted, self.chat.splits_reasoning)
        prepared = self.chat.prepare(chat_request, raw_request, "msg_")
        cache = self._prompt_cache(breakpoints, prepared.prompt_token_ids)
        REQUEST_PINS.set(RequestPins(tuple(cache.pins)))
        if request.stream:
            results = await self.chat.start(prepared, chat_request)
            return SSEResponse(self._stream(prepared, chat_request, results, cache))
        return await run_until_disconnected(
            raw_request, self._complete(prepared, chat_request, cache, prewarm)
        )

    def _prompt_cache(
        self, breakpoints: list[Breakpoint], prompt_token_ids: list[int]
    ) -> PromptCache:
        """The breakpoints' pins at their token offsets in the prompt."""
        handshakes = self.chat.engine_client.engine_handshakes()
        block_size = handshakes[0].block_size if handshakes else NO_CACHE.block_size
        if not breakpoints:
            return PromptCache([], block_size)
        offsets = breakpoint_offsets(breakpoints, prompt_token_ids, self._render_prefix)
        return PromptCache([make_pin(offset, ttl) for offset, ttl in offsets], block_size)

    def _render_prefix(self, request: CountTokensRequest) -> list[int]:
        """The chat template's tokens of a request cut after a breakpoint's block."""
        chat_request = to_chat_request(request, self.chat.splits_reasoning)
        tool_choice = resolve_tool_choice(chat_request, self.chat.frontend)
        return self.chat.apply_chat_template(
            chat_request.messages,
            False,
            chat_template_kwargs=chat_request.chat_template_kwargs,
            tools=tools_for_template(chat_request, tool_choice, self.chat.frontend),
        )

    async def _complete(
        self,
        prepared: PreparedChat,
        request: ChatCompletionRequest,
        cache: PromptCache,
        prewarm: bool,
    ) -> Response:
        final = await self.chat.final_output(prepared, request)
        completion = final.outputs[0]
        if prewarm:  # the prompt is cached; the one token it ran for is not the reply
            completion = dataclasses.replace(completion, text="", token_ids=[])
        reasoning, content, calls = self.chat.parse_whole(prepared, request, completion.text)
        blocks: list[ThinkingOut | TextOut | ToolUseOut] = (
            [ThinkingOut(reasoning)] if reasoning else []
        )
        blocks += [TextOut(content)] if content else []
        blocks += [ToolUseOut(c.id, c.function.name, _tool_input(c)) for c in calls]
        stop_reason, stop_sequence = _stop(completion, len(calls))
        body = MessageResponse(
            id=prepared.ids[0],
            model=self.chat.response_model(request.model),
            content=blocks or ([] if prewarm else [TextOut("")]),
            stop_reason=stop_reason,
            stop_sequence=stop_sequence,
            usage=_usage(final, len(prepared.prompt_token_ids), len(completion.token_ids), cache),
        )
        return Response(msgspec.json.encode(body), media_type="application/json")

    async def _stream(
        self,
        prepared: PreparedChat,
        request: ChatCompletionRequest,
        results: AsyncGenerator[tuple[int, RequestOutput], None],
        cache: PromptCache,
    ) -> AsyncGenerator[bytes, None]:
        num_prompt_tokens = len(prepared.prompt_token_ids)
        yield _event(
            "message_start",
            {
                "type": "message_start",
                "message": msgspec.to_builtins(
                    MessageResponse(
                        id=prepared.ids[0],
                        model=self.chat.response_model(request.model),
                        content=[],
                        stop_reason=None,
                        stop_sequence=None,
                        usage=Usage(num_prompt_tokens, 0),
                    )
                ),
            },
        )
        yield _event("ping", {"type": "ping"})
        blocks = _BlockWriter()
        try:
            async for step in self.chat.chat_deltas(prepared, request, results):
                for event in blocks.step_events(step):
                    yield event
                if step.finish_reason is not None:
                    for event in blocks.close():
                        yield event
                    for event in _finish_events(step, num_prompt_tokens, cache):
                        yield event
                    return
        except Exception as exc:  # noqa: BLE001 - the status is sent: report in the stream
            logger.warning("messages stream %s failed: %r", prepared.ids[0], exc)
            status = exc.status_code if isinstance(exc, APIError) else 500
            message = exc.message if isinstance(exc, APIError) else f"{type(exc).__name__}: {exc}"
            yield _event("error", msgspec.to_builtins(error_body(status, message)))
        finally:
            await results.aclose()


def _finish_events(step: ChatDelta, num_prompt_tokens: int, cache: PromptCache) -> list[bytes]:
    """message_delta (stop reason and usage), then message_stop."""
    completion = step.final.outputs[0]
    stop_reason, stop_sequence = _stop(completion, step.num_calls)
    usage = _usage(step.final, num_prompt_tokens, len(completion.token_ids), cache)
    return [
        _event(
            "message_delta",
            {
                "type": "message_delta",
                "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
                "usage": msgspec.to_builtins(usage),
            },
        ),
        _event("message_stop", {"type": "message_stop"}),
    ]


class _BlockWriter:
    """The content blocks of one Messages stream: thinking, text and tool_use blocks, each
    opened by content_block_start, grown by content_block_deltas, ended by
    content_block_stop; a block of another kind closes the one before."""

    def __init__(self):
        self.index = -1  # the block being written
        self.open_block = False
        self.block_type: str | None = None

    def step_events(self, step: ChatDelta) -> Iterator[bytes]:
        """The events of one step of the chat: its thinking, text and tool-call pieces."""
        if step.reasoning:
            if self.block_type != "thinking":
                yield from self._start({"type": "thinking", "thinking": "", "signature": ""})
                self.block_type = "thinking"
            yield self._delta({"type": "thinking_delta", "thinking": step.reasoning})
        if step.content:
            if self.block_type != "text":
                yield from self._start({"type": "text", "text": ""})
                self.block_type = "text"
            yield self._delta({"type": "text_delta", "text": step.content})
        for call in step.tool_deltas:
            yield from self._tool_call_events(call)

    def _tool_call_events(self, call: DeltaToolCall) -> Iterator[bytes]:
        function = call.function
        if call.id is not None:  # a new call
            name = function.name if function is not None else ""
            block: dict[str, Any] = {"type": "tool_use", "id": call.id, "name": name, "input": {}}
            yield from self._start(block)
            self.block_type = "tool_use"
        if function is not None and function.arguments:
            yield self._delta({"type": "input_json_delta", "partial_json": function.arguments})

    def close(self) -> list[bytes]:
        """content_block_stop for the open block, if one is."""
        if not self.open_block:
            return []
        self.open_block = False
        return [_event("content_block_stop", {"type": "content_block_stop", "index": self.index})]

    def _start(self, block: dict[str, Any]) -> list[bytes]:
        events = self.close()
        self.index, self.open_block = self.index + 1, True
        events.append(
            _event(
                "content_block_start",
                {"type": "content_block_start", "index": self.index, "content_block": block},
            )
        )
        return events

    def _delta(self, delta: dict[str, Any]) -> bytes:
        return _event(
            "content_block_delta",
            {"type": "content_block_delta", "index": self.index, "delta": delta},
        )
