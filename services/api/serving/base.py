"""What the completions and chat handlers share: checks, sampling params, fan-out, SSE.

handler ──check_model / check_request / make_sampling_params──▶ generate(prompts)
                                                 │ one EngineClient.generate per prompt
                                                 │ (timed for /metrics in its OutputProcessor)
                                                 ▼
                                 merge_async_iterators ──▶ (prompt_index, RequestOutput)
"""

from __future__ import annotations

import asyncio
import secrets
import uuid
from collections.abc import AsyncGenerator, Awaitable, Sequence
from typing import Any, TypeVar

import anyio
import msgspec
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from kvserve.services.api.engine_client.client import (
    EngineClient,
    EngineDeadError,
    EngineOverloadedError,
)
from kvserve.services.api.observability.request_logger import RequestLogger
from kvserve.services.api.serving.beam_search import BeamSearch, beam_search_results
from kvserve.services.api.serving.detokenizer import num_held_back_chars
from kvserve.services.api.serving.errors import APIError
from kvserve.services.api.serving.latency_targets import REQUEST_TARGETS
from kvserve.services.api.serving.models import ServingModels
from kvserve.services.api.serving.outputs import (
    CompletionOutput,
    Logprob,
    PromptLogprobs,
    RequestOutput,
)
from kvserve.services.api.serving.prompt_cache import REQUEST_PINS
from kvserve.services.api.serving.protocol import PromptLogprob, PromptLogprobsBody, UsageInfo
from kvserve.services.api.serving.request_constraints import logits_processor_kwargs
from kvserve.services.api.serving.slo_admission import SloAdmission
from kvserve.services.api.serving.validation import (
    check_prompt_tokens,
    check_request,
    check_sampling_params,
    resolve_max_tokens,
)
from kvserve.services.api.tenancy.quotas import SettledResults, TenantQuotas, has_quotas
from kvserve.services.api.tenancy.tenants import CURRENT_TENANT, TenantSpec
from kvserve.shared.api_config import FrontendConfig
from kvserve.shared.lora import LoRARequest
from kvserve.shared.model_dir import is_encoder_model
from kvserve.shared.sampling_params import SamplingParams
from kvserve.shared.wire import QUEUE_FULL_ERROR

T = TypeVar("T")

# One prompt: its text (None when given as token ids) and its token ids.
PromptInput = tuple[str | None, list[int]]

SSE_DONE = b"data: [DONE]\n\n"
# JSON has no -inf: an impossible token's logprob is reported as this floor (as in vLLM).
MIN_LOGPROB = -9999.0
# A client's own request id (vLLM's header); echoed with --enable-request-id-headers.
REQUEST_ID_HEADER = "X-Request-Id"
_encoder = msgspec.json.Encoder()


def sse_event(body: msgspec.Struct) -> bytes:
    return b"data: " + _encoder.encode(body) + b"\n\n"


