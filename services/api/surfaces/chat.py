"""POST /v1/chat/completions: the model's chat template, then one prompt, streamed or not.

With `tools`, tool_choice decides what the model may write (services/api/parsers/tool_calls.py), and
each choice's text becomes content and OpenAI tool calls (finish_reason "tool_calls").
"""

from __future__ import annotations

from collections.abc import AsyncGenerator
from contextlib import aclosing
from functools import cached_property
from typing import Any, NamedTuple

import jinja2
import msgspec
from starlette.requests import Request
from starlette.responses import Response

from kvserve.services.api.harmony.output import HarmonyOutput
from kvserve.services.api.harmony.prompt import HarmonyPrompt
from kvserve.services.api.observability.tracing import trace_span
from kvserve.services.api.parsers.auto import resolved_parsers
from kvserve.services.api.parsers.reasoning_parsers import ReasoningParser, ReasoningSplitter
from kvserve.services.api.parsers.reasoning_registry import get_reasoning_parser
from kvserve.services.api.parsers.tool_calls import (
    ToolCallOutput,
    resolve_tool_choice,
    tool_constraint,
    tools_for_template,
)
from kvserve.services.api.parsers.tool_registry import TOOL_PARSERS
from kvserve.services.api.serving.base import (
    MIN_LOGPROB,
    SSE_DONE,
    OpenAIServing,
    SSEResponse,
    StreamedChoice,
    error_event,
    first_output_checked,
    prompt_logprobs_body,
    raise_if_failed,
    run_until_disconnected,
    stop_holdback,
)
from kvserve.services.api.serving.beam_search import beam_search_of
from kvserve.services.api.serving.errors import APIError
from kvserve.services.api.serving.multimodal import (
    ImageProcessor,
    MultimodalError,
    PromptWithImages,
    decode_image,
    load_image_bytes,
    load_image_processor,
)
from kvserve.services.api.serving.outputs import Logprob, RequestOutput
from kvserve.services.api.serving.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    DeltaToolCall,
    ToolCall,
)
from kvserve.services.api.serving.request_constraints import structured_outputs_of
from kvserve.services.api.surfaces.chat_messages import image_urls_of, messages_to_dicts
from kvserve.services.api.surfaces.chat_stream import ChatStream, PreparedChat
from kvserve.services.api.surfaces.openai_protocol import (
    ChatChoice,
    ChatCompletionResponse,
    ChatLogprobEntry,
    ChatLogprobs,
    ChatResponseMessage,
    TopLogprob,
)
from kvserve.shared.api_config import parse_limit_mm_per_prompt
from kvserve.shared.logging import init_logger
from kvserve.shared.parser_names import HARMONY_REASONING_PARSER, HARMONY_TOOL_PARSER
from kvserve.shared.sampling_params import SamplingParams

logger = init_logger(__name__)


def split_reasoning(parser: ReasoningParser | None, text: str) -> tuple[str | None, str]:
    """A whole reply as (its reasoning or None, the rest): all of it the rest without a
    parser."""
    if parser is None:
        return None, text
    reasoning, content = ReasoningSplitter(parser).split(text)
    return reasoning, content or ""


class ChatDelta(NamedTuple):
    """What one step adds to a chat-shaped stream's first choice (`chat_deltas`)."""

    reasoning: str  # new thinking text ("" without a reasoning parser)
    content: str | None  # new answer text, tool-call markup taken out
    tool_deltas: list[DeltaToolCall]
    finish_reason: str | None
    num_calls: int  # tool calls so far
    final: RequestOutput  # the cumulative output


