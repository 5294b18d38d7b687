"""POST /v1/completions: one or many prompts (text or token ids), streamed or not."""

from __future__ import annotations

from collections.abc import AsyncGenerator, Iterator, Sequence
from contextlib import aclosing

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from kvserve.services.api.observability.tracing import trace_span
from kvserve.services.api.serving.base import (
    MIN_LOGPROB,
    SSE_DONE,
    OpenAIServing,
    PromptInput,
    SSEResponse,
    StreamedChoice,
    error_event,
    first_output_checked,
    prompt_logprobs_body,
    raise_if_failed,
    run_until_disconnected,
    sse_event,
    stop_holdback,
)
from kvserve.services.api.serving.beam_search import BeamSearch, beam_search_of
from kvserve.services.api.serving.errors import APIError
from kvserve.services.api.serving.outputs import CompletionOutput, Logprob, RequestOutput
from kvserve.services.api.serving.protocol import UNSET, now_seconds
from kvserve.services.api.serving.request_constraints import structured_outputs_of
from kvserve.services.api.surfaces.openai_protocol import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    CompletionStreamResponse,
)
from kvserve.shared.logging import init_logger
from kvserve.shared.sampling_params import SamplingParams

logger = init_logger(__name__)


class OpenAIServingCompletion(OpenAIServing):
    """The completions endpoint (see OpenAIServing for the constructor's arguments)."""

    async def create_completion(self, request: CompletionRequest, raw_request: Request) -> Response:
        """Validate, submit every prompt, and answer with JSON or an SSE stream."""
        self.check_model(request.model)
        self.check_request(request)
        with trace_span("tokenize"):
            prompts = self._prompt_inputs(request.prompt)
        # echo + logprobs also reports the prompt's logprobs, as OpenAI's API did.
        prompt_logprobs = request.prompt_logprobs
        if prompt_logprobs is None and request.echo:
            prompt_logprobs = request.logprobs
        structured_outputs = structured_outputs_of(request)
        params_list = [
            self.make_sampling_params(
                request,
                len(token_ids),
                request.max_tokens,
                "prompt",
                logprobs=request.logprobs,
                prompt_logprobs=prompt_logprobs,
                structured_outputs=structured_outputs,
            )
            for _, token_ids in prompts
        ]
        beam = beam_search_of(request, self.engine_client.max_logprobs)
        self.check_engine(len(prompts) * request.n)
        ids = self.request_ids(raw_request, request, "cmpl-")
        if request.stream:
            results = self.generate(
                ids[1], prompts, params_list, request.priority, self.lora_request(request.model)
            )
            if structured_outputs is not None:
                results = await first_output_checked(results)
            return SSEResponse(self._stream(ids, request, prompts, params_list, results))
        return await run_until_disconnected(
            raw_request, self._complete(ids, request, prompts, params_list, beam)
        )

    def _prompt_inputs(self, prompt: str | list) -> list[PromptInput]:
        """The prompt field as a list of (text, token ids), whatever form it came in."""
        if isinstance(prompt, str):
            items: list = [prompt]
        elif prompt and all(isinstance(p, int) for p in prompt):
            items = [prompt]  # one prompt as token ids
        elif prompt and all(isinstance(p, (str, list)) for p in prompt):
            items = prompt
        else:
            raise APIError(
                400,
                "prompt must be a string, a list of strings, a list of token "
                "ids or a list of token-id lists, not empty and not mixed",
                param="prompt",
            )
        inputs: list[PromptInput] = []
        for item in items:
            if isinstance(item, str):
                token_ids = self.engine_client.tokenizer_info.encode(item)
                inputs.append((item, token_ids))
            else:
                token_ids = list(item)
                inputs.append((None, token_ids))
            self.check_prompt_tokens(token_ids, "prompt")
        return inputs

    def _prompt_text(self, prompt: PromptInput) -> str:
        text, token_ids = prompt
        return text if text is not None else self.tokenizer.decode(token_ids)

    # ------------------------------------------------------------------ non-streaming

    async def _complete(
        self,
        ids: tuple[str, str],
        request: CompletionRequest,
        prompts: list[PromptInput],
        params_list: list[SamplingParams],
        beam: BeamSearch | None = None,
    ) -> Response:
        response_id, engine_id = ids
        as_ids = self.tokens_as_ids(request)
        final: list[RequestOutput | None] = [None] * len(prompts)
        lora = self.lora_request(request.model)
        async with aclosing(
            self.generate(engine_id, prompts, params_list, request.priority, lora, beam=beam)
        ) as results:
            async for prompt_index, streamed in results:
                final[prompt_index] = streamed
        choices = []
        for prompt_index, output in enumerate(final):
            assert output is not None and output.finished, "a prompt's stream ended early"
            raise_if_failed(output)
            for completion in output.outputs:
                text, logprobs = completion.text, None
                if request.echo:
                    text = self._prompt_text(prompts[prompt_index]) + text
                if request.logprobs is not None:
                    logprobs = CompletionLogprobs()
                    if request.echo:
                        self._add_logprobs(
                            logprobs, output.prompt_token_ids, output.prompt_logprobs, 0, as_ids
                        )
                    self._add_logprobs(
                        logprobs,
                        completion.token_ids,
                        completion.logprobs,
                        _next_offset(logprobs),
                        as_ids,
                    )
                choices.append(
                    CompletionChoice(
                        prompt_index * request.n + completion.index,
                        text,
                        logprobs,
                        completion.finish_reason,
                        completion.stop_reason,
                        prompt_logprobs_body(output.prompt_logprobs),
                    )
                )
        body = CompletionResponse(
            id=response_id,
            model=self.response_model(request.model),
            choices=choices,
            usage=self.usage(final),
        )
        return Response(msgspec.json.encode(body), media_type="application/json")

    # ------------------------------------------------------------------ streaming

    async def _stream(
        self,
        ids: tuple[str, str],
        request: CompletionRequest,
        prompts: list[PromptInput],
        params_list: list[SamplingParams],
        results: AsyncGenerator[tuple[int, RequestOutput], None],
    ):
        stream = _CompletionStream(self, ids[0], request, prompts, params_list)
        try:
            async with aclosing(results):
                async for prompt_index, output in results:
                    for chunk in stream.output_chunks(prompt_index, output):
                        yield chunk
            if request.include_usage:
                yield stream.usage_chunk()
        except Exception as exc:  # noqa: BLE001 - the status is sent: report in the stream
            logger.warning("completion stream %s failed: %r", ids[0], exc)
            yield error_event(exc)
        yield SSE_DONE

    # ------------------------------------------------------------------ logprobs

    def _add_logprobs(
        self,
        out: CompletionLogprobs,
        token_ids: list[int],
        logprobs: Sequence[dict[int, Logprob] | None] | None,
        text_offset: int,
        as_ids: bool = False,
    ) -> None:
        """Append one entry per token to OpenAI's parallel lists.

        Args:
            out: the lists to extend.
            token_ids: the tokens.
            logprobs: per token, {token id: Logprob} (None where there is none, as for the
                first prompt token).
            text_offset: where the first token starts in the choice's text.
            as_ids: name tokens "token_id:N" (return_tokens_as_token_ids).
        """
        for position, token_id in enumerate(token_ids):
            row = logprobs[position] if logprobs and position < len(logprobs) else None
            chosen = row.get(token_id) if row else None
            token = self.token_text(token_id, chosen, as_ids)
            out.tokens.append(token)
            out.text_offset.append(text_offset)
            text_offset += len(token)
            out.token_logprobs.append(None if chosen is None else max(chosen.logprob, MIN_LOGPROB))
            out.top_logprobs.append(
                None
                if row is None
                else {
                    self.token_text(tid, lp, as_ids): max(lp.logprob, MIN_LOGPROB)
                    for tid, lp in row.items()
                }
            )