class OpenAIServing:
    """
    Args:
        engine_client: where requests go.
        served_model_name: the base model's name.
        frontend: the front end's options (usage details, token ids, request logs).
        models: the base model and the LoRA adapters a request's `model` may name
            (default: the base model alone).

    `generation_defaults` are the SamplingParams defaults of --generation-config (set by
    build_app); a request's own values win. `quotas` are the tenants' quotas, one object for
    every handler (set by make_context; None: no quotas). `admission` refuses requests whose
    TTFT target is out of reach (set by make_context with --slo-admission reject).
    """

    generation_defaults: dict[str, Any] = {}
    quotas: TenantQuotas | None = None
    admission: SloAdmission | None = None

    def __init__(
        self,
        engine_client: EngineClient,
        served_model_name: str,
        frontend: FrontendConfig | None = None,
        models: ServingModels | None = None,
    ):
        self.engine_client = engine_client
        self.served_model_name = served_model_name
        self.models = models or ServingModels(served_model_name, engine_client.model_name)
        self.frontend = frontend or FrontendConfig()
        # An encoder (BERT, XLM-R, ModernBERT) pools and never generates.
        tokenizer_info = getattr(engine_client, "tokenizer_info", None)
        self.is_encoder = is_encoder_model(getattr(tokenizer_info, "model_dir", None))
        self.request_logger = (
            RequestLogger(self.frontend.max_log_len) if self.frontend.enable_log_requests else None
        )

    @property
    def tokenizer(self):
        return self.engine_client.tokenizer_info.tokenizer

    def token_text(self, token_id: int, logprob: Logprob | None, as_token_id: bool = False) -> str:
        """A token as text: "token_id:N" when asked for (vLLM's return_tokens_as_token_ids),
        else the detokenizer's string when the Logprob carries one."""
        if as_token_id:
            return f"token_id:{token_id}"
        if logprob is not None and logprob.decoded_token is not None:
            return logprob.decoded_token
        return self.tokenizer.decode([token_id])

    def tokens_as_ids(self, request) -> bool:
        """The request's return_tokens_as_token_ids, else the server's flag."""
        if request.return_tokens_as_token_ids is not None:
            return request.return_tokens_as_token_ids
        return self.frontend.return_tokens_as_token_ids

    def request_ids(self, raw_request: Request, request, prefix: str) -> tuple[str, str]:
        """(the response's id, the engine's id) for a new request.

        As vLLM: `prefix` + the X-Request-Id header, else + the body's request_id, else + a
        fresh uuid. A client's id may come twice while the first is running, so the engine's
        id then gets a random suffix (engine ids must be unique). The base id goes into the
        request's state, for the X-Request-Id response header.

        Args:
            raw_request: the HTTP request.
            request: its decoded body.
            prefix: "cmpl-" or "chatcmpl-".
        """
        client_id = raw_request.headers.get(REQUEST_ID_HEADER) or request.request_id
        base_id = client_id or uuid.uuid4().hex
        raw_request.state.request_id = base_id
        response_id = prefix + base_id
        if not client_id:
            return response_id, response_id
        return response_id, f"{response_id}-{secrets.token_hex(4)}"

    def usage(self, final_outputs: list[RequestOutput | None]) -> UsageInfo:
        """Token counts over prompts and their n choices; with --enable-prompt-tokens-details
        also the prompt tokens the prefix cache served (summed over the prompts)."""
        num_cached_tokens = None
        if self.frontend.enable_prompt_tokens_details:
            num_cached_tokens = sum(o.num_cached_tokens for o in final_outputs if o is not None)
        return UsageInfo.of(*count_usage(final_outputs), num_cached_tokens)

    def check_model(self, model: str | None) -> None:
        """A request may omit `model`; naming another one is a 404, as in vLLM."""
        self.models.lora_request(model)

    def response_model(self, model: str | None) -> str:
        """The `model` a response names: the adapter asked for, else the served model."""
        return model if model in self.models.lora_requests else self.served_model_name

    def lora_request(self, model: str | None) -> LoRARequest | None:
        """The adapter the request's `model` names (None: the base model); 404 for others."""
        return self.models.lora_request(model)

    def check_request(self, request) -> None:
        """Everything about the decoded request the api can check before tokenizing it
        (validation.check_request)."""
        check_request(request, self.frontend.limits, self.engine_client.max_model_len)

    def check_engine(self, num_requests: int = 1) -> None:
        """Fail before a stream starts (a stream's status is sent before its first chunk):
        a 503 without a serving engine (unless one is restarting), a 429 when no engine's
        queue has room for `num_requests` engine requests (prompts x n)."""
        # With no engine alive but one restarting, the request is held for it (and fails
        # with a 503 only if none comes back in time: MPEngineClient._submit).
        if not self.engine_client.is_healthy and not self.engine_client.waits_for_engine:
            reason = (
                self.engine_client.dead_reason
                or getattr(self.engine_client, "stall_reason", None)
                or "the engine is not healthy"
            )
            raise EngineDeadError(reason)
        if self.engine_client.sleep_level:
            raise APIError(
                503,
                f"the engine is asleep (sleep level {self.engine_client.sleep_level}, "
                "--enable-sleep-mode): POST /wake_up first",
            )
        self.engine_client.check_capacity(num_requests)

    def check_prompt_tokens(self, token_ids: list[int], param: str) -> None:
        """A prompt's token ids: not empty, within the tokenizer's vocabulary."""
        check_prompt_tokens(token_ids, len(self.tokenizer), param)

    def make_sampling_params(
        self,
        request,
        num_prompt_tokens: int,
        max_tokens: int | None,
        prompt_param: str,
        **overrides: Any,
    ) -> SamplingParams:
        """SamplingParams for one prompt; lengths and limits are checked (validation.py).

        Args:
            request: a CompletionRequest or ChatCompletionRequest.
            num_prompt_tokens: the tokenized prompt's length.
            max_tokens: what the client asked for; None fills up to max_model_len.
            prompt_param: the field to blame for a too long prompt ("prompt" or "messages").
            **overrides: SamplingParams fields set by the handler (logprobs, ...).
        """
        defaults = dict(self.generation_defaults)
        max_tokens = resolve_max_tokens(
            num_prompt_tokens,
            max_tokens,
            self.engine_client.max_model_len,
            defaults.pop("max_tokens", None),
            prompt_param,
        )
        constraints = logits_processor_kwargs(request, self.tokenizer)
        kwargs = defaults | request.sampling_kwargs() | constraints | overrides
        return check_sampling_params(
            {"max_tokens": max_tokens, **kwargs}, self.engine_client.max_logprobs, overrides
        )

    def generate(
        self,
        request_id: str,
        prompts: list[PromptInput],
        params_list: list[SamplingParams],
        priority: int,
        lora_request: LoRARequest | None = None,
        beam: BeamSearch | None = None,
    ) -> AsyncGenerator[tuple[int, RequestOutput], None]:
        """Submit every prompt (all with `lora_request`'s adapter, None: the base model);
        yield (prompt index, cumulative RequestOutput) as they come; with `beam`, each
        prompt's beam search (beam_search.py) and its one finished output.

        Closing the returned generator aborts whatever is still running. The requests are
        the current tenant's (tenants.CURRENT_TENANT, set per HTTP request); when it has
        quotas, they admit the request here, before anything is submitted (a stream's status
        is not sent yet), and the results settle its ticket when they end.

        Raises:
            APIError: 503 for a TTFT target out of reach (slo_admission.py); 429 past one of
                the tenant's quotas (400: a request that may use more
                tokens than its whole tokens_per_minute); see services/api/tenancy/quotas.py.
        """
        if self.is_encoder and any(params.pooling is None for params in params_list):
            raise APIError(
                400,
                "this model is an encoder: it serves /v1/embeddings, /rerank, /v1/score and "
                "/classify, not generation",
            )
        tenant = CURRENT_TENANT.get()
        if self.admission is not None:
            longest = max((len(token_ids) for _, token_ids in prompts), default=0)
            self.admission.check(REQUEST_TARGETS.get(), longest)
        ticket = None
        if self.quotas is not None and tenant is not None and has_quotas(tenant):
            ticket = self.quotas.admit(
                tenant,
                sum(len(token_ids) for _, token_ids in prompts),
                sum(params.n * (params.max_tokens or 0) for params in params_list),
            )
        try:
            if beam is not None:
                context = _BeamContext(self, priority, lora_request, tenant)
                results = beam_search_results(context, request_id, prompts, params_list, beam)
            else:
                results = self._submit(
                    request_id, prompts, params_list, priority, lora_request, tenant
                )
        except BaseException:
            if ticket is not None:
                ticket.settle(0)
            raise
        if ticket is None:
            return results
        return SettledResults(results, ticket, [len(token_ids) for _, token_ids in prompts])

    def _submit(
        self,
        request_id: str,
        prompts: list[PromptInput],
        params_list: list[SamplingParams],
        priority: int,
        lora_request: LoRARequest | None,
        tenant: TenantSpec | None,
    ) -> AsyncGenerator[tuple[int, RequestOutput], None]:
        """One EngineClient.generate per prompt, merged (see generate); each with the
        request's latency targets (latency_targets.REQUEST_TARGETS) where it has any."""
        targets = REQUEST_TARGETS.get()
        target_kwargs: dict[str, Any] = {"targets": targets} if targets.any else {}
        request_pins = REQUEST_PINS.get()
        streams = []
        for index, ((text, token_ids), params) in enumerate(zip(prompts, params_list, strict=True)):
            engine_request_id = request_id if len(prompts) == 1 else f"{request_id}-{index}"
            if self.request_logger is not None:
                # A prompt given as ids (or a chat's template output) is logged decoded.
                logged_text = text if text is not None else self.tokenizer.decode(token_ids)
                self.request_logger.log_inputs(engine_request_id, logged_text, token_ids, params)
            stream = self.engine_client.generate(
                engine_request_id,
                text,
                token_ids,
                params,
                priority,
                lora_request,
                tenant,
                **target_kwargs,
                pins=request_pins.for_prompt(len(token_ids)) or None,
            )
            streams.append(stream)
        return merge_async_iterators(streams)