class OpenAIServingChat(OpenAIServing):
    """The chat completions endpoint (see OpenAIServing for the constructor's arguments)."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.frontend = resolved_parsers(self.frontend, self.engine_client.tokenizer_info)
        tool_parser, reasoning_parser = (
            self.frontend.tool_call_parser,
            self.frontend.reasoning_parser,
        )
        # gpt-oss speaks harmony: its own prompt rendering and output parsing, by channel.
        self.harmony: HarmonyPrompt | None = None
        if tool_parser == HARMONY_TOOL_PARSER or reasoning_parser == HARMONY_REASONING_PARSER:
            self.harmony = HarmonyPrompt(self.tokenizer)
            reasoning_parser = None
        self.reasoning_parser = get_reasoning_parser(reasoning_parser)
        self.tool_call_parser = tool_parser
        self._reasoning_end_ids: list[int] | None = None

    @property
    def splits_reasoning(self) -> bool:
        """Whether replies come with their thinking apart (a reasoning parser, or harmony)."""
        return self.reasoning_parser is not None or self.harmony is not None

    def reasoning_end_token_ids(self) -> list[int]:
        """The reasoning parser's end tag as token ids (what the engine watches)."""
        assert self.reasoning_parser is not None
        if self._reasoning_end_ids is None:
            ids = self.tokenizer.encode(self.reasoning_parser.end, add_special_tokens=False)
            self._reasoning_end_ids = list(ids)
        return self._reasoning_end_ids

    def reasoning_of(
        self,
        request: ChatCompletionRequest,
        template_kwargs: dict[str, Any],
        tool_choice: str = "auto",
    ) -> tuple[ReasoningParser | None, dict[str, Any]]:
        """(the parser when the reply starts thinking, the SamplingParams fields that tell the
        engine); a thinking budget without a parser is a 400."""
        parser = self.reasoning_parser
        budget = request.thinking_token_budget
        if self.harmony is not None:
            if tool_choice not in ("auto", "none"):
                return None, {}  # the prompt opens the call: its grammar applies at once
            fields: dict[str, Any] = {"reasoning_end_token_ids": self.harmony.final_header_ids}
            return None, fields | ({"thinking_token_budget": budget} if budget is not None else {})
        if parser is None:
            if budget is not None:
                raise APIError(
                    400,
                    "thinking_token_budget needs a reasoning parser (--reasoning-parser)",
                    "thinking_token_budget",
                )
            return None, {}
        if not parser.starts_thinking(template_kwargs):
            return None, {}
        fields = {"reasoning_end_token_ids": self.reasoning_end_token_ids()}
        if budget is not None:
            fields["thinking_token_budget"] = budget
        return parser, fields

    @cached_property
    def image_processor(self) -> ImageProcessor | None:
        """The model's image preprocessing; None for a model that reads text only."""
        return load_image_processor(self.engine_client.tokenizer_info.model_dir)

    def check_images(self, image_urls: list[str]) -> ImageProcessor:
        """The processor for a request with images (before its template renders them): a
        400 for a text model or past --limit-mm-per-prompt."""
        processor = self.image_processor
        if processor is None:
            raise APIError(
                400, "image content needs a vision model; this one reads text", "messages"
            )
        limit = parse_limit_mm_per_prompt(self.frontend.limit_mm_per_prompt).get("image")
        if limit is not None and len(image_urls) > limit:
            raise APIError(
                400,
                f"{len(image_urls)} images in the request; at most {limit} are allowed "
                f"(--limit-mm-per-prompt)",
                "messages",
            )
        return processor

    def attach_images(self, prompt_token_ids: list[int], image_urls: list[str]) -> list[int]:
        """Load, decode and preprocess the images, and expand the prompt's placeholders:
        token ids that carry their images (PromptWithImages). Refusals are 400s."""
        processor = self.check_images(image_urls)
        try:
            images = [
                decode_image(load_image_bytes(url, self.frontend.allowed_local_media_path))
                for url in image_urls
            ]
            token_ids, mm_inputs = processor.expand(prompt_token_ids, images)
        except MultimodalError as exc:
            raise APIError(400, str(exc), "messages") from None
        return PromptWithImages(token_ids, mm_inputs)

    def apply_chat_template(
        self,
        messages: list[ChatMessage],
        add_generation_prompt: bool,
        continue_final_message: bool = False,
        chat_template_kwargs: dict | None = None,
        tools: list[dict] | None = None,
    ) -> list[int]:
        """Token ids of the templated conversation; a template failure is a 400."""
        if not messages:
            raise APIError(400, "messages must hold at least one message", param="messages")
        kwargs = dict(chat_template_kwargs or {})
        if tools is not None:
            kwargs["tools"] = tools
        if continue_final_message:
            # The reply continues the last (assistant) message instead of starting a new one.
            kwargs["continue_final_message"] = True
            add_generation_prompt = False
        try:
            return self.engine_client.tokenizer_info.apply_chat_template(
                messages_to_dicts(messages), add_generation_prompt, **kwargs
            )
        except (ValueError, TypeError, jinja2.TemplateError) as exc:
            raise APIError(400, f"the chat template failed: {exc}", param="messages") from None

    async def create_chat_completion(
        self, request: ChatCompletionRequest, raw_request: Request
    ) -> Response:
        """Validate, template, submit, and answer with JSON or an SSE stream."""
        prepared = self.prepare(request, raw_request, "chatcmpl-")
        if request.stream:
            results = await self.start(prepared, request)
            return SSEResponse(self._stream(prepared, request, results))
        return await run_until_disconnected(raw_request, self._complete(prepared, request))

    def prepare(
        self, request: ChatCompletionRequest, raw_request: Request, id_prefix: str
    ) -> PreparedChat:
        """Validate and template a chat request: everything up to submitting it (the other
        chat-shaped surfaces, /v1/messages, share it)."""
        self.check_model(request.model)
        self.check_request(request)
        tool_choice = resolve_tool_choice(request, self.frontend)
        structured_outputs = structured_outputs_of(request)
        constraint = tool_constraint(request, tool_choice)
        if constraint is not None and structured_outputs is not None:
            raise APIError(
                400,
                f"tool_choice {tool_choice!r} constrains the output itself: drop "
                f"response_format / structured_outputs",
                param="tool_choice",
            )
        template_kwargs = dict(request.chat_template_kwargs or {})
        if request.reasoning_effort is not None:
            template_kwargs.setdefault("reasoning_effort", request.reasoning_effort)
        reasoning, reasoning_fields = self.reasoning_of(request, template_kwargs, tool_choice)
        image_urls = image_urls_of(request.messages)
        if image_urls:
            self.check_images(image_urls)
        with trace_span("tokenize"):
            prompt_token_ids = self.prompt_token_ids(request, tool_choice, template_kwargs)
        if image_urls:
            prompt_token_ids = self.attach_images(prompt_token_ids, image_urls)
        self.check_prompt_tokens(prompt_token_ids, "messages")
        max_tokens = (
            request.max_completion_tokens
            if request.max_completion_tokens is not None
            else request.max_tokens
        )
        params = self.make_sampling_params(
            request,
            len(prompt_token_ids),
            max_tokens,
            "messages",
            logprobs=(request.top_logprobs or 0) if request.logprobs else None,
            prompt_logprobs=request.prompt_logprobs,
            structured_outputs=constraint or structured_outputs,
            **reasoning_fields,
        )
        beam_search_of(request, self.engine_client.max_logprobs)  # its 400s, before submitting
        harmony = self.harmony is not None and tool_choice in ("auto", "none")
        params = self._with_parser_needs(params, tool_choice, reasoning, harmony)
        self.check_engine(request.n)
        ids = self.request_ids(raw_request, request, id_prefix)
        return PreparedChat(ids, prompt_token_ids, params, tool_choice, reasoning, harmony)

    def prompt_token_ids(
        self, request: ChatCompletionRequest, tool_choice: str, template_kwargs: dict[str, Any]
    ) -> list[int]:
        """The templated conversation: harmony for gpt-oss, else the chat template."""
        if self.harmony is None:
            return self.apply_chat_template(
                request.messages,
                request.add_generation_prompt,
                request.continue_final_message,
                template_kwargs,
                tools_for_template(request, tool_choice, self.frontend),
            )
        try:
            return self.harmony.token_ids(request, messages_to_dicts(request.messages), tool_choice)
        except ValueError as exc:
            raise APIError(400, str(exc), param="reasoning_effort") from None

    def _with_parser_needs(
        self,
        params: SamplingParams,
        tool_choice: str,
        reasoning: ReasoningParser | None,
        harmony: bool,
    ) -> SamplingParams:
        """Harmony's <|call|> and <|return|> stop generation; parsers that read special
        tokens get them kept in the text."""
        if self.harmony is not None:
            stop_ids = list(params.stop_token_ids or ()) + self.harmony.stop_token_ids
            params = msgspec.structs.replace(params, stop_token_ids=stop_ids)
        if harmony or self._needs_special_tokens(tool_choice, reasoning):
            params = msgspec.structs.replace(params, skip_special_tokens=False)
        return params

    def _needs_special_tokens(self, tool_choice: str, reasoning: ReasoningParser | None) -> bool:
        """Whether the parsers in use read markers that are special tokens ([TOOL_CALLS],
        [THINK], Kimi's sections), which the text keeps only unskipped (as vLLM's do)."""
        tool_parser = TOOL_PARSERS.get(self.tool_call_parser or "")
        tool_markers = tool_choice == "auto" and tool_parser and tool_parser.needs_special_tokens
        return bool(tool_markers or (reasoning is not None and reasoning.needs_special_tokens))

    async def start(
        self, prepared: PreparedChat, request: ChatCompletionRequest
    ) -> AsyncGenerator[tuple[int, RequestOutput], None]:
        """Submit a prepared request for a stream: its outputs, the first already checked
        where a structured output could fail to compile (the status is not yet sent)."""
        results = self.generate(
            prepared.ids[1],
            [(None, prepared.prompt_token_ids)],
            [prepared.params],
            request.priority,
            self.lora_request(request.model),
        )
        if prepared.params.structured_outputs is not None:
            results = await first_output_checked(results)
        return results

    async def final_output(
        self, prepared: PreparedChat, request: ChatCompletionRequest
    ) -> RequestOutput:
        """Submit a prepared request and wait for its finished output (failures raised)."""
        final: RequestOutput | None = None
        async with aclosing(
            self.generate(
                prepared.ids[1],
                [(None, prepared.prompt_token_ids)],
                [prepared.params],
                request.priority,
                self.lora_request(request.model),
                beam=beam_search_of(request, self.engine_client.max_logprobs),
            )
        ) as results:
            async for _, output in results:
                final = output
        assert final is not None and final.finished, "the request's stream ended early"
        raise_if_failed(final)
        return final

    async def chat_deltas(
        self,
        prepared: PreparedChat,
        request: ChatCompletionRequest,
        results: AsyncGenerator[tuple[int, RequestOutput], None],
    ) -> AsyncGenerator[ChatDelta, None]:
        """The first choice's new reasoning, content and tool-call pieces as they come, with
        the stop-string holdback, the reasoning split and the tool parsing applied: what
        the chat-shaped surfaces (/v1/messages, /v1/responses) render as their own events.
        Failures raise."""
        streamed = StreamedChoice(stop_holdback(prepared.params))
        tool_output = self.tool_output(request, prepared.tool_choice)
        splitter = ReasoningSplitter(prepared.reasoning) if prepared.reasoning else None
        harmony = self.harmony_output(prepared, request)
        async for _, final in results:
            raise_if_failed(final)
            delta = streamed.next_delta(final.outputs[0], want_tokens=False)
            if delta is None:
                continue
            text, _, finish_reason = delta
            if harmony is not None:
                parts = harmony.update(text, finish_reason is not None)
                yield ChatDelta(*parts, finish_reason, harmony.num_calls, final)
                continue
            reasoning = ""
            if splitter is not None:
                reasoning, text = splitter.feed(text, finish_reason is not None)
            content, tool_deltas = (
                tool_output.update(text, finish_reason is not None)
                if tool_output.uses_tools
                else (text or None, [])
            )
            yield ChatDelta(
                reasoning, content, tool_deltas, finish_reason, tool_output.num_calls, final
            )

    def harmony_output(
        self, prepared: PreparedChat, request: ChatCompletionRequest
    ) -> HarmonyOutput | None:
        """How one choice's harmony splits into channels (None: the reply is not harmony)."""
        if not prepared.harmony:
            return None
        return HarmonyOutput(prepared.tool_choice, request.tools, request.parallel_tool_calls)

    def parse_whole(
        self, prepared: PreparedChat, request: ChatCompletionRequest, text: str
    ) -> tuple[str | None, str | None, list[ToolCall]]:
        """A whole choice's (reasoning, content, tool calls), whatever the format."""
        harmony = self.harmony_output(prepared, request)
        if harmony is not None:
            return harmony.result(text)
        reasoning, text = split_reasoning(prepared.reasoning, text)
        content, calls = self.tool_output(request, prepared.tool_choice).result(text)
        return reasoning, content, calls

    def tool_output(self, request: ChatCompletionRequest, tool_choice: str) -> ToolCallOutput:
        """How one choice's text becomes content and tool calls (the chat-shaped surfaces
        share it). Under harmony an "auto" choice's calls come from its channels
        (harmony_output), and only the constrained choices read text."""
        if self.harmony is not None and tool_choice in ("auto", "none"):
            return ToolCallOutput("none")  # harmony_output reads this choice's calls
        return ToolCallOutput(
            tool_choice, self.tool_call_parser, request.parallel_tool_calls, request.tools
        )

    # ------------------------------------------------------------------ non-streaming

    async def _complete(self, prepared: PreparedChat, request: ChatCompletionRequest) -> Response:
        response_id = prepared.ids[0]
        tool_choice = prepared.tool_choice
        final = await self.final_output(prepared, request)
        choices = []
        for completion in final.outputs:
            tool_output = self.harmony_output(prepared, request) or self.tool_output(
                request, tool_choice
            )
            reasoning, content, tool_calls = self.parse_whole(prepared, request, completion.text)
            message = ChatResponseMessage("assistant", content or "", tool_calls)
            if self.splits_reasoning:
                message.reasoning = message.reasoning_content = reasoning
            choices.append(
                ChatChoice(
                    completion.index,
                    # A reply of calls only has content "" (vLLM's), not null.
                    message,
                    self._logprobs(completion.token_ids, completion.logprobs, request)
                    if request.logprobs
                    else None,
                    tool_output.finish_reason(completion.finish_reason, len(tool_calls)),
                    completion.stop_reason,
                )
            )
        body = ChatCompletionResponse(
            id=response_id,
            model=self.response_model(request.model),
            choices=choices,
            usage=self.usage([final]),
            prompt_logprobs=prompt_logprobs_body(final.prompt_logprobs),
        )
        return Response(msgspec.json.encode(body), media_type="application/json")

    # ------------------------------------------------------------------ streaming

    async def _stream(
        self,
        prepared: PreparedChat,
        request: ChatCompletionRequest,
        results: AsyncGenerator[tuple[int, RequestOutput], None],
    ):
        stream = ChatStream(self, prepared, request)
        final: RequestOutput | None = None
        try:
            for chunk in stream.role_chunks():
                yield chunk
            async with aclosing(results):
                async for _, final in results:
                    for chunk in stream.output_chunks(final):
                        yield chunk
            if request.include_usage:
                yield stream.usage_chunk(final)
        except Exception as exc:  # noqa: BLE001 - the status is sent: report in the stream
            logger.warning("chat stream %s failed: %r", prepared.ids[0], exc)
            yield error_event(exc)
        yield SSE_DONE

    # ------------------------------------------------------------------ logprobs

    def _logprobs(
        self,
        token_ids: list[int],
        logprobs: list[dict[int, Logprob]] | None,
        request: ChatCompletionRequest,
    ) -> ChatLogprobs:
        """OpenAI's chat logprobs: per token, its logprob and the `top_logprobs` best."""
        num_top = request.top_logprobs or 0
        as_ids = self.tokens_as_ids(request)
        entries = []
        for position, token_id in enumerate(token_ids):
            row = logprobs[position] if logprobs and position < len(logprobs) else {}
            chosen = row.get(token_id)
            token = self.token_text(token_id, chosen, as_ids)
            best = sorted(row.items(), key=lambda item: item[1].logprob, reverse=True)
            top = []
            for top_id, top_logprob in best[:num_top]:
                top_token = self.token_text(top_id, top_logprob, as_ids)
                top.append(
                    TopLogprob(
                        top_token,
                        max(top_logprob.logprob, MIN_LOGPROB),
                        list(top_token.encode("utf-8")),
                    )
                )
            entries.append(
                ChatLogprobEntry(
                    token,
                    max(chosen.logprob, MIN_LOGPROB) if chosen else MIN_LOGPROB,
                    list(token.encode("utf-8")),
                    top,
                )
            )
        return ChatLogprobs(entries)
