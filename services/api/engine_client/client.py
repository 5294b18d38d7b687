"""The api's view of the engine: submit a request, stream its RequestOutputs, abort it.

`EngineClient` holds what every transport shares: the tokenizer, the OutputProcessor, one
asyncio queue per request. A subclass moves `EngineCoreRequest`s to the engine core and
feeds `EngineCoreOutputs` back through `_handle_outputs` (on the event loop).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator, Awaitable
from dataclasses import dataclass, field
from typing import Protocol

from kvserve.services.api.observability.request_logger import key_name_suffix
from kvserve.services.api.observability.stats import IterationStats, MigrationStats
from kvserve.services.api.observability.tracing import CURRENT_TRACER, ApiTracer
from kvserve.services.api.serving.errors import APIError
from kvserve.services.api.serving.latency_targets import LatencyTargets
from kvserve.services.api.serving.output_processor import OutputProcessor, make_engine_requests
from kvserve.services.api.serving.outputs import RequestOutput
from kvserve.services.api.serving.tokenizer import TokenizerInfo
from kvserve.services.api.tenancy.tenants import DEFAULT_TENANT, TenantSpec
from kvserve.shared.logging import init_logger
from kvserve.shared.lora import LoRARequest
from kvserve.shared.messages import (
    EngineCoreOutputs,
    EngineCoreRequest,
    PromptPin,
    SchedulerStats,
)
from kvserve.shared.sampling_params import SamplingParams
from kvserve.shared.wire import EngineReady

logger = init_logger(__name__)


class EngineDeadError(RuntimeError):
    """The engine core (or one of its workers) died; requests fail with 503."""


class EngineOverloadedError(RuntimeError):
    """Every engine's queue is full (--max-waiting-requests): a 429 with Retry-After."""

    RETRY_AFTER_S = 1

    def to_api_error(self) -> APIError:
        return APIError(
            429,
            str(self),
            err_type="RateLimitError",
            headers={"Retry-After": str(self.RETRY_AFTER_S)},
        )


class _RequestTrace:
    """One generate() call's spans, each a no-op without a tracer: `generate` over the
    whole request, `queue_to_engine` around the send, `detokenize_stream` from the first
    output on, and the engine core's phases as they come back.

    Args:
        tracer: the process's tracer (None: tracing is off).
        request_id: the request's id, an attribute of its span.
    """

    def __init__(self, tracer: ApiTracer | None, request_id: str):
        self.tracer = tracer
        self.span = None if tracer is None else tracer.start_span("generate", request_id=request_id)
        self.stream_span = None

    def carrier(self) -> dict[str, str] | None:
        """The trace context the engine requests carry (None without a tracer)."""
        return None if self.tracer is None else self.tracer.inject(self.span)

    async def send(self, sending: Awaitable[None]) -> None:
        if self.tracer is None:
            await sending
            return
        queue_span = self.tracer.start_span("queue_to_engine", self.span)
        try:
            await sending
        finally:
            queue_span.end()

    def on_output(self, item: RequestOutput) -> None:
        if self.tracer is None:
            return
        if self.stream_span is None:
            self.stream_span = self.tracer.start_span("detokenize_stream", self.span)
        for child_id, engine_spans in item.engine_spans or ():
            self.tracer.add_engine_spans(self.span, engine_spans, request_id=child_id)

    def end(self) -> None:
        if self.stream_span is not None:
            self.stream_span.end()
        if self.span is not None:
            self.span.end()


def _log_finished(request_id: str, num_prompt_tokens: int, item: RequestOutput) -> None:
    logger.info(
        "request %s%s finished (%s): %d prompt + %d output tokens, %d cached",
        request_id,
        key_name_suffix(),
        ",".join(str(c.finish_reason) for c in item.outputs),
        num_prompt_tokens,
        sum(len(c.token_ids) for c in item.outputs),
        item.num_cached_tokens,
    )