class _BeamContext:
    """A beam search's view of the serving core (beam_search.BeamSearchContext)."""

    def __init__(
        self,
        serving: OpenAIServing,
        priority: int,
        lora_request: LoRARequest | None,
        tenant: TenantSpec | None,
    ):
        self.serving = serving
        self.priority, self.lora_request, self.tenant = priority, lora_request, tenant
        self.eos_token_id = serving.engine_client.tokenizer_info.eos_token_id

    def submit(
        self, request_id: str, prompts: list[PromptInput], params_list: list[SamplingParams]
    ) -> AsyncGenerator[tuple[int, RequestOutput], None]:
        return self.serving._submit(
            request_id, prompts, params_list, self.priority, self.lora_request, self.tenant
        )

    def decode(self, token_ids: list[int], skip_special_tokens: bool) -> str:
        return self.serving.tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def check(self, output: RequestOutput) -> None:
        raise_if_failed(output)


async def merge_async_iterators(
    iterators: Sequence[AsyncGenerator[T, None]],
) -> AsyncGenerator[tuple[int, T], None]:
    """Interleave several async iterators as items arrive; yields (iterator index, item).

    Each iterator is drained by its own task. When the consumer stops early (a disconnected
    client) or one iterator fails, the tasks are cancelled and every iterator is closed, so
    each EngineClient.generate runs its abort.
    """
    done = object()
    queue: asyncio.Queue = asyncio.Queue()

    async def drain(index: int, iterator: AsyncGenerator[T, None]) -> None:
        try:
            async for item in iterator:
                queue.put_nowait((index, item))
        except Exception as exc:  # noqa: BLE001 - handed to the consumer, which re-raises
            queue.put_nowait((index, exc))
        finally:
            queue.put_nowait((index, done))

    tasks = [asyncio.create_task(drain(i, it)) for i, it in enumerate(iterators)]
    try:
        num_running = len(tasks)
        while num_running:
            index, item = await queue.get()
            if item is done:
                num_running -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield index, item
    finally:
        # Shielded: under starlette's cancelled scope every await would be cancelled again,
        # and the aborts would never reach the engine.
        with anyio.CancelScope(shield=True):
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            for iterator in iterators:
                await iterator.aclose()


