"""One request's state inside the engine core: tokens, progress, status and block hashes."""

from __future__ import annotations

import enum
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

from kvserve.services.scheduler.core.thinking import ThinkingState
from kvserve.shared.hashing import HashFn, hash_new_full_blocks, make_extra_keys
from kvserve.shared.lora import LoRARequest, lora_extra_key
from kvserve.shared.messages import (
    EngineCoreEvent,
    EngineCoreEventType,
    EngineCoreRequest,
    FinishReason,
    ImageInput,
    PromptPin,
)
from kvserve.shared.sampling_params import SamplingParams

if TYPE_CHECKING:
    from kvserve.services.scheduler.core.request_trace import RequestTrace
    from kvserve.services.scheduler.core.spec_decode import SpecRequestState
    from kvserve.services.scheduler.structured_output.grammar import Grammar

# Returns the hashes of the request's full blocks that request.block_hashes lacks.
BlockHasher = Callable[["Request"], list[bytes]]


class RequestStatus(enum.IntEnum):
    """Lifecycle: [WAITING_FOR_GRAMMAR ->] WAITING [-> WAITING_FOR_REMOTE_KVS -> WAITING]
    -> RUNNING (<-> PREEMPTED -> RUNNING) -> one FINISHED_* state. A structured-output
    request waits for its grammar to compile before it may be scheduled; a request whose
    prefix the KV connector's store holds waits one step for those blocks to load."""

    WAITING_FOR_GRAMMAR = 0
    WAITING = 1
    WAITING_FOR_REMOTE_KVS = 2
    RUNNING = 3
    PREEMPTED = 4
    # Every status after PREEMPTED is final; `is_finished` relies on this order.
    FINISHED_STOPPED = 5
    FINISHED_LENGTH_CAPPED = 6
    FINISHED_ABORTED = 7
    FINISHED_ERROR = 8

    @staticmethod
    def is_finished(status: RequestStatus) -> bool:
        return status > RequestStatus.PREEMPTED


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: FinishReason.STOP,
    RequestStatus.FINISHED_LENGTH_CAPPED: FinishReason.LENGTH,
    RequestStatus.FINISHED_ABORTED: FinishReason.ABORT,
    RequestStatus.FINISHED_ERROR: FinishReason.ERROR,
}


class StructuredOutputState:
    """A request's grammar: compiling (`future`), then walked by `grammar`.

    Args:
        future: the compile's Future (StructuredOutputManager.compile).
    """

    __slots__ = ("future", "grammar")

    def __init__(self, future: Future[Any]):
        self.future = future
        self.grammar: Grammar | None = None


def make_block_hasher(block_size: int, hash_fn: HashFn) -> BlockHasher:
    """A closure that hashes a request's newly filled blocks (see `Request.block_hashes`)."""

    def hash_new_blocks(request: Request) -> list[bytes]:
        return hash_new_full_blocks(
            hash_fn,
            block_size,
            request.all_token_ids,
            request.block_hashes,
            request.extra_keys,
            mm_spans=[(m.offset, m.end, m.mm_hash) for m in request.mm_inputs],
        )

    return hash_new_blocks


