"""One streamed chat completion's chunks: per choice its progress, reasoning split, tool
parsing (or harmony channels) and logprobs (services/api/surfaces/chat.py submits it)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, NamedTuple

import msgspec

from kvserve.services.api.parsers.reasoning_parsers import ReasoningParser, ReasoningSplitter
from kvserve.services.api.serving.base import (
    StreamedChoice,
    raise_if_failed,
    sse_event,
    stop_holdback,
)
from kvserve.services.api.serving.outputs import CompletionOutput, RequestOutput
from kvserve.services.api.serving.protocol import (
    UNSET,
    ChatCompletionRequest,
    UsageInfo,
    now_seconds,
)
from kvserve.services.api.surfaces.openai_protocol import (
    ChatCompletionStreamResponse,
    ChatStreamChoice,
    DeltaMessage,
)
from kvserve.shared.sampling_params import SamplingParams


class PreparedChat(NamedTuple):
    """A validated, templated chat request, ready to submit."""

    ids: tuple[str, str]  # (the response's id, the engine's id)
    prompt_token_ids: list[int]
    params: SamplingParams
    tool_choice: str  # resolved: "none", "auto", "required" or a function's name
    # The reasoning parser when the reply starts thinking (None: all of it is the answer).
    reasoning: ReasoningParser | None = None
    # The reply is harmony, split by channel (gpt-oss, tool_choice auto or none).
    harmony: bool = False


class ChatStream:
    """One streamed chat request: per choice its progress, tool parsing and reasoning split,
    and the chunks it emits.

    Args:
        serving: the chat endpoint (tool parsing, logprobs, model name, usage).
        prepared: the request as submitted.
        request: the request.
    """

    def __init__(self, serving: Any, prepared: PreparedChat, request: ChatCompletionRequest):
        self.serving = serving
        self.request = request
        self.request_id = prepared.ids[0]
        self.created = now_seconds()
        self.usage: UsageInfo | msgspec.UnsetType | None = None if request.include_usage else UNSET
        params = prepared.params
        self.num_choices = params.n
        self.streamed = [StreamedChoice(stop_holdback(params)) for _ in range(params.n)]
        self.tool_outputs = [
            serving.tool_output(request, prepared.tool_choice) for _ in range(params.n)
        ]
        self.splitters = [
            ReasoningSplitter(prepared.reasoning) if prepared.reasoning else None
            for _ in range(params.n)
        ]
        self.harmony = [serving.harmony_output(prepared, request) for _ in range(params.n)]

    def role_chunks(self) -> Iterator[bytes]:
        """OpenAI opens every choice with the role and empty content."""
        for index in range(self.num_choices):
            yield self._chunk([ChatStreamChoice(index, DeltaMessage("assistant", ""), None, None)])

    def output_chunks(self, final: RequestOutput) -> Iterator[bytes]:
        """One chunk per choice of `final` that has something new; failures raise."""
        raise_if_failed(final)
        for completion in final.outputs:
            choice = self._choice(completion)
            if choice is not None:
                yield self._chunk([choice])

    def usage_chunk(self, final: RequestOutput | None) -> bytes:
        """The last chunk: no choices, the request's usage."""
        self.usage = self.serving.usage([final])
        return self._chunk([])

    def _chunk(self, choices: list[ChatStreamChoice]) -> bytes:
        return sse_event(
            ChatCompletionStreamResponse(
                id=self.request_id,
                created=self.created,
                model=self.serving.response_model(self.request.model),
                choices=choices,
                usage=self.usage,
            )
        )

    def _choice(self, completion: CompletionOutput) -> ChatStreamChoice | None:
        """The choice's new delta since the last chunk; None when there is none to send."""
        request = self.request
        delta = self.streamed[completion.index].next_delta(completion, want_tokens=request.logprobs)
        if delta is None:
            return None
        text, first_token, finish_reason = delta
        message, finish_reason = self._message(completion.index, text, finish_reason)
        if message is None:
            return None
        logprobs = None
        if request.logprobs:
            logprobs = self.serving._logprobs(
                completion.token_ids[first_token:],
                (completion.logprobs or [])[first_token:],
                request,
            )
        return ChatStreamChoice(
            completion.index,
            message,
            logprobs,
            finish_reason,
            completion.stop_reason if finish_reason else None,
        )

    def _message(
        self, index: int, text: str, finish_reason: str | None
    ) -> tuple[DeltaMessage | None, str | None]:
        """One choice's new text as a delta (reasoning split off, tool calls parsed) and its
        finish reason (tool calls make it "tool_calls"); None while nothing is to be sent."""
        if self.harmony[index] is not None:
            return self._harmony_message(index, text, finish_reason)
        reasoning = None
        splitter = self.splitters[index]
        if splitter is not None:
            reasoning, text = splitter.feed(text, finish_reason is not None)
            reasoning = reasoning or None
        tool_output = self.tool_outputs[index]
        if not tool_output.uses_tools:
            if splitter is not None and not (
                text or reasoning or finish_reason or self.request.logprobs
            ):
                return None, finish_reason  # a tag held back: nothing to send yet
            message = DeltaMessage(content=text, reasoning=reasoning, reasoning_content=reasoning)
            return message, finish_reason
        content, tool_deltas = tool_output.update(text, finish_reason is not None)
        message = DeltaMessage(
            content=content,
            reasoning=reasoning,
            reasoning_content=reasoning,
            tool_calls=tool_deltas or None,
        )
        finish_reason = tool_output.finish_reason(finish_reason, tool_output.num_calls)
        if not (content or reasoning or tool_deltas or finish_reason or self.request.logprobs):
            return None, finish_reason
        return message, finish_reason

    def _harmony_message(
        self, index: int, text: str, finish_reason: str | None
    ) -> tuple[DeltaMessage | None, str | None]:
        """A harmony choice's delta: its channels as reasoning, content and tool calls."""
        harmony = self.harmony[index]
        assert harmony is not None
        reasoning, content, tool_deltas = harmony.update(text, finish_reason is not None)
        finish_reason = harmony.finish_reason(finish_reason, harmony.num_calls)
        if not (content or reasoning or tool_deltas or finish_reason or self.request.logprobs):
            return None, finish_reason
        message = DeltaMessage(
            content=content,
            reasoning=reasoning or None,
            reasoning_content=reasoning or None,
            tool_calls=tool_deltas or None,
        )
        return message, finish_reason
