"""POST /v1/responses and GET /v1/responses/{id}: the OpenAI Responses API over the chat path.

A Responses request becomes a chat completions request (instructions, input items, function
tools, tool_choice, text.format, max_output_tokens), which the chat handler validates,
templates and submits; its output comes back as output items (a message with its
output_text, function_call items), a status and usage, or as the Responses stream events:

    response.created, response.in_progress,
    per item: response.output_item.added,
        a message: response.content_part.added, response.output_text.delta...,
                   response.output_text.done, response.content_part.done
        a call:    response.function_call_arguments.delta..., ...arguments.done
    response.output_item.done; then response.completed (or response.incomplete at the limit)

Input items: messages (role user / system / developer / assistant; string content or
input_text / output_text parts), `function_call` and `function_call_output`; earlier turns'
`reasoning` items are dropped from the prompt. With --reasoning-parser the reply's thinking
is a `reasoning` output item (its text as a reasoning_text part, streamed as
response.reasoning_text.delta events), `reasoning.effort` goes to the chat template and
`thinking_token_budget` (vLLM's extra) is the engine's thinking budget. `store` (the default)
keeps the response and its conversation in a bounded in-memory store (--responses-store-size,
--responses-store-ttl), per api process: `previous_response_id` continues it (its
instructions are not carried over, as in OpenAI's API) and GET returns it; an id not there is
a 404. Refused with a 400 naming the field: non-function tools, images and files, `include`
entries, `truncation: auto`, `reasoning` (without a reasoning parser; its summaries always),
`background`, `top_logprobs`, `max_tool_calls`,
prompt templates, conversations, `item_reference` items.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import AsyncGenerator, Callable
from typing import Any

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from kvserve.services.api.serving.base import (
    SSEResponse,
    run_until_disconnected,
)
from kvserve.services.api.serving.errors import APIError
from kvserve.services.api.serving.outputs import RequestOutput
from kvserve.services.api.serving.protocol import ChatCompletionRequest, ToolCall
from kvserve.services.api.surfaces.chat import OpenAIServingChat, PreparedChat
from kvserve.services.api.surfaces.responses_protocol import (
    FunctionCallItem,
    IncompleteDetails,
    InputTokensDetails,
    MessageItem,
    OutputItem,
    OutputText,
    OutputTokensDetails,
    ReasoningItem,
    ReasoningText,
    ResponseObject,
    ResponsesRequest,
    ResponseUsage,
)
from kvserve.services.api.surfaces.responses_stream import EventWriter, OutputWriter, new_id
from kvserve.shared.logging import init_logger

logger = init_logger(__name__)

_TEXT_PARTS = ("input_text", "output_text", "text")


class StoredResponse(msgspec.Struct):
    response: ResponseObject
    conversation: list[dict[str, Any]]  # chat messages: its input and its output
    expires_at: float


class ResponseStore:
    """Responses kept for previous_response_id and GET: at most `size`, each for `ttl`
    seconds, the oldest dropped first. In memory, in this api process."""

    def __init__(self, size: int, ttl: float, clock: Callable[[], float] = time.monotonic):
        self.size, self.ttl, self.clock = size, ttl, clock
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()

    def put(self, response: ResponseObject, conversation: list[dict[str, Any]]) -> None:
        if self.size <= 0:
            return
        self._entries[response.id] = StoredResponse(response, conversation, self.clock() + self.ttl)
        self._entries.move_to_end(response.id)
        while len(self._entries) > self.size:
            self._entries.popitem(last=False)

    def get(self, response_id: str) -> StoredResponse:
        """The stored response; a 404 (OpenAI's error shape) when absent or expired."""
        entry = self._entries.get(response_id)
        if entry is not None and entry.expires_at <= self.clock():
            del self._entries[response_id]
            entry = None
        if entry is None:
            raise APIError(
                404,
                f"no response {response_id!r} here (never stored, or dropped: "
                f"--responses-store-size {self.size}, --responses-store-ttl {self.ttl:g} s)",
                "previous_response_id",
            )
        return entry


def _text_of(content: Any, where: str) -> str:
    """A message's or a function_call_output's content as text."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise APIError(400, f"{where}: content must be a string or a list of parts", "input")
    texts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in _TEXT_PARTS and isinstance(part.get("text"), str):
            texts.append(part["text"])
        elif kind == "refusal":
            texts.append(str(part.get("refusal", "")))
        elif kind in ("input_image", "input_file", "input_audio"):
            raise APIError(
                400, f"{where}: {kind} needs a model that reads it; this one reads text", "input"
            )
        else:
            raise APIError(400, f"{where}: unknown content part {kind!r}", "input")
    return "\n".join(texts)


def input_messages(items: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The request's input items as chat completions messages."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    messages: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        kind = item.get("type", "message")
        where = f"input[{i}]"
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise APIError(400, f"{where}: role {role!r}", "input")
            text = _text_of(item.get("content", ""), where)
            messages.append({"role": "system" if role == "developer" else role, "content": text})
        elif kind == "function_call":
            for key in ("call_id", "name", "arguments"):
                if not isinstance(item.get(key), str):
                    raise APIError(400, f"{where}: a function_call needs {key} (a string)", "input")
            call = {
                "id": item["call_id"],
                "type": "function",
                "function": {"name": item["name"], "arguments": item["arguments"]},
            }
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and "tool_calls" in last:
                last["tool_calls"].append(call)  # parallel calls: one assistant turn
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            if not isinstance(item.get("call_id"), str):
                raise APIError(400, f"{where}: a function_call_output needs call_id", "input")
            output = _text_of(item.get("output", ""), where)
            messages.append({"role": "tool", "tool_call_id": item["call_id"], "content": output})
        elif kind == "reasoning":
            continue  # an earlier turn's thinking: no reasoning parser to render it
        else:
            raise APIError(400, f"{where}: input items of type {kind!r} are not supported", "input")
    return messages


def _refuse_unsupported(request: ResponsesRequest, reasoning_parser: bool) -> None:
    reasoning = request.reasoning or {}
    asked = {
        "include": bool(request.include),
        "truncation": request.truncation not in (None, "disabled"),
        # With a reasoning parser the effort goes to the chat template; summaries never.
        "reasoning": reasoning.get("summary") is not None
        or reasoning.get("generate_summary") is not None
        or (not reasoning_parser and any(value is not None for value in reasoning.values())),
        "background": bool(request.background),
        "top_logprobs": bool(request.top_logprobs),
        "max_tool_calls": request.max_tool_calls is not None,
        "prompt": request.prompt is not None,
        "conversation": request.conversation is not None,
        "service_tier": request.service_tier not in (None, "auto", "default"),
    }
    for field, is_asked in asked.items():
        if is_asked:
            raise APIError(400, f"{field} is not supported by this server", field)
    if request.stream_options and not request.stream:
        raise APIError(400, "stream_options needs stream: true", "stream_options")


def _response_format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    """text.format as chat's response_format."""
    spec = (text or {}).get("format")
    if spec is not None and not isinstance(spec, dict):
        raise APIError(400, "text.format must be an object", "text")
    if spec is None or spec.get("type") == "text":
        return None
    if spec.get("type") == "json_object":
        return {"type": "json_object"}
    if spec.get("type") == "json_schema":
        schema = {"name": spec.get("name", "response"), "schema": spec.get("schema")}
        if spec.get("strict") is not None:
            schema["strict"] = spec["strict"]
        return {"type": "json_schema", "json_schema": schema}
    raise APIError(400, f"text.format type {spec.get('type')!r}", "text")


def _tool_choice(choice: str | dict[str, Any] | None) -> Any:
    if choice is None or isinstance(choice, str):
        return choice
    if choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise APIError(400, f"tool_choice {choice!r} is not supported", "tool_choice")


def to_chat_request(
    request: ResponsesRequest, history: list[dict[str, Any]], reasoning_parser: bool = False
) -> tuple[ChatCompletionRequest, list[dict[str, Any]]]:
    """The chat completions request a Responses request asks for, and the conversation it
    continues with (history + this input, without the instructions).

    Args:
        reasoning_parser: the server splits thinking (--reasoning-parser).

    Raises:
        APIError: 400 for what kvserve cannot honour (module docstring).
    """
    _refuse_unsupported(request, reasoning_parser)
    conversation = history + input_messages(request.input)
    messages = list(conversation)
    if request.instructions:
        messages.insert(0, {"role": "system", "content": request.instructions})
    fields: dict[str, Any] = {
        "model": request.model,
        "messages": messages,
        "stream": request.stream,
        "temperature": request.temperature,
        "top_p": request.top_p,
        "max_tokens": request.max_output_tokens,
        "response_format": _response_format(request.text),
        "user": request.user or request.safety_identifier,
        "reasoning_effort": (request.reasoning or {}).get("effort"),
        "thinking_token_budget": request.thinking_token_budget,
    }
    if request.tools:
        for tool in request.tools:
            if tool.type != "function" or not tool.name:
                raise APIError(400, f"tools of type {tool.type!r} are not supported", "tools")
        fields["tools"] = [
            {
                "type": "function",
                "function": {
                    "name": tool.name,
                    "description": tool.description,
                    "parameters": tool.parameters or {"type": "object", "properties": {}},
                }
                | ({"strict": tool.strict} if tool.strict is not None else {}),
            }
            for tool in request.tools
        ]
    if request.tool_choice is not None:
        fields["tool_choice"] = _tool_choice(request.tool_choice)
    if request.parallel_tool_calls is not None:
        fields["parallel_tool_calls"] = request.parallel_tool_calls
    fields = {key: value for key, value in fields.items() if value is not None}
    try:
        return msgspec.convert(fields, ChatCompletionRequest), conversation
    except msgspec.ValidationError as exc:
        raise APIError(400, f"invalid request: {exc}") from None


def _function_call(call: ToolCall) -> FunctionCallItem:
    return FunctionCallItem(new_id("fc"), call.id, call.function.name, call.function.arguments)


def _usage(final: RequestOutput, num_prompt_tokens: int, num_output_tokens: int) -> ResponseUsage:
    return ResponseUsage(
        num_prompt_tokens,
        InputTokensDetails(final.num_cached_tokens),
        num_output_tokens,
        OutputTokensDetails(),
        num_prompt_tokens + num_output_tokens,
    )


def _output_messages(items: list[OutputItem]) -> list[dict[str, Any]]:
    """A response's output as the chat messages a follow-up turn starts from."""
    text = "".join(
        part.text for item in items if isinstance(item, MessageItem) for part in item.content
    )
    calls = [
        {
            "id": item.call_id,
            "type": "function",
            "function": {"name": item.name, "arguments": item.arguments},
        }
        for item in items
        if isinstance(item, FunctionCallItem)
    ]
    message: dict[str, Any] = {"role": "assistant", "content": text}
    if calls:
        message["tool_calls"] = calls
    return [message]


class OpenAIServingResponses:
    """The Responses API over the chat handler (its checks, template, tool parsing)."""

    def __init__(self, chat: OpenAIServingChat, store: ResponseStore):
        self.chat = chat
        self.store = store

    def retrieve(self, response_id: str) -> ResponseObject:
        return self.store.get(response_id).response

    async def create(self, request: ResponsesRequest, raw_request: Request) -> Response:
        history: list[dict[str, Any]] = []
        if request.previous_response_id is not None:
            history = list(self.store.get(request.previous_response_id).conversation)
        chat_request, conversation = to_chat_request(request, history, self.chat.splits_reasoning)
        prepared = self.chat.prepare(chat_request, raw_request, "resp_")
        if request.stream:
            results = await self.chat.start(prepared, chat_request)
            return SSEResponse(self._stream(request, prepared, chat_request, conversation, results))
        return await run_until_disconnected(
            raw_request, self._complete(request, prepared, chat_request, conversation)
        )

    def _response(
        self,
        request: ResponsesRequest,
        prepared: PreparedChat,
        output: list[OutputItem],
        status: str,
        usage: ResponseUsage | None,
    ) -> ResponseObject:
        chat_tools = [msgspec.to_builtins(tool) for tool in (request.tools or ())]
        return ResponseObject(
            id=prepared.ids[0],
            created_at=int(time.time()),
            status=status,
            model=self.chat.response_model(request.model),
            output=output,
            usage=usage,
            instructions=request.instructions,
            tools=chat_tools,
            tool_choice=request.tool_choice or "auto",
            parallel_tool_calls=request.parallel_tool_calls is not False,
            temperature=request.temperature,
            top_p=request.top_p,
            max_output_tokens=request.max_output_tokens,
            previous_response_id=request.previous_response_id,
            text=request.text or {"format": {"type": "text"}},
            metadata=request.metadata or {},
            store=request.store,
            incomplete_details=(
                IncompleteDetails("max_output_tokens") if status == "incomplete" else None
            ),
            user=request.user,
        )

    def _finish(
        self,
        request: ResponsesRequest,
        prepared: PreparedChat,
        output: list[OutputItem],
        final: RequestOutput,
        conversation: list[dict[str, Any]],
    ) -> ResponseObject:
        completion = final.outputs[0]
        status = "incomplete" if completion.finish_reason == "length" else "completed"
        usage = _usage(final, len(prepared.prompt_token_ids), len(completion.token_ids))
        response = self._response(request, prepared, output, status, usage)
        if request.store:
            self.store.put(response, conversation + _output_messages(output))
        logger.info("response %s %s: %d output items", response.id, status, len(output))
        return response

    async def _complete(
        self,
        request: ResponsesRequest,
        prepared: PreparedChat,
        chat_request: ChatCompletionRequest,
        conversation: list[dict[str, Any]],
    ) -> Response:
        final = await self.chat.final_output(prepared, chat_request)
        reasoning, content, calls = self.chat.parse_whole(
            prepared, chat_request, final.outputs[0].text
        )
        output: list[OutputItem] = []
        if reasoning:
            output.append(ReasoningItem(new_id("rs"), [ReasoningText(reasoning)]))
        if content or not calls:
            output.append(MessageItem(new_id("msg"), [OutputText(content or "")]))
        output += [_function_call(call) for call in calls]
        response = self._finish(request, prepared, output, final, conversation)
        return Response(msgspec.json.encode(response), media_type="application/json")

    async def _stream(
        self,
        request: ResponsesRequest,
        prepared: PreparedChat,
        chat_request: ChatCompletionRequest,
        conversation: list[dict[str, Any]],
        results: AsyncGenerator[tuple[int, RequestOutput], None],
    ) -> AsyncGenerator[bytes, None]:
        events = EventWriter()
        output: list[OutputItem] = []
        started = self._response(request, prepared, output, "in_progress", None)
        yield events.send("response.created", response=started)
        yield events.send("response.in_progress", response=started)
        items = OutputWriter(events, output)
        try:
            async for step in self.chat.chat_deltas(prepared, chat_request, results):
                for event in items.step_events(step):
                    yield event
                if step.finish_reason is not None:
                    for event in items.finish_events():
                        yield event
                    response = self._finish(request, prepared, output, step.final, conversation)
                    name = (
                        "response.completed"
                        if response.status == "completed"
                        else "response.incomplete"
                    )
                    yield events.send(name, response=response)
                    return
        except Exception as exc:  # noqa: BLE001 - the status is sent: report in the stream
            logger.warning("responses stream %s failed: %r", prepared.ids[0], exc)
            status = exc.status_code if isinstance(exc, APIError) else 500
            message = exc.message if isinstance(exc, APIError) else f"{type(exc).__name__}: {exc}"
            failed = self._response(request, prepared, output, "failed", None)
            failed.error = {
                "code": "server_error" if status >= 500 else "invalid_request",
                "message": message,
            }
            yield events.send("response.failed", response=failed)
        finally:
            await results.aclose()
