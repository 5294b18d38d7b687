"""The scheduler: each step, which requests compute how many tokens, in which KV blocks.

There are no prefill and decode phases. A request has `num_computed_tokens` and `num_tokens`,
and each step spends a token budget: running requests first (in order, preempting from the
tail when the cache is full), then waiting requests (after a prefix-cache lookup), chunking
long prompts. One `schedule()` makes a `SchedulerOutput`, a diff against the workers' state;
`update_from_output()` takes the sampled tokens back and checks the stop conditions.

The scheduling policy (`--scheduling-policy`, policies/) orders the waiting queue, splits a
step into rounds of running then waiting requests, and picks the preemption victim; the
optional features plug in at their seams (features.py): a structured-output request waits
for its grammar first (grammar_wait.py), a KV connector's loads park a request for a step
(kv_load.py), and so on.

`num_computed_tokens` advances when a step is scheduled (its K/V is then being written), not
when its output returns, so state stays consistent even if two schedules run back to back.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from typing import Any

from kvserve.services.scheduler.core.block_pool import KVCacheBlock
from kvserve.services.scheduler.core.encoder_budget import EncoderBudget
from kvserve.services.scheduler.core.features import (
    NO_FEATURES,
    LiveFeatureCounts,
    SchedulerFeatures,
)
from kvserve.services.scheduler.core.grammar_wait import admit_compiled_grammars, wait_for_grammar
from kvserve.services.scheduler.core.kv_cache_groups import (
    GroupedKVCacheManager,
    max_tokens_in_cache,
)
from kvserve.services.scheduler.core.kv_cache_manager import KVCacheManager
from kvserve.services.scheduler.core.kv_load import admit_loaded, finish_loads, park_for_load
from kvserve.services.scheduler.core.latency_targets import LatencyTargets
from kvserve.services.scheduler.core.policies import create_policy
from kvserve.services.scheduler.core.prompt_pins import make_pin_table
from kvserve.services.scheduler.core.request import Request, RequestStatus, make_block_hasher
from kvserve.services.scheduler.core.request_output import (
    forced_tokens_of,
    grammar_bitmask_of,
    take_step_output,
)
from kvserve.services.scheduler.core.request_queue import RequestQueue
from kvserve.services.scheduler.core.request_trace import RequestTrace
from kvserve.services.scheduler.core.scheduler_stats import make_scheduler_stats
from kvserve.services.scheduler.core.spec_scheduler import SpecDecodeScheduler
from kvserve.services.scheduler.core.step_plan import StepPlan, make_scheduler_output
from kvserve.shared.config import CacheConfig, SchedulerConfig
from kvserve.shared.hashing import get_hash_fn
from kvserve.shared.kv_cache_groups import KVCacheGroupSpec, is_single_full_group
from kvserve.shared.logging import init_logger
from kvserve.shared.messages import (
    EngineCoreEventType,
    EngineCoreOutput,
    EngineCoreRequest,
    FinishReason,
    ModelRunnerOutput,
    SchedulerOutput,
    SchedulerStats,
)

logger = init_logger(__name__)


class Scheduler:
    """Decides every step's batch and owns the request lifecycle in the engine core.

    Args:
        scheduler_config: token budget, sequence cap, chunking and policy.
        cache_config: block size, prefix caching and its hash.
        num_blocks: KV-cache blocks, the null block included (from the memory profile).
        max_model_len: longest prompt + output in tokens; capped (with a warning) to what the
            cache holds, so `self.max_model_len` is the effective limit.
        log_stats: collect the counters `make_stats` reports, and time each request's
            events (queued, scheduled, preempted) for the api's metrics.
        features: the optional features, each plugged in at its seam (SchedulerFeatures).
    """

    def __init__(
        self,
        scheduler_config: SchedulerConfig,
        cache_config: CacheConfig,
        num_blocks: int,
        max_model_len: int,
        log_stats: bool = True,
        features: SchedulerFeatures = NO_FEATURES,
    ) -> None:
        self.scheduler_config = scheduler_config
        self.cache_config = cache_config
        self.max_model_len = max_model_len
        self.log_stats = log_stats
        self._fit_max_model_len_to_cache(num_blocks, features.kv_cache_groups)
        self._check_config()
        self._init_kv_cache(num_blocks, features.kv_cache_groups)
        self._init_features(features)
        self._init_queues()
        self.num_preemptions_total = 0
        self._num_step_preemptions = 0
        self._num_step_scheduled_tokens = 0

    def _init_kv_cache(self, num_blocks: int, groups: list[KVCacheGroupSpec] | None) -> None:
        """The KV cache manager (one block table, or one per group) and the block hasher."""
        block_size = self.cache_config.block_size
        enable_prefix_caching = self.cache_config.enable_prefix_caching
        self.kv_cache_manager = (
            KVCacheManager(num_blocks, block_size, enable_prefix_caching, self.max_model_len)
            if is_single_full_group(groups)
            else GroupedKVCacheManager(
                num_blocks, block_size, groups or [], enable_prefix_caching, self.max_model_len
            )
        )
        # Prompt pins (prompt_pins.py): None without prefix caching or with KV cache groups.
        self.pins = make_pin_table(self.kv_cache_manager, self.cache_config)
        self.block_hasher = None
        if enable_prefix_caching:
            hash_fn = get_hash_fn(self.cache_config.prefix_caching_hash_algo)
            self.block_hasher = make_block_hasher(block_size, hash_fn)

    def _init_features(self, features: SchedulerFeatures) -> None:
        """The optional features, each at its seam, and the policy (policies/)."""
        lora_config = features.lora_config
        self.lora_config = lora_config if lora_config and lora_config.enable_lora else None
        self.structured_output_manager = features.structured_output_manager
        self.speculative_config = features.speculative_config
        self.spec_decode = (
            SpecDecodeScheduler(
                features.speculative_config, features.step_costs, self.max_model_len
            )
            if features.speculative_config is not None
            else None
        )
        self.kv_connector = features.kv_connector
        if self.kv_connector is not None:
            self.kv_connector.bind(self.kv_cache_manager)
            if self.pins is not None:  # pins are written through to the KV store
                self.pins.on_pin = self.kv_connector.pin_blocks
        # Images in the prompt: which images' vision encoder runs in a step.
        encoder_tokens = self.scheduler_config.encoder_token_budget
        self.encoder = EncoderBudget(encoder_tokens, encoder_tokens)
        # The waiting queue's order, the step's rounds and the preemption victim.
        self.policy = create_policy(self.scheduler_config)
        # TTFT / TPOT targets: each step's budget, and the step-time model it plans with.
        self.latency = LatencyTargets(
            self.scheduler_config,
            features.step_costs,
            prompt_keys_per_token=features.prompt_keys_per_token,
        )
        self.live = LiveFeatureCounts()

    def _init_queues(self) -> None:
        """Every live request, by id, and the queues it moves between."""
        self.requests: dict[str, Request] = {}
        self.waiting: RequestQueue = self.policy.waiting
        self.running: list[Request] = []
        # Structured-output requests whose grammar is compiling, in arrival order.
        self.waiting_for_grammar: dict[str, Request] = {}
        # Requests whose external prefix blocks load in the step in flight.
        self.waiting_for_remote_kvs: dict[str, Request] = {}
        # Finished or aborted since the last schedule(): the workers drop their state.
        self.finished_req_ids: set[str] = set()
        # Outputs not tied to a step (rejected requests), sent with the next step's outputs.
        self._pending_outputs: list[EngineCoreOutput] = []

    def _check_config(self) -> None:
        config = self.scheduler_config
        if not config.enable_chunked_prefill and config.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"max_num_batched_tokens ({config.max_num_batched_tokens}) is smaller than "
                f"max_model_len ({self.max_model_len}), so a long prompt could never be "
                f"scheduled without chunked prefill: raise max_num_batched_tokens, lower "
                f"max_model_len, or enable chunked prefill"
            )

    def _fit_max_model_len_to_cache(
        self, num_blocks: int, groups: list[KVCacheGroupSpec] | None
    ) -> None:
        # A request longer than the whole cache would preempt itself forever: cap lengths.
        block_size = self.cache_config.block_size
        num_cache_tokens: int | None = (num_blocks - 1) * block_size
        if not is_single_full_group(groups):
            num_batched = self.scheduler_config.max_num_batched_tokens
            num_cache_tokens = max_tokens_in_cache(
                groups or [], num_blocks, block_size, num_batched
            )
        if num_cache_tokens is not None and num_cache_tokens < self.max_model_len:
            logger.warning(
                "the KV cache holds only %d tokens: capping max_model_len %d to it",
                num_cache_tokens,
                self.max_model_len,
            )
            self.max_model_len = num_cache_tokens

    # ------------------------------------------------------------------ requests in

    def add_request(self, engine_request: EngineCoreRequest) -> None:
        """Queue a request that passed the engine core's checks (request_checks.py)."""
        assert engine_request.request_id not in self.requests, "request_checks refuses reuse"
        assert 0 < len(engine_request.prompt_token_ids) < self.max_model_len
        request = Request.from_engine_core_request(engine_request, self.block_hasher)
        self.requests[request.req_id] = request
        self.latency.add(request)
        if engine_request.trace_context is not None:
            request.trace = RequestTrace(time.time_ns())
        self.live.add(request)
        self.policy.on_request_added(request)
        if self.spec_decode is not None:
            self.spec_decode.add_request(request)
        if request.sampling_params.structured_outputs is not None:
            wait_for_grammar(self, request)  # request_checks refused them without a manager
        else:
            self.waiting.add_request(request)
        if self.log_stats:
            request.record_event(EngineCoreEventType.QUEUED, time.monotonic())

    def reject(self, request_id: str, error: str) -> None:
        """End a request with an ERROR output, sent with the next step's outputs: the one
        error path, for requests the engine core refused and ones that failed here."""
        logger.warning("request %s ends with an error: %s", request_id, error)
        self._pending_outputs.append(
            EngineCoreOutput(
                request_id=request_id,
                new_token_ids=[],
                finish_reason=FinishReason.ERROR,
                error=error,
            )
        )

    def finish_requests(self, req_ids: str | Iterable[str], status: RequestStatus) -> None:
        """End requests from outside (aborts, stop strings); their blocks are freed at once.

        Args:
            req_ids: one id or several; unknown or already finished ids are ignored.
            status: a FINISHED_* status.
        """
        if not RequestStatus.is_finished(status):
            raise ValueError(f"finish_requests needs a FINISHED_* status, got {status!r}")
        if isinstance(req_ids, str):
            req_ids = (req_ids,)
        requests = {req_id: self.requests[req_id] for req_id in req_ids if req_id in self.requests}
        if not requests:
            return
        self.running = [r for r in self.running if r.req_id not in requests]
        self.waiting.remove_requests(
            r
            for r in requests.values()
            if r.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)
        )
        for req_id in requests:
            self.waiting_for_grammar.pop(req_id, None)
            self.waiting_for_remote_kvs.pop(req_id, None)
        for request in requests.values():
            request.status = status
            self._free_request(request)

    def _free_request(self, request: Request) -> None:
        assert request.is_finished, f"{request} freed before it finished"
        self.live.remove(request)
        self.latency.remove(request)
        if self.pins is not None and request.pins:
            self.pins.pin_finished(request, self.kv_cache_manager)
        self.kv_cache_manager.free(request)
        self.encoder.free(request)
        if self.kv_connector is not None:
            self.kv_connector.request_finished(request)
        self.policy.on_request_freed(request)
        if self.spec_decode is not None:
            self.spec_decode.free(request)
        self.finished_req_ids.add(request.req_id)
        del self.requests[request.req_id]

    def _fail_request(self, request: Request, error: str) -> None:
        """End a request that never ran with an ERROR output (sent with the next outputs)."""
        request.status = RequestStatus.FINISHED_ERROR
        self.reject(request.req_id, error)
        self._free_request(request)

    # ------------------------------------------------------------------ schedule

    def schedule(self) -> SchedulerOutput:
        """Plan one step: running requests first, then waiting ones if nothing was preempted."""
        if self.waiting_for_grammar:
            admit_compiled_grammars(self)
        if self.pins is not None:
            self.pins.expire()
        # max_num_batched_tokens, unless latency targets cut the step (latency_targets.py).
        budget = self.latency.step_budget(self.running, self.waiting)
        plan = StepPlan(
            budget.token_budget,
            prefill_budget=budget.prefill_budget,
            running_prefill_budget=budget.running_prefill_budget,
        )
        self.encoder.start_step()
        # The policy's rounds: one, but for the fair policy's short steps (policies/).
        for step_round in self.policy.rounds(self.running, plan):
            self._schedule_running(plan, step_round.running)
            # A step that had to preempt is short of blocks: admitting more would thrash.
            if plan.preempted:
                break
            self._schedule_waiting(plan, step_round.admits)
        if self.spec_decode is not None:
            self.spec_decode.plan_proposals(plan, len(self.running), self.kv_cache_manager)
        # Built before num_computed_tokens advances: the workers get pre-step values.
        scheduler_output = self._make_output(plan)
        self._advance(plan)
        self.policy.on_step_planned()
        if self.log_stats:
            plan.record_events(time.monotonic())
            self._num_step_scheduled_tokens += scheduler_output.total_num_scheduled_tokens
        return scheduler_output

    def _make_output(self, plan: StepPlan) -> SchedulerOutput:
        """The plan as the workers take it, with what each feature adds to the step."""
        finished_req_ids, self.finished_req_ids = sorted(self.finished_req_ids), set()
        grammar_req_ids, grammar_bitmask = (
            grammar_bitmask_of(plan, self.requests, self.structured_output_manager)
            if self.live.num_grammars
            else ([], b"")
        )
        return make_scheduler_output(
            plan,
            self.kv_cache_manager,
            finished_req_ids,
            grammar_req_ids,
            grammar_bitmask,
            SpecDecodeScheduler.make_metadata(plan),
            self.kv_connector.build_connector_meta(plan) if self.kv_connector else b"",
            forced_tokens_of(plan, self.requests) if self.live.num_thinking_budgets else None,
            has_pooling=self.live.num_pooling > 0,
        )

    def _advance(self, plan: StepPlan) -> None:
        """Count the scheduled tokens as computed: their K/V is being written."""
        now_ns = time.time_ns() if self.live.num_traced else 0
        for req_id, num_tokens in plan.num_scheduled_tokens.items():
            request = self.requests[req_id]
            if request.trace is not None:
                request.trace.scheduled(
                    now_ns, request.num_computed_tokens, num_tokens, request.num_prompt_tokens
                )
            request.num_computed_tokens += num_tokens
            if request.mm_inputs:
                self.encoder.release_computed(request)

    def _schedule_running(self, plan: StepPlan, requests: list[Request]) -> None:
        """Schedule `requests` (running ones) in their order, preempting others for blocks."""
        # Iterate over a snapshot: preemption removes requests from self.running.
        for request in list(requests):
            if plan.token_budget <= 0:
                break
            if request.status != RequestStatus.RUNNING:
                continue  # preempted earlier in this loop
            num_new_tokens = self._num_tokens_to_schedule(
                request, request.num_computed_tokens, plan.budget_for_running(request)
            )
            if num_new_tokens == 0:
                continue
            draft_token_ids: list[int] = []
            if self.spec_decode is not None:
                # Drafts follow the request's last token: verified in this step's forward.
                draft_token_ids = self.spec_decode.drafts_to_verify(
                    request, plan.token_budget - num_new_tokens
                )
                num_new_tokens += len(draft_token_ids)
            new_blocks = self._allocate_or_preempt(request, num_new_tokens, plan)
            if new_blocks is None:
                break  # the cache is full: the request itself was preempted
            self._plan_add(plan, request, num_new_tokens, new_blocks)
            plan.took_running(request, num_new_tokens)
            if draft_token_ids:
                plan.spec_token_ids[request.req_id] = draft_token_ids

    def _schedule_waiting(
        self, plan: StepPlan, admits: Callable[[Request], bool] | None = None
    ) -> None:
        """Admit waiting requests while budget, seats and blocks last, and while `admits`
        (the policy's Round.admits) accepts the queue's head."""
        # Requests whose adapter would be one too many wait, in their order, for the next step.
        skipped: list[Request] = []
        try:
            self._admit_waiting(plan, skipped, admits)
        finally:
            for request in reversed(skipped):
                self.waiting.prepend_request(request)

    def _admit_waiting(
        self, plan: StepPlan, skipped: list[Request], admits: Callable[[Request], bool] | None
    ) -> None:
        config = self.scheduler_config
        lora_ids = self._running_lora_ids()
        while self.waiting and plan.token_budget > 0 and len(self.running) < config.max_num_seqs:
            request = self.waiting.peek_request()
            if admits is not None and not admits(request):
                break
            if request.kv_loaded and request.num_computed_tokens > 0:
                if not admit_loaded(self, request, plan, lora_ids):
                    break
                continue
            assert request.num_computed_tokens == 0, f"{request} waits with computed tokens"
            if self._lora_blocked(request, lora_ids):
                skipped.append(self.waiting.pop_request())
                continue
            hit_blocks, num_hit_tokens = self.kv_cache_manager.get_computed_blocks(request)
            if self.kv_connector is not None and park_for_load(
                self, request, hit_blocks, num_hit_tokens
            ):
                continue
            if (
                not config.enable_chunked_prefill
                and request.num_tokens - num_hit_tokens > plan.token_budget
            ):
                break  # no partial prefill: wait for a step with room for all of it
            num_new_tokens = self._num_tokens_to_schedule(
                request, num_hit_tokens, plan.token_budget
            )
            if num_new_tokens == 0:
                break  # its next image waits for the encoder budget of a later step
            new_blocks = self.kv_cache_manager.allocate_slots(
                request, num_new_tokens, num_hit_tokens, hit_blocks
            )
            if new_blocks is None:
                # Waiting requests never preempt running ones; pins yield only when nothing
                # runs, which would otherwise leave the request waiting forever.
                if not self.running and self.pins is not None and self.pins.yield_oldest():
                    continue
                break
            self.waiting.pop_request()
            self.running.append(request)
            request.status = RequestStatus.RUNNING
            request.num_computed_tokens = num_hit_tokens
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_hit_tokens
            self._plan_add(plan, request, num_new_tokens, new_blocks)
            plan.scheduled_new.append(request)
            if request.lora_int_id:
                lora_ids.add(request.lora_int_id)

    def _plan_add(
        self, plan: StepPlan, request: Request, num_new_tokens: int, new_blocks: list[KVCacheBlock]
    ) -> None:
        """Schedule `num_new_tokens` of `request` in this step (its tenant is charged)."""
        plan.add(request, num_new_tokens, new_blocks)
        if request.mm_inputs:
            encoded = self.encoder.commit(request)
            if encoded:
                plan.encoder_inputs[request.req_id] = encoded
        self.policy.on_tokens_scheduled(request, num_new_tokens)

    def _running_lora_ids(self) -> set[int]:
        """The adapters of the running requests (the ones the workers hold)."""
        if self.lora_config is None:
            return set()
        return {r.lora_int_id for r in self.running if r.lora_int_id}

    def _lora_blocked(self, request: Request, lora_ids: set[int]) -> bool:
        """Admitting `request` would put more than max_loras adapters in the batch."""
        return (
            self.lora_config is not None
            and request.lora_int_id != 0
            and request.lora_int_id not in lora_ids
            and len(lora_ids) >= self.lora_config.max_loras
        )

    def _num_tokens_to_schedule(
        self, request: Request, num_computed_tokens: int, token_budget: int
    ) -> int:
        num_new_tokens = request.num_tokens - num_computed_tokens
        threshold = self.scheduler_config.long_prefill_token_threshold
        if threshold > 0 and self.scheduler_config.enable_chunked_prefill:
            num_new_tokens = min(num_new_tokens, threshold)
        num_new_tokens = min(num_new_tokens, token_budget)
        if request.mm_inputs:  # cut before an image the encoder cannot run in this step
            num_new_tokens = self.encoder.fit(request, num_computed_tokens, num_new_tokens)
        return num_new_tokens

    def _allocate_or_preempt(
        self, request: Request, num_new_tokens: int, plan: StepPlan
    ) -> list[KVCacheBlock] | None:
        """Allocate for a running request, preempting others until it fits.

        Returns:
            The new blocks, or None if `request` itself had to be preempted.
        """
        while True:
            new_blocks = self.kv_cache_manager.allocate_slots(request, num_new_tokens)
            if new_blocks is not None:
                return new_blocks
            if self.pins is not None and self.pins.yield_oldest():
                continue  # pins yield before any request is preempted
            victim = self.policy.pick_preemption_victim(self.running)
            self._preempt(victim, plan)
            if victim is request:
                return None

    def _preempt(self, request: Request, plan: StepPlan) -> None:
        """Free a running request's blocks and queue it to recompute from scratch."""
        self.running.remove(request)
        plan.undo(request)
        self.kv_cache_manager.free(request)
        self.encoder.free(request)
        request.preempt()
        self.waiting.prepend_request(request)
        plan.preempted.append(request)
        self.num_preemptions_total += 1
        self._num_step_preemptions += 1
        logger.info(
            "request %s preempted (KV cache full); it will recompute %d tokens",
            request.req_id,
            request.num_tokens,
        )

    def record_step_time(self, scheduler_output: SchedulerOutput, seconds: float) -> None:
        """How long a step took from schedule to outputs (the step-time model's and adaptive
        speculation's input)."""
        self.latency.record_step(scheduler_output, seconds, self.has_requests())
        if self.spec_decode is not None:
            self.spec_decode.record_step_time(scheduler_output, seconds)

    # ------------------------------------------------------------------ outputs back

    def update_from_output(
        self, scheduler_output: SchedulerOutput, model_runner_output: ModelRunnerOutput
    ) -> list[EngineCoreOutput]:
        """Append the sampled tokens, finish stopped requests and make the step's outputs.

        Args:
            scheduler_output: the plan that produced `model_runner_output`.
            model_runner_output: rank 0's sampled tokens and logprobs for that plan.

        Returns:
            One output per request that gained tokens or prompt logprobs or finished, plus
            the error outputs of requests rejected since the last call.
        """
        outputs, self._pending_outputs = self._pending_outputs, []
        if self.kv_connector is not None:
            finish_loads(
                self,
                self.kv_connector.update_from_output(
                    scheduler_output.kv_connector_metadata,
                    model_runner_output.kv_connector_output,
                ),
            )
        row_of = {req_id: row for row, req_id in enumerate(model_runner_output.req_ids)}
        stopped = []
        now_ns = time.time_ns() if self.live.num_traced else 0
        for req_id in scheduler_output.num_scheduled_tokens:
            request = self.requests.get(req_id)
            if request is None or request.status != RequestStatus.RUNNING:
                continue  # aborted (or preempted) while the step ran
            if request.trace is not None:
                request.trace.step_done(now_ns)
            output = take_step_output(
                request,
                row_of.get(req_id),
                scheduler_output,
                model_runner_output,
                self.spec_decode,
                self.max_model_len,
            )
            if output is not None:
                outputs.append(output)
            if request.is_finished:
                stopped.append(request)
        if stopped:
            stopped_ids = {request.req_id for request in stopped}
            self.running = [r for r in self.running if r.req_id not in stopped_ids]
            for request in stopped:
                self._free_request(request)
        return outputs

    # ------------------------------------------------------------------ state and stats

    def get_num_unfinished_requests(self) -> int:
        return (
            len(self.waiting_for_grammar)
            + len(self.waiting_for_remote_kvs)
            + len(self.waiting)
            + len(self.running)
        )

    def has_unfinished_requests(self) -> bool:
        return self.get_num_unfinished_requests() > 0

    def has_requests(self) -> bool:
        """True while a step is needed: unfinished requests, or finished ids and error
        outputs not yet delivered (such a step may schedule zero tokens)."""
        return (
            self.has_unfinished_requests()
            or bool(self.finished_req_ids)
            or bool(self._pending_outputs)
        )

    def only_waiting_for_grammars(self) -> bool:
        """Every unfinished request waits for its grammar, and nothing else is to be done:
        the engine may block on the compiles instead of stepping idle."""
        return bool(self.waiting_for_grammar) and not (
            self.waiting or self.running or self.finished_req_ids or self._pending_outputs
        )

    def pending_grammar_futures(self) -> list[Future[Any]]:
        """The compiles the waiting_for_grammar requests wait for."""
        return [
            r.structured_output.future
            for r in self.waiting_for_grammar.values()
            if r.structured_output is not None
        ]

    def reset_prefix_cache(self) -> bool:
        """Forget all cached prefixes (pins too); False (nothing done) while requests hold
        blocks."""
        if self.pins is not None and not self.requests:
            self.pins.release_all()
        return self.kv_cache_manager.reset_prefix_cache()

    def make_stats(self) -> SchedulerStats | None:
        """This step's load and counters (the counters then restart); None without log_stats."""
        if not self.log_stats:
            return None
        num_preemptions, self._num_step_preemptions = self._num_step_preemptions, 0
        num_scheduled_tokens, self._num_step_scheduled_tokens = self._num_step_scheduled_tokens, 0
        return make_scheduler_stats(self, num_preemptions, num_scheduled_tokens)