@dataclass(slots=True)
class StatsTotals:
    """Sums of SchedulerStats' per-step counters since the client started (for /metrics)."""

    num_preemptions: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    grammar_cache_queries: int = 0
    grammar_cache_hits: int = 0
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_accepted_per_pos: list[int] = field(default_factory=list)
    external_prefix_cache_queries: int = 0
    external_prefix_cache_hits: int = 0
    kv_bytes_loaded: int = 0
    kv_bytes_saved: int = 0
    # Prompt pins: prefixes hit and missed by TTL class, expirations, pins yielded.
    pin_hits: dict[str, int] = field(default_factory=dict)
    pin_misses: dict[str, int] = field(default_factory=dict)
    num_pins_expired: int = 0
    num_pins_yielded: int = 0

    def add(self, stats: SchedulerStats) -> None:
        self.num_preemptions += stats.num_preemptions
        self.prefix_cache_queries += stats.prefix_cache_queries
        self.prefix_cache_hits += stats.prefix_cache_hits
        self.grammar_cache_queries += stats.grammar_cache_queries
        self.grammar_cache_hits += stats.grammar_cache_hits
        self.external_prefix_cache_queries += stats.external_prefix_cache_queries
        self.external_prefix_cache_hits += stats.external_prefix_cache_hits
        self.kv_bytes_loaded += stats.kv_bytes_loaded
        self.kv_bytes_saved += stats.kv_bytes_saved
        self.num_pins_expired += stats.num_pins_expired
        self.num_pins_yielded += stats.num_pins_yielded
        for totals, counts in (
            (self.pin_hits, stats.pin_hits),
            (self.pin_misses, stats.pin_misses),
        ):
            for ttl, count in counts.items():
                totals[ttl] = totals.get(ttl, 0) + count
        if stats.spec_num_drafts:
            self.spec_num_drafts += stats.spec_num_drafts
            self.spec_num_draft_tokens += stats.spec_num_draft_tokens
            self.spec_num_accepted_tokens += stats.spec_num_accepted_tokens
            per_pos = self.spec_accepted_per_pos
            per_pos.extend([0] * (len(stats.spec_accepted_per_pos) - len(per_pos)))
            for pos, count in enumerate(stats.spec_accepted_per_pos):
                per_pos[pos] += count


def estimate_waiting(num_in_flight: int, stats: SchedulerStats | None) -> int:
    """An engine's waiting requests: those sent and not finished, less those its latest
    stats say run (requests sent since those stats count as waiting)."""
    return max(0, num_in_flight - (stats.num_running_reqs if stats is not None else 0))


def overloaded(num_waiting: int, max_waiting_requests: int) -> EngineOverloadedError:
    return EngineOverloadedError(
        f"the server is overloaded: {num_waiting} requests wait and the limit is "
        f"{max_waiting_requests} (--max-waiting-requests); retry after "
        f"{EngineOverloadedError.RETRY_AFTER_S} s"
    )


class StatLogger(Protocol):
    """What takes each engine step's figures (the Prometheus metrics, the periodic log line)."""

    def record(
        self,
        engine_index: int,
        scheduler_stats: SchedulerStats | None,
        iteration_stats: IterationStats,
    ) -> None: ...