def _next_offset(logprobs: CompletionLogprobs) -> int:
    """The text offset right after the last token of `logprobs` (0 when empty)."""
    if not logprobs.tokens:
        return 0
    return logprobs.text_offset[-1] + len(logprobs.tokens[-1])


class _CompletionStream:
    """One streamed completions request: each choice's progress, and the chunks it emits.

    Args:
        serving: the endpoint (prompt text, logprobs, model name, usage).
        request_id: the response's id.
        request: the request.
        prompts: its prompts, by prompt index.
        params_list: each prompt's SamplingParams.
    """

    def __init__(
        self,
        serving: OpenAIServingCompletion,
        request_id: str,
        request: CompletionRequest,
        prompts: list[PromptInput],
        params_list: list[SamplingParams],
    ):
        self.serving = serving
        self.request_id = request_id
        self.request = request
        self.prompts = prompts
        self.params_list = params_list
        self.created = now_seconds()
        self.as_ids = serving.tokens_as_ids(request)
        self.want_logprobs = request.logprobs is not None
        self.usage = None if request.include_usage else UNSET
        self.final: list[RequestOutput | None] = [None] * len(prompts)
        self.streamed: dict[tuple[int, int], StreamedChoice] = {}
        self.next_offsets: dict[tuple[int, int], int] = {}

    def output_chunks(self, prompt_index: int, output: RequestOutput) -> Iterator[bytes]:
        """One chunk per choice of `output` that has something new; failures raise."""
        self.final[prompt_index] = output
        raise_if_failed(output)
        for completion in output.outputs:
            choice = self._choice(prompt_index, output, completion)
            if choice is not None:
                yield self._chunk([choice], self.usage)

    def usage_chunk(self) -> bytes:
        """The last chunk: no choices, the whole request's usage."""
        return self._chunk([], self.serving.usage(self.final))

    def _chunk(self, choices: list[CompletionChoice], usage) -> bytes:
        return sse_event(
            CompletionStreamResponse(
                id=self.request_id,
                created=self.created,
                model=self.serving.response_model(self.request.model),
                choices=choices,
                usage=usage,
            )
        )

    def _choice(
        self, prompt_index: int, output: RequestOutput, completion: CompletionOutput
    ) -> CompletionChoice | None:
        """The choice's new text (and logprobs) since the last chunk; None when none."""
        key = (prompt_index, completion.index)
        state = self._streamed(key)
        is_first = not state.started
        delta = state.next_delta(completion, want_tokens=self.want_logprobs)
        if delta is None:
            return None
        text, first_token, finish_reason = delta
        logprobs = None
        if self.want_logprobs:
            logprobs = self._logprobs(key, output, completion, first_token, is_first)
        return CompletionChoice(
            prompt_index * self.request.n + completion.index,
            text,
            logprobs,
            finish_reason,
            completion.stop_reason if finish_reason else None,
        )

    def _streamed(self, key: tuple[int, int]) -> StreamedChoice:
        """The choice's progress, made at its first output (with the echoed prompt)."""
        if key not in self.streamed:
            prompt_index = key[0]
            prefix = (
                self.serving._prompt_text(self.prompts[prompt_index]) if self.request.echo else ""
            )
            self.streamed[key] = StreamedChoice(
                stop_holdback(self.params_list[prompt_index]), prefix
            )
        return self.streamed[key]

    def _logprobs(
        self,
        key: tuple[int, int],
        output: RequestOutput,
        completion: CompletionOutput,
        first_token: int,
        is_first: bool,
    ) -> CompletionLogprobs:
        """The new tokens' logprobs (the echoed prompt's first, in the choice's first chunk)."""
        logprobs = CompletionLogprobs()
        # Offsets run on across chunks, from where the last one ended.
        offset = self.next_offsets.get(key, 0)
        if is_first and self.request.echo:
            self.serving._add_logprobs(
                logprobs,
                output.prompt_token_ids,
                output.prompt_logprobs,
                offset,
                self.as_ids,
            )
            offset = _next_offset(logprobs)
        self.serving._add_logprobs(
            logprobs,
            completion.token_ids[first_token:],
            (completion.logprobs or [])[first_token:],
            offset,
            self.as_ids,
        )
        if logprobs.tokens:
            self.next_offsets[key] = _next_offset(logprobs)
        return logprobs