class Request:
    """A request's tokens and progress, as the scheduler tracks it.

    Args:
        req_id: unique among live requests.
        prompt_token_ids: the tokenized prompt (not empty).
        sampling_params: the request's sampling knobs (max_tokens, stop ids, ...).
        eos_token_id: the model's end-of-sequence id, or None.
        arrival_time: when the api received it (orders fcfs and priority ties).
        priority: lower runs first under the priority policy.
        cache_salt: isolates this request's prefix-cache blocks from other salts.
        block_hasher: hashes full blocks as tokens arrive; None when prefix caching is off.
        lora_request: the adapter it runs with (None: the base model); part of its block
            hashes, so adapters never share cached blocks.
        tenant: who it is served for; the fair policy serves tenants by weighted service.
        tenant_weight: the tenant's weight (its share under the fair policy).
        mm_inputs: the prompt's images (their placeholder tokens are in the prompt).
        slo_ttft_ms: its time-to-first-token target (None: none); its deadline is
            arrival_time + the target (latency_targets.py).
        slo_tpot_ms: its time-per-output-token target (None: none).
        standing_ttft_ms: the tightest TTFT target a request may arrive with while this one
            is live (its tenants' in the key file; None: none): a step it is in leaves
            room for one arriving (latency_targets.py).
    """

    def __init__(
        self,
        req_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        eos_token_id: int | None = None,
        arrival_time: float = 0.0,
        priority: int = 0,
        cache_salt: str | None = None,
        block_hasher: BlockHasher | None = None,
        lora_request: LoRARequest | None = None,
        tenant: str = "default",
        tenant_weight: float = 1.0,
        mm_inputs: list[ImageInput] | None = None,
        slo_ttft_ms: float | None = None,
        slo_tpot_ms: float | None = None,
        standing_ttft_ms: float | None = None,
    ) -> None:
        self.req_id = req_id
        self.slo_ttft_ms = slo_ttft_ms
        self.slo_tpot_ms = slo_tpot_ms
        self.standing_ttft_ms = standing_ttft_ms
        # Images in the prompt: their hashes key the blocks holding their tokens.
        self.mm_inputs: list[ImageInput] = list(mm_inputs or ())
        self.tenant = tenant
        self.tenant_weight = tenant_weight
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.eos_token_id = eos_token_id
        self.arrival_time = arrival_time
        self.priority = priority
        self.cache_salt = cache_salt
        self.lora_request = lora_request
        self.extra_keys = make_extra_keys(cache_salt, lora_extra_key(lora_request))
        # Read once per sampled token, so frozen here rather than rebuilt by the property.
        self.stop_token_ids = frozenset(sampling_params.all_stop_token_ids)
        self._init_progress(prompt_token_ids)
        self._init_feature_state(sampling_params)
        self._block_hasher = block_hasher
        self.block_hashes: list[bytes] = []
        self._update_block_hashes()

    def _init_progress(self, prompt_token_ids: list[int]) -> None:
        """Its tokens, its status, and what it computed, sent and recorded so far."""
        self.status = RequestStatus.WAITING
        self.stop_reason: int | None = None
        self.error: str | None = None  # why it ended, when FINISHED_ERROR
        self.output_token_ids: list[int] = []
        self.all_token_ids: list[int] = list(prompt_token_ids)
        # Tokens whose K/V is in the cache or being written by the step in flight.
        self.num_computed_tokens = 0
        # Prefix-cache hit length at the first schedule; -1 until then. Only the request's
        # first output carries it (EngineCoreOutput.num_cached_tokens).
        self.num_cached_tokens = -1
        self.sent_first_output = False
        self.num_preemptions = 0
        # A recompute after preemption produces prompt logprobs again: count what was sent
        # and what this run produced, so each prompt position is reported once.
        self.num_prompt_logprobs_sent = 0
        self.num_prompt_logprobs_seen = 0
        # Timed events not yet sent (the scheduler records them only with log_stats).
        self.events: list[EngineCoreEvent] = []

    def _init_feature_state(self, sampling_params: SamplingParams) -> None:
        """The state of the optional features it may use, each set up by its own code."""
        self.structured_output: StructuredOutputState | None = None
        # Resumed answer tokens the grammar has yet to walk (it compiles after arrival).
        self.grammar_replay: list[int] = []
        # Thinking before the answer (reasoning parsers): counted, and its end forced at a
        # budget (thinking.py); None for a request that does not think.
        end_ids = sampling_params.reasoning_end_token_ids
        self.thinking = (
            ThinkingState(end_ids, sampling_params.thinking_token_budget) if end_ids else None
        )
        # Speculative decoding: drafts and acceptance (None when the engine has none).
        self.spec: SpecRequestState | None = None
        # KV connector: whether the current tokens came partly from its loads.
        self.kv_loaded = False
        # --otlp-traces-endpoint: its phases, when the api traces it (request_trace.py).
        self.trace: RequestTrace | None = None
        # Prompt prefixes to pin when it finishes (prompt_pins.py).
        self.pins: list[PromptPin] = []

    @classmethod
    def from_engine_core_request(
        cls, req: EngineCoreRequest, block_hasher: BlockHasher | None
    ) -> Request:
        request = cls(
            req_id=req.request_id,
            prompt_token_ids=req.prompt_token_ids,
            sampling_params=req.sampling_params,
            eos_token_id=req.eos_token_id,
            arrival_time=req.arrival_time,
            priority=req.priority,
            cache_salt=req.cache_salt,
            block_hasher=block_hasher,
            lora_request=req.lora_request,
            tenant=req.tenant,
            tenant_weight=req.tenant_weight,
            mm_inputs=req.mm_inputs,
            slo_ttft_ms=req.slo_ttft_ms,
            slo_tpot_ms=req.slo_tpot_ms,
            standing_ttft_ms=req.standing_ttft_ms,
        )
        request.pins = list(req.pins)
        if req.resumed_output_token_ids:
            request.resume(req.resumed_output_token_ids)
        return request

    def resume(self, output_token_ids: list[int]) -> None:
        """Take the tokens a migrated request already emitted elsewhere as its output, as if
        sampled here: the thinking counts them, and the grammar walks the answer among them
        once it compiles. Like a preempted request, it recomputes them all before it samples."""
        for token_id in output_token_ids:
            answering = self.thinking is None or not self.thinking.take(token_id)
            if answering and self.sampling_params.structured_outputs is not None:
                self.grammar_replay.append(token_id)
        self.append_output_token_ids(output_token_ids)

    def preempt(self) -> None:
        """Its blocks were freed to make room: it recomputes everything when it runs again."""
        self.status = RequestStatus.PREEMPTED
        self.num_computed_tokens = 0
        self.kv_loaded = False
        if self.spec is not None:
            self.spec.draft_token_ids = []  # they followed tokens it recomputes
        self.num_preemptions += 1
        self.num_prompt_logprobs_seen = 0
        if self.trace is not None:
            self.trace.preempted(time.time_ns())

    def append_output_token_ids(self, token_ids: int | Iterable[int]) -> None:
        """Append sampled tokens and hash any block they complete."""
        if isinstance(token_ids, int):
            token_ids = (token_ids,)
        for token_id in token_ids:
            self.output_token_ids.append(token_id)
            self.all_token_ids.append(token_id)
        self._update_block_hashes()

    def record_event(self, event_type: EngineCoreEventType, timestamp: float) -> None:
        self.events.append(EngineCoreEvent(event_type, timestamp))

    def take_events(self) -> list[EngineCoreEvent] | None:
        """The events since the last call, or None when there are none."""
        if not self.events:
            return None
        events, self.events = self.events, []
        return events

    def _update_block_hashes(self) -> None:
        if self._block_hasher is not None:
            self.block_hashes.extend(self._block_hasher(self))

    @property
    def lora_int_id(self) -> int:
        """The adapter's id; 0 for the base model."""
        return 0 if self.lora_request is None else self.lora_request.lora_int_id

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def max_tokens(self) -> int | None:
        """New tokens allowed at most; None means up to max_model_len."""
        return self.sampling_params.max_tokens

    @property
    def skip_reading_prefix_cache(self) -> bool:
        # Prompt logprobs need the logits of every prompt position, and mean (cls) pooling
        # the hidden state of every (the first) prompt position: nothing may be reused.
        params = self.sampling_params
        return params.prompt_logprobs is not None or params.pooling in ("mean", "cls")

    @property
    def is_finished(self) -> bool:
        return RequestStatus.is_finished(self.status)

    def get_finished_reason(self) -> FinishReason | None:
        return _FINISH_REASONS.get(self.status)

    def __repr__(self) -> str:
        return (
            f"Request({self.req_id!r}, {self.status.name}, "
            f"computed={self.num_computed_tokens}/{self.num_tokens})"
        )