class EngineClient:
    """
    Args:
        tokenizer_info: the model's tokenizer and stop ids.
        max_model_len: the engine's effective max_model_len (from its ready message).
        model_name: the name the API serves the model under.
        max_logprobs: the most logprobs a request may ask for per token (the engine's
            --max-logprobs, from its ready message).
        max_waiting_requests: requests an engine queues at most (its
            --max-waiting-requests, from its ready message).
    """

    def __init__(
        self,
        tokenizer_info: TokenizerInfo,
        max_model_len: int,
        model_name: str,
        max_logprobs: int = 20,
        max_waiting_requests: int | None = None,
    ):
        self.tokenizer_info = tokenizer_info
        self.max_model_len = max_model_len
        self.model_name = model_name
        self.max_logprobs = max_logprobs
        self.max_waiting_requests = max_waiting_requests
        # --enable-sleep-mode: the level the engines sleep at (0: awake); while > 0 every
        # request is refused with a 503 before it reaches an engine.
        self.sleep_level = 0
        self.output_processor = OutputProcessor(tokenizer_info.tokenizer)
        self.queues: dict[str, asyncio.Queue] = {}
        self.latest_stats: SchedulerStats | None = None
        self.stats_totals = StatsTotals()
        self.stat_loggers: list[StatLogger] = []
        self.dead_reason: str | None = None
        # The key file's tightest TTFT target (TenantDirectory.tightest_ttft_ms), written on
        # every engine request: set by the app context, again on SIGHUP.
        self.standing_ttft_ms: float | None = None

    # ------------------------------------------------------------------ transport (subclass)

    async def _send_requests(self, requests: list[EngineCoreRequest]) -> None:
        raise NotImplementedError

    async def _send_abort(self, engine_request_ids: list[str]) -> None:
        raise NotImplementedError

    async def shutdown(self) -> None:
        pass

    async def reset_prefix_cache(self) -> bool:
        """Forget every engine's cached prefixes; False when some engine still held blocks."""
        raise NotImplementedError(f"{type(self).__name__} cannot reset the prefix cache")

    async def sleep(self, level: int) -> bool:
        """--enable-sleep-mode: every engine frees its KV cache (and weights at level 2);
        False (nothing freed) while requests are in flight."""
        raise NotImplementedError(f"{type(self).__name__} has no sleep mode")

    async def wake_up(self, tags: list[str] | None = None) -> None:
        """Every engine restores what sleep freed (`tags`: weights and/or kv_cache)."""
        raise NotImplementedError(f"{type(self).__name__} has no sleep mode")

    def _forget_request(self, request_id: str, child_ids: list[str]) -> None:
        """The request ended (finished, failed or aborted): drop its routing state."""

    async def _submit(self, requests: list[EngineCoreRequest]) -> None:
        """Send a new request's children (a client that waits for restarted engines
        holds them while none serves)."""
        await self._send_requests(requests)

    # ------------------------------------------------------------------ public API

    @property
    def is_healthy(self) -> bool:
        return self.dead_reason is None

    @property
    def waits_for_engine(self) -> bool:
        """No engine core serves now but one is expected back: new requests are held for
        it rather than refused (never here: only a client of restartable engine processes
        waits)."""
        return False

    def health_report(self) -> dict:
        """/health's body: overall status and one entry per engine core."""
        state = "serving" if self.is_healthy else "dead"
        engine = {"engine": 0, "state": state}
        if self.dead_reason is not None:
            engine["reason"] = self.dead_reason
        return {"status": "healthy" if self.is_healthy else "unhealthy", "engines": [engine]}

    def per_engine_stats(self) -> list[tuple[int, SchedulerStats | None, StatsTotals]]:
        """(engine index, latest stats, counter sums) of every engine core, for /metrics."""
        return [(0, self.latest_stats, self.stats_totals)]

    def engine_handshakes(self) -> list[EngineReady]:
        """Every engine core's READY message, by engine index (none known here)."""
        return []

    def migration_stats(self) -> dict[int, MigrationStats]:
        """Requests moved off dead engine cores, by the index of the engine that died
        (none here: this client moves none)."""
        return {}

    def check_capacity(self, num_requests: int = 1) -> None:
        """Raise EngineOverloadedError when no engine can queue `num_requests` more engine
        requests (a request's n children count each) within --max-waiting-requests."""
        if self.max_waiting_requests is None:
            return
        num_waiting = estimate_waiting(
            len(self.output_processor.child_to_parent), self.latest_stats
        )
        if num_waiting > 0 and num_waiting + num_requests > self.max_waiting_requests:
            raise overloaded(num_waiting, self.max_waiting_requests)

    async def generate(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        priority: int = 0,
        lora_request: LoRARequest | None = None,
        tenant: TenantSpec | None = None,
        targets: LatencyTargets | None = None,
        pins: list[PromptPin] | None = None,
    ) -> AsyncGenerator[RequestOutput, None]:
        """Yield cumulative RequestOutputs until the last one (finished=True); `tenant`:
        who it is served for (None: "default"); `targets`: its latency targets (None: the
        engine's own); `pins`: prompt prefixes to pin (serving/prompt_cache.py).

        Closing the generator early (a client that went away) aborts the request.
        """
        if self.dead_reason is not None:
            raise EngineDeadError(self.dead_reason)
        queue: asyncio.Queue = asyncio.Queue()
        trace = _RequestTrace(CURRENT_TRACER.get(), request_id)
        child_ids = self.output_processor.add_request(
            request_id,
            prompt,
            prompt_token_ids,
            params,
            tenant.name if tenant else DEFAULT_TENANT,
            traced=trace.tracer is not None,
            targets=targets,
        )
        self.queues[request_id] = queue
        finished = False
        try:
            requests = make_engine_requests(
                child_ids,
                prompt_token_ids,
                params,
                priority,
                self.tokenizer_info,
                lora_request,
                tenant,
                trace.carrier(),
                targets,
                pins,
                self.standing_ttft_ms,
            )
            await trace.send(self._submit(requests))
            while not finished:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                trace.on_output(item)
                if finished:
                    _log_finished(request_id, len(prompt_token_ids), item)
                yield item
        finally:
            self.queues.pop(request_id, None)
            if not finished:
                await self.abort(request_id)
            self._forget_request(request_id, child_ids)
            trace.end()

    def _engine_index_of(self, engine_request_id: str) -> int:
        """The engine an engine request went to (one engine here)."""
        return 0

    async def abort(self, request_id: str) -> None:
        now = time.monotonic()
        aborted = IterationStats(now, now) if self.stat_loggers else None
        child_ids = self.output_processor.abort_request(request_id, aborted)
        if child_ids and aborted is not None:
            aborted.num_aborted = len(child_ids)
            for stat_logger in self.stat_loggers:
                stat_logger.record(self._engine_index_of(child_ids[0]), None, aborted)
        if child_ids and self.dead_reason is None:
            logger.info("request %s aborted", request_id)
            await self._send_abort(child_ids)

    # ------------------------------------------------------------------ helpers

    async def _handle_outputs(self, outputs: EngineCoreOutputs) -> None:
        if outputs.scheduler_stats is not None:
            self.latest_stats = outputs.scheduler_stats
            self.stats_totals.add(outputs.scheduler_stats)
        iteration_stats = None
        if self.stat_loggers:
            iteration_stats = IterationStats(time.monotonic(), outputs.timestamp)
        request_outputs, to_abort = self.output_processor.process_outputs(
            outputs.outputs, iteration_stats
        )
        if iteration_stats is not None:
            for stat_logger in self.stat_loggers:
                stat_logger.record(outputs.engine_index, outputs.scheduler_stats, iteration_stats)
        for ro in request_outputs:
            queue = self.queues.get(ro.request_id)
            if queue is not None:
                queue.put_nowait(ro)
        if to_abort:
            await self._send_abort(to_abort)

    def _fail_requests(self, request_ids: list[str], reason: str) -> None:
        """These requests' engine is gone: each ends with EngineDeadError(reason)."""
        for request_id in request_ids:
            self.output_processor.abort_request(request_id)
            queue = self.queues.get(request_id)
            if queue is not None:
                queue.put_nowait(EngineDeadError(reason))

    def _fail_all(self, reason: str) -> None:
        """The engine is gone: every waiting request ends with EngineDeadError."""
        self.dead_reason = reason
        logger.error("engine dead: %s; failing %d in-flight requests", reason, len(self.queues))
        self._fail_requests(list(self.queues), reason)