class StreamedChoice:
    """How much of one choice a stream has sent; hands out the next delta.

    While a choice runs, the last `holdback` characters are kept back: a stop string may
    still complete there, and the text before it is all the client may ever see. Thus the
    streamed text always equals the non-streamed text.

    Args:
        holdback: characters to keep back while the choice runs (longest stop string - 1).
        prefix: text sent before the first delta (the prompt, for `echo`).
    """

    def __init__(self, holdback: int = 0, prefix: str = ""):
        self.holdback = holdback
        self.prefix = prefix
        self.num_sent_chars = 0
        self.num_sent_tokens = 0
        self.started = False
        self.finished = False

    def next_delta(
        self, completion: CompletionOutput, want_tokens: bool
    ) -> tuple[str, int, str | None] | None:
        """(text, first new token position, finish_reason) to send, or None for nothing.

        Args:
            completion: the choice's cumulative state.
            want_tokens: new tokens are worth a chunk even without text (logprobs asked for).
        """
        if self.finished:
            return None
        finish_reason = completion.finish_reason
        text_end = len(completion.text)
        if finish_reason is None:
            text_end = max(self.num_sent_chars, text_end - self.holdback)
        text = completion.text[self.num_sent_chars : text_end]
        has_new_tokens = len(completion.token_ids) > self.num_sent_tokens
        if not (text or finish_reason or (want_tokens and has_new_tokens)):
            return None
        if not self.started:
            text, self.started = self.prefix + text, True
        first_token = self.num_sent_tokens
        self.num_sent_chars = text_end
        self.num_sent_tokens = len(completion.token_ids)
        self.finished = finish_reason is not None
        return text, first_token, finish_reason


