"""The working state of one `Scheduler.schedule()` call."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvserve.services.scheduler.core.block_pool import KVCacheBlock
from kvserve.services.scheduler.core.kv_cache_manager import KVCacheManager
from kvserve.services.scheduler.core.request import Request
from kvserve.shared.messages import (
    CachedRequestData,
    EngineCoreEventType,
    NewRequestData,
    SchedulerOutput,
    SpecDecodeMetadata,
)


@dataclass
class StepPlan:
    """What one `schedule()` call decided so far; the undo serves preemption of a request
    scheduled earlier in the same step."""

    token_budget: int
    # Latency targets (latency_targets.py): what running prompt chunks may take of
    # token_budget (the rest is the decodes'), and what those without a TTFT target may take
    # (the rest kept for prompts with one); None: all of it.
    prefill_budget: int | None = None
    running_prefill_budget: int | None = None
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    new_block_ids: dict[str, list[int]] = field(default_factory=dict)
    scheduled_running: list[Request] = field(default_factory=list)
    scheduled_new: list[Request] = field(default_factory=list)  # new or resumed
    preempted: list[Request] = field(default_factory=list)
    # Speculative decoding: the drafts each request verifies, and the drafts each proposes
    # after the step.
    spec_token_ids: dict[str, list[int]] = field(default_factory=dict)
    num_spec_tokens_to_propose: dict[str, int] = field(default_factory=dict)
    # Images whose encoder runs in this step, per request (encoder_budget.py).
    encoder_inputs: dict[str, list[int]] = field(default_factory=dict)

    def add(self, request: Request, num_tokens: int, new_blocks: list[KVCacheBlock]) -> None:
        self.num_scheduled_tokens[request.req_id] = num_tokens
        self.new_block_ids[request.req_id] = [block.block_id for block in new_blocks]
        self.token_budget -= num_tokens

    def budget_for_running(self, request: Request) -> int:
        """The tokens `request` (running) may take: a prompt chunk only the prefill budget,
        and one without a TTFT target only the running prefill budget."""
        if not _is_prefill(request):
            return self.token_budget
        budget = self.token_budget
        if self.prefill_budget is not None:
            budget = min(budget, self.prefill_budget)
        if self.running_prefill_budget is not None and not request.slo_ttft_ms:
            budget = min(budget, self.running_prefill_budget)
        return budget

    def took_running(self, request: Request, num_tokens: int) -> None:
        """`request` (running) was scheduled `num_tokens` (after add)."""
        self.scheduled_running.append(request)
        self._spend_prefill(request, num_tokens)

    def _spend_prefill(self, request: Request, num_tokens: int) -> None:
        """Take a running prompt chunk of `num_tokens` (negative: give it back) out of the
        prefill budgets that bound it."""
        if not _is_prefill(request):
            return
        if self.prefill_budget is not None:
            self.prefill_budget -= num_tokens
        if self.running_prefill_budget is not None and not request.slo_ttft_ms:
            self.running_prefill_budget -= num_tokens

    def undo(self, request: Request) -> None:
        """Forget a request scheduled earlier in this step (it was just preempted)."""
        num_tokens = self.num_scheduled_tokens.pop(request.req_id, None)
        if num_tokens is None:
            return
        self.new_block_ids.pop(request.req_id)
        self.spec_token_ids.pop(request.req_id, None)
        self.encoder_inputs.pop(request.req_id, None)
        self.token_budget += num_tokens
        self.scheduled_running.remove(request)
        self._spend_prefill(request, -num_tokens)

    def record_events(self, now: float) -> None:
        """One timestamp for the whole step: its requests start computing together."""
        for request in self.scheduled_new:
            request.record_event(EngineCoreEventType.SCHEDULED, now)
        for request in self.preempted:
            request.record_event(EngineCoreEventType.PREEMPTED, now)


def _is_prefill(request: Request) -> bool:
    """Whether `request` computes prompt tokens in this step (before _advance)."""
    return request.num_tokens - request.num_computed_tokens > 1


def make_scheduler_output(
    plan: StepPlan,
    kv_cache_manager: KVCacheManager,
    finished_req_ids: list[str],
    grammar_req_ids: list[str],
    grammar_bitmask: bytes,
    spec_decode: SpecDecodeMetadata,
    kv_connector_metadata: bytes,
    forced_token_ids: dict[str, int] | None = None,
    has_pooling: bool = False,
) -> SchedulerOutput:
    """The step's SchedulerOutput, built before num_computed_tokens advances (the workers
    get pre-step values)."""
    new_reqs = [
        NewRequestData(
            req_id=request.req_id,
            prompt_token_ids=request.prompt_token_ids,
            sampling_params=request.sampling_params,
            block_ids=kv_cache_manager.get_block_ids(request.req_id),
            num_computed_tokens=request.num_computed_tokens,
            output_token_ids=list(request.output_token_ids),
            eos_token_id=None if request.sampling_params.ignore_eos else request.eos_token_id,
            lora_request=request.lora_request,
            mm_inputs=request.mm_inputs,
        )
        for request in plan.scheduled_new
    ]
    running = plan.scheduled_running
    cached_reqs = CachedRequestData(
        req_ids=[request.req_id for request in running],
        new_block_ids=[plan.new_block_ids[request.req_id] for request in running],
        num_computed_tokens=[request.num_computed_tokens for request in running],
    )
    return SchedulerOutput(
        scheduled_new_reqs=new_reqs,
        scheduled_cached_reqs=cached_reqs,
        num_scheduled_tokens=plan.num_scheduled_tokens,
        total_num_scheduled_tokens=sum(plan.num_scheduled_tokens.values()),
        finished_req_ids=finished_req_ids,
        preempted_req_ids=[request.req_id for request in plan.preempted],
        grammar_req_ids=grammar_req_ids,
        grammar_bitmask=grammar_bitmask,
        forced_token_ids=forced_token_ids or {},
        has_pooling=has_pooling,
        spec_decode=spec_decode,
        kv_connector_metadata=kv_connector_metadata,
        scheduled_encoder_inputs=plan.encoder_inputs,
    )