def prompt_logprobs_body(prompt_logprobs: PromptLogprobs | None) -> PromptLogprobsBody | None:
    """Prompt logprobs as vLLM returns them: per position {token id: logprob, rank, decoded
    token}, null for the first position, -inf floored to MIN_LOGPROB."""
    if prompt_logprobs is None:
        return None
    return [
        None
        if row is None
        else {
            token_id: PromptLogprob(max(lp.logprob, MIN_LOGPROB), lp.rank, lp.decoded_token)
            for token_id, lp in row.items()
        }
        for row in prompt_logprobs
    ]


def stop_holdback(params: SamplingParams) -> int:
    assert not isinstance(params.stop, str), "SamplingParams makes a lone stop string a list"
    return num_held_back_chars(params.stop, params.include_stop_str_in_output)


def count_usage(final_outputs: list[RequestOutput | None]) -> tuple[int, int]:
    """(prompt tokens, completion tokens) summed over prompts and their n choices."""
    num_prompt = num_completion = 0
    for output in final_outputs:
        if output is not None:
            num_prompt += len(output.prompt_token_ids)
            num_completion += sum(len(c.token_ids) for c in output.outputs)
    return num_prompt, num_completion


async def first_output_checked(
    results: AsyncGenerator[tuple[int, RequestOutput], None],
) -> AsyncGenerator[tuple[int, RequestOutput], None]:
    """`results` again, once its first output has arrived and is not an error.

    A stream's HTTP status goes out before its first chunk, so a request the engine may
    still reject (a grammar that does not compile) waits here: its failure is a 400, not an
    error event inside a 200.

    Raises:
        APIError: the first output is a failure (`results` is closed then).
    """
    try:
        first = await anext(results)
        raise_if_failed(first[1])
    except BaseException:
        await results.aclose()
        raise
    return _prepend(first, results)


async def _prepend(first: T, rest: AsyncGenerator[T, None]) -> AsyncGenerator[T, None]:
    try:
        yield first
        async for item in rest:
            yield item
    finally:
        await rest.aclose()


def raise_if_failed(output: RequestOutput) -> None:
    """The engine rejected a request (its finish reason is "error"): a 400, or a 429 when
    its queue was full (--max-waiting-requests)."""
    for completion in output.outputs:
        if completion.finish_reason != "error":
            continue
        if str(completion.stop_reason).startswith(QUEUE_FULL_ERROR):
            raise EngineOverloadedError(str(completion.stop_reason)).to_api_error()
        raise APIError(400, f"the engine rejected the request: {completion.stop_reason}")


def error_event(exc: Exception) -> bytes:
    """An SSE event carrying an error body, for failures after the stream started."""
    if isinstance(exc, EngineOverloadedError):
        exc = exc.to_api_error()
    if not isinstance(exc, APIError):
        status = 503 if isinstance(exc, EngineDeadError) else 500
        exc = APIError(status, f"{type(exc).__name__}: {exc}")
    return sse_event(exc.to_body())


class SSEResponse(StreamingResponse):
    """A StreamingResponse that always closes its body iterator, even when the client went
    away while the iterator waited at a `yield` (there, starlette's cancel never reaches it)."""

    media_type = "text/event-stream"

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            with anyio.CancelScope(shield=True):
                # Always one of the handlers' async generators, which have aclose.
                await self.body_iterator.aclose()  # type: ignore[attr-defined]


async def run_until_disconnected(request: Request, work: Awaitable[Response]) -> Response:
    """Await `work` unless the client disconnects first; then cancel it (which aborts the
    request in the engine) and answer into the void."""
    task = asyncio.ensure_future(work)

    async def wait_for_disconnect() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(wait_for_disconnect())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            with anyio.CancelScope(shield=True):
                await asyncio.gather(task, return_exceptions=True)
    if task.cancelled():
        return Response(status_code=499)  # nobody is listening any more
    return task.result()
