"""The scheduler: each step, which requests compute how many tokens, in which KV blocks.

There are no prefill and decode phases. A request has `num_computed_tokens` and `num_tokens`,
and each step spends a token budget: running requests first (in order, preempting from the
tail when the cache is full), then waiting requests (after a prefix-cache lookup), chunking
long prompts. One `schedule()` makes a `SchedulerOutput`, a diff against the workers' state;
`update_from_output()` takes the sampled tokens back and checks the stop conditions.

A structured-output request first waits in `waiting_for_grammar` while its grammar compiles
on the StructuredOutputManager's threads; each step's SchedulerOutput carries the bitmask of
the grammars that sample in it, and their matchers advance on the sampled tokens.

`num_computed_tokens` advances when a step is scheduled (its K/V is then being written), not
when its output returns, so state stays consistent even if two schedules run back to back.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from concurrent.futures import Future
from typing import Any

from kvserve.services.kv_store.connector import SchedulerConnector
from kvserve.services.scheduler.core.block_pool import KVCacheBlock
from kvserve.services.scheduler.core.kv_cache_manager import KVCacheManager
from kvserve.services.scheduler.core.request import (
    Request,
    RequestStatus,
    StructuredOutputState,
    make_block_hasher,
)
from kvserve.services.scheduler.core.request_queue import create_request_queue
from kvserve.services.scheduler.core.spec_decode import SpecDecodePolicy, SpecRequestState
from kvserve.services.scheduler.core.step_plan import StepPlan
from kvserve.services.scheduler.core.stop_check import check_stop
from kvserve.services.scheduler.structured_output.manager import StructuredOutputManager
from kvserve.shared.config import CacheConfig, LoRAConfig, SchedulerConfig, SpeculativeConfig
from kvserve.shared.hashing import get_hash_fn
from kvserve.shared.logging import init_logger
from kvserve.shared.lora import read_adapter_config
from kvserve.shared.messages import (
    CachedRequestData,
    EngineCoreEventType,
    EngineCoreOutput,
    EngineCoreRequest,
    FinishReason,
    KVBlockTransfer,
    Logprobs,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
    SchedulerStats,
)

logger = init_logger(__name__)

_MAX_TOKEN_ID = 2**31 - 1


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
        structured_output_manager: compiles grammars; None refuses structured requests.
        lora_config: with enable_lora, requests may name adapters, and the running requests
            use max_loras distinct adapters at most (the others wait); else LoRA requests
            are refused.
        speculative_config: speculative decoding (None: off). Each decoding request's drafts
            from the last step are scheduled as extra query tokens; the ones the target
            rejects are rolled back (num_computed_tokens and the KV slots they wrote).
        step_costs: (query tokens, seconds) of a forward, measured by the workers; the
            adaptive speculation rule (spec_decode.py) weighs drafts against them.
        kv_connector: the KV connector's scheduler half (services/kv_store/connector.py):
            external prefix hits load before their request computes, a producer saves
            the full blocks it computes, the offload tier saves evicted prefix blocks.
    """

    def __init__(
        self,
        scheduler_config: SchedulerConfig,
        cache_config: CacheConfig,
        num_blocks: int,
        max_model_len: int,
        log_stats: bool = True,
        structured_output_manager: StructuredOutputManager | None = None,
        lora_config: LoRAConfig | None = None,
        speculative_config: SpeculativeConfig | None = None,
        step_costs: list[tuple[int, float]] | None = None,
        kv_connector: SchedulerConnector | None = None,
    ) -> None:
        self.scheduler_config = scheduler_config
        self.speculative_config = speculative_config
        self.spec_policy = (
            SpecDecodePolicy(speculative_config, step_costs or [])
            if speculative_config is not None
            else None
        )
        self._spec_stats = _SpecStats(
            speculative_config.num_speculative_tokens if speculative_config else 0
        )
        self.lora_config = lora_config if lora_config and lora_config.enable_lora else None
        # (adapter id, path) -> why it cannot run (None: it can); read once per adapter.
        self._lora_errors: dict[tuple[int, str], str | None] = {}
        self.structured_output_manager = structured_output_manager
        self.cache_config = cache_config
        self.max_model_len = max_model_len
        self.log_stats = log_stats
        self._fit_max_model_len_to_cache(num_blocks)
        self._check_config()

        block_size = cache_config.block_size
        self.kv_cache_manager = KVCacheManager(
            num_blocks, block_size, cache_config.enable_prefix_caching, self.max_model_len
        )
        self.block_hasher = None
        if cache_config.enable_prefix_caching:
            hash_fn = get_hash_fn(cache_config.prefix_caching_hash_algo)
            self.block_hasher = make_block_hasher(block_size, hash_fn)

        self.kv_connector = kv_connector
        self._kv_stats = _KVStats()
        if kv_connector is not None and kv_connector.saves_evicted:
            self.kv_cache_manager.block_pool.evicted = []
        self.requests: dict[str, Request] = {}
        self.waiting = create_request_queue(scheduler_config.scheduling_policy)
        self.running: list[Request] = []
        # Structured-output requests whose grammar is compiling, in arrival order.
        self.waiting_for_grammar: dict[str, Request] = {}
        # Requests whose external prefix blocks load in the step in flight.
        self.waiting_for_remote_kvs: dict[str, Request] = {}
        self._num_live_grammars = 0  # requests holding a matcher (bitmask work to do)
        # Finished or aborted since the last schedule(): the workers drop their state.
        self.finished_req_ids: set[str] = set()
        # Outputs not tied to a step (rejected requests), sent with the next step's outputs.
        self._pending_outputs: list[EngineCoreOutput] = []
        self.num_preemptions_total = 0
        self._num_step_preemptions = 0
        self._num_step_scheduled_tokens = 0

    def _check_config(self) -> None:
        config = self.scheduler_config
        if not config.enable_chunked_prefill and config.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"max_num_batched_tokens ({config.max_num_batched_tokens}) is smaller than "
                f"max_model_len ({self.max_model_len}), so a long prompt could never be "
                f"scheduled without chunked prefill: raise max_num_batched_tokens, lower "
                f"max_model_len, or enable chunked prefill"
            )

    def _fit_max_model_len_to_cache(self, num_blocks: int) -> None:
        # A request longer than the whole cache would preempt itself forever: cap lengths.
        num_cache_tokens = (num_blocks - 1) * self.cache_config.block_size
        if num_cache_tokens < self.max_model_len:
            logger.warning(
                "the KV cache holds only %d tokens: capping max_model_len %d to it",
                num_cache_tokens,
                self.max_model_len,
            )
            self.max_model_len = num_cache_tokens

    # ------------------------------------------------------------------ requests in

    def add_request(self, engine_request: EngineCoreRequest) -> None:
        """Queue a request; a bad one gets an ERROR output (next `update_from_output`)."""
        try:
            error = self._validate(engine_request)
            if error is None:
                request = Request.from_engine_core_request(engine_request, self.block_hasher)
        except Exception as exc:  # noqa: BLE001 - a bad request must never stop the engine
            error = f"invalid request: {exc}"
        if error is not None:
            logger.warning("request %s rejected: %s", engine_request.request_id, error)
            self._pending_outputs.append(
                EngineCoreOutput(
                    request_id=engine_request.request_id,
                    new_token_ids=[],
                    finish_reason=FinishReason.ERROR,
                    error=error,
                )
            )
            return
        self.requests[request.req_id] = request
        params = request.sampling_params.structured_outputs
        if self.spec_policy is not None and params is None:
            # Structured-output requests never speculate: each draft would need the
            # grammar's bitmask at its own position.
            request.spec = SpecRequestState()
        if params is not None and self.structured_output_manager is not None:
            future = self.structured_output_manager.compile(params)
            request.structured_output = StructuredOutputState(future)
            request.status = RequestStatus.WAITING_FOR_GRAMMAR
            self.waiting_for_grammar[request.req_id] = request
        else:
            self.waiting.add_request(request)
        if self.log_stats:
            request.record_event(EngineCoreEventType.QUEUED, time.monotonic())

    def _validate(self, engine_request: EngineCoreRequest) -> str | None:
        prompt_token_ids = engine_request.prompt_token_ids
        if engine_request.request_id in self.requests:
            return f"request id {engine_request.request_id!r} is already in use"
        if not prompt_token_ids:
            return "the prompt is empty; send at least one token"
        if len(prompt_token_ids) >= self.max_model_len:
            return (
                f"the prompt has {len(prompt_token_ids)} tokens but max_model_len is "
                f"{self.max_model_len}; shorten it to at most {self.max_model_len - 1} "
                f"tokens so that at least one can be generated"
            )
        if min(prompt_token_ids) < 0 or max(prompt_token_ids) > _MAX_TOKEN_ID:
            return f"prompt token ids must be in [0, {_MAX_TOKEN_ID}]"
        params = engine_request.sampling_params
        if params.structured_outputs is not None and self.structured_output_manager is None:
            return "structured outputs are not enabled in this engine"
        if engine_request.lora_request is not None:
            return self._check_lora(engine_request)
        return None

    def _check_lora(self, engine_request: EngineCoreRequest) -> str | None:
        lora_request = engine_request.lora_request
        assert lora_request is not None
        if self.lora_config is None:
            return "LoRA adapters are not enabled in this engine (start it with enable_lora)"
        key = (lora_request.lora_int_id, lora_request.lora_path)
        if key not in self._lora_errors:
            try:
                read_adapter_config(lora_request.lora_path, self.lora_config.max_lora_rank)
                self._lora_errors[key] = None
            except ValueError as exc:
                self._lora_errors[key] = str(exc)
        return self._lora_errors[key]

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
        if request.structured_output is not None and request.structured_output.grammar:
            request.structured_output.grammar = None
            self._num_live_grammars -= 1
        self.kv_cache_manager.free(request)
        self.finished_req_ids.add(request.req_id)
        del self.requests[request.req_id]

    # ------------------------------------------------------------------ schedule

    def schedule(self) -> SchedulerOutput:
        """Plan one step: running requests first, then waiting ones if nothing was preempted."""
        if self.waiting_for_grammar:
            self._admit_compiled_grammars()
        plan = StepPlan(token_budget=self.scheduler_config.max_num_batched_tokens)
        self._schedule_running(plan)
        # A step that had to preempt is short of blocks: admitting more would thrash.
        if not plan.preempted:
            self._schedule_waiting(plan)
        if self.spec_policy is not None:
            self._plan_proposals(plan)
        if self.kv_connector is not None:
            self._plan_kv_saves(plan)
        scheduler_output = self._make_scheduler_output(plan)
        for req_id, num_tokens in plan.num_scheduled_tokens.items():
            self.requests[req_id].num_computed_tokens += num_tokens
        if self.log_stats:
            self._record_step_events(plan)
            self._num_step_scheduled_tokens += scheduler_output.total_num_scheduled_tokens
        return scheduler_output

    def _admit_compiled_grammars(self) -> None:
        """Requests whose grammar compiled join the waiting queue; a failed compile ends its
        request with the compile's error (the api answers it as a 400)."""
        manager = self.structured_output_manager
        assert manager is not None, "only a manager's compiles wait here"
        for request in list(self.waiting_for_grammar.values()):
            state = request.structured_output
            assert state is not None, f"{request} waits for a grammar it does not have"
            if not state.future.done():
                continue
            del self.waiting_for_grammar[request.req_id]
            try:
                state.grammar = manager.make_grammar(state.future)
            except Exception as exc:  # noqa: BLE001 - a bad grammar costs its request only
                self._fail_request(request, str(exc))
                continue
            self._num_live_grammars += 1
            request.status = RequestStatus.WAITING
            self.waiting.add_request(request)

    def _fail_request(self, request: Request, error: str) -> None:
        """End a request that never ran with an ERROR output (sent with the next outputs)."""
        logger.warning("request %s failed: %s", request.req_id, error)
        request.status = RequestStatus.FINISHED_ERROR
        self._pending_outputs.append(
            EngineCoreOutput(
                request_id=request.req_id,
                new_token_ids=[],
                finish_reason=FinishReason.ERROR,
                error=error,
            )
        )
        self._free_request(request)

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

    @staticmethod
    def _record_step_events(plan: StepPlan) -> None:
        # One timestamp for the whole step: its requests start computing together.
        now = time.monotonic()
        for request in plan.scheduled_new:
            request.record_event(EngineCoreEventType.SCHEDULED, now)
        for request in plan.preempted:
            request.record_event(EngineCoreEventType.PREEMPTED, now)

    def _schedule_running(self, plan: StepPlan) -> None:
        # Iterate over a snapshot: preemption removes requests from self.running.
        for request in list(self.running):
            if plan.token_budget <= 0:
                break
            if request.status != RequestStatus.RUNNING:
                continue  # preempted earlier in this loop
            num_new_tokens = self._num_tokens_to_schedule(
                request, request.num_computed_tokens, plan.token_budget
            )
            if num_new_tokens == 0:
                continue
            draft_token_ids: list[int] = []
            if (
                request.spec is not None
                and request.spec.draft_token_ids
                and request.num_computed_tokens == request.num_tokens - 1
            ):
                # Drafts follow the request's last token: verified in this step's forward.
                draft_token_ids = request.spec.draft_token_ids[
                    : self._max_drafts(request, plan.token_budget - num_new_tokens)
                ]
                num_new_tokens += len(draft_token_ids)
            new_blocks = self._allocate_or_preempt(request, num_new_tokens, plan)
            if new_blocks is None:
                break  # the request itself was preempted: the cache is full
            plan.add(request, num_new_tokens, new_blocks)
            plan.scheduled_running.append(request)
            if draft_token_ids:
                plan.spec_token_ids[request.req_id] = draft_token_ids

    def _schedule_waiting(self, plan: StepPlan) -> None:
        # Requests whose adapter would be one too many wait, in their order, for the next step.
        skipped: list[Request] = []
        try:
            self._admit_waiting(plan, skipped)
        finally:
            for request in reversed(skipped):
                self.waiting.prepend_request(request)

    def _admit_waiting(self, plan: StepPlan, skipped: list[Request]) -> None:
        config = self.scheduler_config
        lora_ids = self._running_lora_ids()
        while self.waiting and plan.token_budget > 0 and len(self.running) < config.max_num_seqs:
            request = self.waiting.peek_request()
            if request.kv_loaded and request.num_computed_tokens > 0:
                if not self._admit_loaded(request, plan, lora_ids):
                    break
                continue
            assert request.num_computed_tokens == 0, f"{request} waits with computed tokens"
            if self._lora_blocked(request, lora_ids):
                skipped.append(self.waiting.pop_request())
                continue
            hit_blocks, num_hit_tokens = self.kv_cache_manager.get_computed_blocks(request)
            if self.kv_connector is not None and self._start_kv_load(
                request, hit_blocks, num_hit_tokens, plan
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
            new_blocks = self.kv_cache_manager.allocate_slots(
                request, num_new_tokens, num_hit_tokens, hit_blocks
            )
            if new_blocks is None:
                break  # waiting requests never preempt running ones
            self.waiting.pop_request()
            self.running.append(request)
            request.status = RequestStatus.RUNNING
            request.num_computed_tokens = num_hit_tokens
            request.num_saved_blocks = max(
                request.num_saved_blocks, num_hit_tokens // self.cache_config.block_size
            )
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_hit_tokens
            plan.add(request, num_new_tokens, new_blocks)
            plan.scheduled_new.append(request)
            if request.lora_int_id:
                lora_ids.add(request.lora_int_id)

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
        return min(num_new_tokens, token_budget)

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
            victim = self._pick_preemption_victim()
            self._preempt(victim, plan)
            if victim is request:
                return None

    def _pick_preemption_victim(self) -> Request:
        if self.scheduler_config.scheduling_policy == "priority":
            # Largest (priority, arrival_time): least important, then latest; on exact ties
            # the last admitted (max keeps the first maximum it meets).
            return max(reversed(self.running), key=lambda r: (r.priority, r.arrival_time))
        return self.running[-1]

    def _preempt(self, request: Request, plan: StepPlan) -> None:
        """Free a running request's blocks and queue it to recompute from scratch."""
        self.running.remove(request)
        plan.undo(request)
        self.kv_cache_manager.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.kv_loaded = False
        if request.spec is not None:
            request.spec.draft_token_ids = []
        request.num_preemptions += 1
        request.num_prompt_logprobs_seen = 0
        self.waiting.prepend_request(request)
        plan.preempted.append(request)
        self.num_preemptions_total += 1
        self._num_step_preemptions += 1
        logger.info(
            "request %s preempted (KV cache full); it will recompute %d tokens",
            request.req_id,
            request.num_tokens,
        )

    def _make_scheduler_output(self, plan: StepPlan) -> SchedulerOutput:
        # Built before num_computed_tokens advances: the workers get pre-step values.
        new_reqs = [
            NewRequestData(
                req_id=request.req_id,
                prompt_token_ids=request.prompt_token_ids,
                sampling_params=request.sampling_params,
                block_ids=self.kv_cache_manager.get_block_ids(request.req_id),
                num_computed_tokens=request.num_computed_tokens,
                output_token_ids=list(request.output_token_ids),
                eos_token_id=None if request.sampling_params.ignore_eos else request.eos_token_id,
                lora_request=request.lora_request,
            )
            for request in plan.scheduled_new
        ]
        cached_reqs = CachedRequestData(
            req_ids=[request.req_id for request in plan.scheduled_running],
            new_block_ids=[
                plan.new_block_ids[request.req_id] for request in plan.scheduled_running
            ],
            num_computed_tokens=[request.num_computed_tokens for request in plan.scheduled_running],
        )
        finished_req_ids, self.finished_req_ids = sorted(self.finished_req_ids), set()
        grammar_req_ids, grammar_bitmask = self._grammar_bitmask(plan)
        return SchedulerOutput(
            scheduled_new_reqs=new_reqs,
            scheduled_cached_reqs=cached_reqs,
            num_scheduled_tokens=plan.num_scheduled_tokens,
            total_num_scheduled_tokens=sum(plan.num_scheduled_tokens.values()),
            finished_req_ids=finished_req_ids,
            preempted_req_ids=[request.req_id for request in plan.preempted],
            grammar_req_ids=grammar_req_ids,
            grammar_bitmask=grammar_bitmask,
            scheduled_spec_decode_tokens=plan.spec_token_ids,
            kv_saves_before=plan.kv_saves_before,
            kv_loads=plan.kv_loads,
            kv_saves=plan.kv_saves,
            num_spec_tokens_to_propose={
                req_id: n
                for req_id, n in plan.num_spec_tokens_to_propose.items()
                if req_id in plan.num_scheduled_tokens
            },
        )

    def _grammar_bitmask(self, plan: StepPlan) -> tuple[list[str], bytes]:
        """The requests that sample under a grammar in this step (their scheduled tokens
        reach the end of what they hold), and the bitmask of their next tokens."""
        if not self._num_live_grammars:
            return [], b""
        req_ids, grammars = [], []
        for req_id, num_tokens in plan.num_scheduled_tokens.items():
            request = self.requests[req_id]
            state = request.structured_output
            if state is None or state.grammar is None:
                continue
            if request.num_computed_tokens + num_tokens >= request.num_tokens:
                req_ids.append(req_id)
                grammars.append(state.grammar)
        if not grammars:
            return [], b""
        assert self.structured_output_manager is not None, "grammars come from the manager"
        return req_ids, self.structured_output_manager.grammar_bitmask(grammars)

    # ------------------------------------------------------------------ KV connector

    def _start_kv_load(
        self, request: Request, hit_blocks: list[KVCacheBlock], num_hit_tokens: int, plan: StepPlan
    ) -> bool:
        """Ask the store for the request's full blocks past its local hits; when it holds
        some, give the request their slots (not yet in the prefix cache), list the load in
        this step and park the request until its blocks arrive. True when parked."""
        connector = self.kv_connector
        assert connector is not None
        if request.skip_reading_prefix_cache or request.kv_loaded:
            return False
        block_size = self.cache_config.block_size
        max_blocks = (request.num_tokens - 1) // block_size
        num_local = len(hit_blocks)
        if self.log_stats and connector.loads_external:
            self._kv_stats.queries += request.num_tokens
        num_external = connector.num_external_blocks(request.block_hashes[:max_blocks], num_local)
        if num_external <= 0:
            return False
        new_blocks = self.kv_cache_manager.allocate_slots(
            request,
            num_external * block_size,
            num_hit_tokens,
            hit_blocks,
            cache_new_blocks=False,
        )
        if new_blocks is None:
            return False  # no room to load into: compute it as usual
        self.waiting.pop_request()
        request.status = RequestStatus.WAITING_FOR_REMOTE_KVS
        request.num_computed_tokens = num_hit_tokens
        request.num_external_blocks = num_external
        self.waiting_for_remote_kvs[request.req_id] = request
        block_ids = self.kv_cache_manager.get_block_ids(request.req_id)
        plan.kv_loads.append(
            KVBlockTransfer(
                request.req_id,
                request.block_hashes[num_local : num_local + num_external],
                block_ids[num_local : num_local + num_external],
            )
        )
        return True

    def _finish_kv_loads(self, kv_loaded: dict[str, int]) -> None:
        """Loaded blocks count as computed (and enter the prefix cache); what did not load is
        recomputed. The request goes back to the head of the queue, holding its blocks."""
        block_size = self.cache_config.block_size
        for req_id, num_loaded in kv_loaded.items():
            request = self.waiting_for_remote_kvs.pop(req_id, None)
            if request is None:
                continue  # aborted while loading
            num_loaded = min(num_loaded, request.num_external_blocks)
            if num_loaded < request.num_external_blocks:
                logger.warning(
                    "request %s: %d of %d external blocks loaded; recomputing the rest",
                    req_id,
                    num_loaded,
                    request.num_external_blocks,
                )
            request.num_computed_tokens += num_loaded * block_size
            request.num_saved_blocks = request.num_computed_tokens // block_size
            self.kv_cache_manager.cache_blocks(request, request.num_computed_tokens)
            request.kv_loaded = True
            request.status = RequestStatus.WAITING
            if self.log_stats:
                self._kv_stats.hits += num_loaded * block_size
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = request.num_computed_tokens
            self.waiting.prepend_request(request)

    def _admit_loaded(self, request: Request, plan: StepPlan, lora_ids: set[int]) -> bool:
        """Schedule a request whose prefix loaded: it holds its blocks already. False when it
        cannot run in this step (it stays at the head of the queue)."""
        if self._lora_blocked(request, lora_ids):
            return False
        num_new_tokens = self._num_tokens_to_schedule(
            request, request.num_computed_tokens, plan.token_budget
        )
        new_blocks = self.kv_cache_manager.allocate_slots(request, num_new_tokens)
        if new_blocks is None:
            return False
        self.waiting.pop_request()
        self.running.append(request)
        request.status = RequestStatus.RUNNING
        plan.add(request, num_new_tokens, new_blocks)
        plan.scheduled_new.append(request)
        if request.lora_int_id:
            lora_ids.add(request.lora_int_id)
        return True

    def _plan_kv_saves(self, plan: StepPlan) -> None:
        """What the workers copy to the store: the offload tier's evicted prefix blocks
        (before the forward rewrites them), and a producer's full blocks that this step
        completes (after the forward, once each)."""
        connector = self.kv_connector
        assert connector is not None
        pool = self.kv_cache_manager.block_pool
        if pool.evicted:
            plan.kv_saves_before.append(
                KVBlockTransfer(
                    "", [h for h, _ in pool.evicted], [block_id for _, block_id in pool.evicted]
                )
            )
            pool.evicted.clear()
        if not connector.saves_computed:
            return
        block_size = self.cache_config.block_size
        for request in (*plan.scheduled_running, *plan.scheduled_new):
            num_scheduled = plan.num_scheduled_tokens[request.req_id]
            num_full = min(
                (request.num_computed_tokens + num_scheduled) // block_size,
                len(request.block_hashes),
            )
            if num_full <= request.num_saved_blocks:
                continue
            block_ids = self.kv_cache_manager.get_block_ids(request.req_id)
            first = request.num_saved_blocks
            plan.kv_saves.append(
                KVBlockTransfer(
                    request.req_id,
                    request.block_hashes[first:num_full],
                    block_ids[first:num_full],
                )
            )
            request.num_saved_blocks = num_full

    # ------------------------------------------------------------------ speculative decoding

    def record_step_time(self, scheduler_output: SchedulerOutput, seconds: float) -> None:
        """How long a step took from schedule to outputs (the adaptive speculation rule
        compares it with its cost model)."""
        if self.spec_policy is not None:
            self.spec_policy.record_step(
                scheduler_output.total_num_scheduled_tokens,
                seconds,
                bool(scheduler_output.scheduled_spec_decode_tokens),
            )

    def _plan_proposals(self, plan: StepPlan) -> None:
        """How many drafts each request that samples in this step proposes after it (the
        adaptive rule of spec_decode.py, over this step's batch); for a draft model, the
        lookahead slots its guesses write, when the pool has them (the proposer guesses
        only as far as the request's slots reach)."""
        assert self.spec_policy is not None and self.speculative_config is not None
        sampling = []
        for request in (*plan.scheduled_running, *plan.scheduled_new):
            num_scheduled = plan.num_scheduled_tokens[request.req_id]
            if request.spec is not None and (
                request.num_computed_tokens + num_scheduled >= request.num_tokens
            ):
                sampling.append(request)
        if not sampling:
            return
        caps = []
        for request in sampling:
            # After this step the request holds at most num_tokens + drafts + 1 tokens; the
            # next step verifies the new drafts after those.
            num_drafts = len(plan.spec_token_ids.get(request.req_id, ()))
            caps.append(self._max_drafts_after(request, request.num_tokens + num_drafts + 1))
        states = [r.spec for r in sampling if r.spec is not None]
        counts = self.spec_policy.num_to_propose(states, caps, len(self.running))
        lookahead = self.speculative_config.uses_lookahead_slots
        for request, count in zip(sampling, counts):
            if count <= 0:
                continue
            plan.num_spec_tokens_to_propose[request.req_id] = count
            if lookahead:
                num_scheduled = plan.num_scheduled_tokens[request.req_id]
                extra = self.kv_cache_manager.allocate_slots(
                    request, num_scheduled, num_lookahead_tokens=count
                )
                if extra and request.req_id in plan.new_block_ids:
                    plan.new_block_ids[request.req_id].extend(b.block_id for b in extra)

    def _max_drafts(self, request: Request, token_budget: int) -> int:
        """Drafts a decoding request may verify now: the step's budget, max_model_len and
        max_tokens bound them (a draft past the last allowed token is wasted work)."""
        return max(0, min(token_budget, self._max_drafts_after(request, request.num_tokens)))

    def _max_drafts_after(self, request: Request, num_tokens: int) -> int:
        """Drafts that may follow `num_tokens` tokens of `request`: each needs a slot below
        max_model_len, and at most max_tokens - 1 of them can be emitted before the
        verifying step's own token ends the request."""
        num_slots = self.max_model_len - num_tokens
        max_tokens = request.max_tokens
        if max_tokens is not None:
            num_left = max_tokens - (request.num_output_tokens + num_tokens - request.num_tokens)
            num_slots = min(num_slots, num_left - 1)
        return max(0, num_slots)

    def _verify_drafts(
        self, request: Request, scheduler_output: SchedulerOutput, sampled_token_ids: list[int]
    ) -> None:
        """Roll back the rejected drafts: their K/V slots are rewritten by later steps, and
        num_computed_tokens counts only the verified tokens (whose hashes alone enter the
        prefix cache)."""
        assert request.spec is not None
        draft_token_ids = scheduler_output.scheduled_spec_decode_tokens.get(request.req_id)
        if not draft_token_ids:
            return
        num_drafts = len(draft_token_ids)
        # A verifying step emits the accepted drafts and one more token.
        num_accepted = max(len(sampled_token_ids) - 1, 0)
        request.num_computed_tokens -= num_drafts - num_accepted
        request.spec.record(num_drafts, num_accepted)
        if self.log_stats:
            self._spec_stats.add(num_drafts, num_accepted)

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
            self._kv_stats.add_step(model_runner_output)
            if model_runner_output.kv_loaded or scheduler_output.kv_loads:
                # Every listed load is answered; a missing answer means nothing loaded.
                loaded = {t.req_id: 0 for t in scheduler_output.kv_loads}
                loaded.update(model_runner_output.kv_loaded)
                self._finish_kv_loads(loaded)
        row_of = {req_id: row for row, req_id in enumerate(model_runner_output.req_ids)}
        stopped = []
        for req_id in scheduler_output.num_scheduled_tokens:
            request = self.requests.get(req_id)
            if request is None or request.status != RequestStatus.RUNNING:
                continue  # aborted (or preempted) while the step ran
            row = row_of.get(req_id)
            sampled_token_ids = (
                model_runner_output.sampled_token_ids[row] if row is not None else []
            )
            if request.spec is not None:
                self._verify_drafts(request, scheduler_output, sampled_token_ids)
                request.spec.draft_token_ids = model_runner_output.spec_token_ids.get(req_id, [])
            output = self._update_request(request, sampled_token_ids, model_runner_output)
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

    def _update_request(
        self, request: Request, sampled_token_ids: list[int], model_runner_output: ModelRunnerOutput
    ) -> EngineCoreOutput | None:
        assert not sampled_token_ids or request.num_computed_tokens >= request.num_tokens, (
            f"{request} got tokens sampled before its prompt was computed"
        )
        new_token_ids = []
        # Several tokens may arrive at once (speculative decoding): stop at the first that
        # ends the request and drop the rest.
        for token_id in sampled_token_ids:
            request.append_output_token_ids(token_id)
            new_token_ids.append(token_id)
            if request.structured_output is not None and not self._advance_grammar(
                request, token_id
            ):
                break
            if check_stop(request, self.max_model_len):
                break
            if request.structured_output is not None and self._grammar_complete(request):
                break
        logprobs = model_runner_output.logprobs.get(request.req_id)
        if logprobs is not None and len(logprobs.ranks) > len(new_token_ids):
            logprobs = _slice_logprobs(logprobs, 0, len(new_token_ids))
        prompt_logprobs = self._take_new_prompt_logprobs(
            request, model_runner_output.prompt_logprobs.get(request.req_id)
        )
        if not new_token_ids and prompt_logprobs is None and not request.is_finished:
            return None
        num_cached_tokens = 0
        if not request.sent_first_output:
            request.sent_first_output = True
            num_cached_tokens = max(request.num_cached_tokens, 0)
        return EngineCoreOutput(
            request_id=request.req_id,
            new_token_ids=new_token_ids,
            new_logprobs=logprobs if new_token_ids else None,
            new_prompt_logprobs=prompt_logprobs,
            finish_reason=request.get_finished_reason(),
            stop_reason=request.stop_reason,
            num_cached_tokens=num_cached_tokens,
            error=request.error,
            events=request.take_events(),
        )

    @staticmethod
    def _advance_grammar(request: Request, token_id: int) -> bool:
        """Move the request's matcher over its new token; False (the request failed) when
        the grammar forbids it, which the bitmask should have made impossible."""
        assert request.structured_output is not None and request.structured_output.grammar
        if request.structured_output.grammar.accept_tokens([token_id]):
            return True
        request.status = RequestStatus.FINISHED_ERROR
        request.error = f"sampled token {token_id} is not allowed by the request's grammar"
        logger.error("request %s: %s", request.req_id, request.error)
        return False

    @staticmethod
    def _grammar_complete(request: Request) -> bool:
        """A grammar that took its stop token ends the request (even with ignore_eos)."""
        assert request.structured_output is not None and request.structured_output.grammar
        if not request.structured_output.grammar.is_terminated:
            return False
        request.status = RequestStatus.FINISHED_STOPPED
        return True

    @staticmethod
    def _take_new_prompt_logprobs(
        request: Request, prompt_logprobs: Logprobs | None
    ) -> Logprobs | None:
        """Drop rows already sent before a preemption made the prompt run again."""
        if prompt_logprobs is None:
            return None
        num_rows = len(prompt_logprobs.ranks)
        first_new_row = max(0, request.num_prompt_logprobs_sent - request.num_prompt_logprobs_seen)
        request.num_prompt_logprobs_seen += num_rows
        if first_new_row >= num_rows:
            return None
        request.num_prompt_logprobs_sent += num_rows - first_new_row
        return _slice_logprobs(prompt_logprobs, first_new_row, num_rows)

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

    def reset_prefix_cache(self) -> bool:
        """Forget all cached prefixes; False (nothing done) while requests hold blocks."""
        return self.kv_cache_manager.reset_prefix_cache()

    def make_stats(self) -> SchedulerStats | None:
        """This step's load and counters (the counters then restart); None without log_stats."""
        if not self.log_stats:
            return None
        prefix_stats = self.kv_cache_manager.make_prefix_cache_stats()
        num_preemptions, self._num_step_preemptions = self._num_step_preemptions, 0
        num_scheduled_tokens, self._num_step_scheduled_tokens = self._num_step_scheduled_tokens, 0
        grammar_queries, grammar_hits, compile_times = 0, 0, list[float]()
        if self.structured_output_manager is not None:
            grammar_queries, grammar_hits, compile_times = (
                self.structured_output_manager.take_stats()
            )
        return SchedulerStats(
            num_running_reqs=len(self.running),
            num_waiting_reqs=len(self.waiting) + len(self.waiting_for_grammar),
            kv_cache_usage=self.kv_cache_manager.usage,
            num_preemptions=num_preemptions,
            prefix_cache_queries=prefix_stats.num_queried_tokens,
            prefix_cache_hits=prefix_stats.num_hit_tokens,
            num_scheduled_tokens=num_scheduled_tokens,
            num_waiting_for_grammar=len(self.waiting_for_grammar),
            grammar_cache_queries=grammar_queries,
            grammar_cache_hits=grammar_hits,
            grammar_compile_times=compile_times,
            running_lora_adapters=_count_adapters(self.running) if self.lora_config else {},
            waiting_lora_adapters=_count_adapters(self.waiting) if self.lora_config else {},
            **self._spec_stats.take(),
            **(self._kv_stats.take(self.kv_connector) if self.kv_connector is not None else {}),
        )


def _count_adapters(requests: Iterable[Request]) -> dict[str, int]:
    """Requests per adapter name (the base model's are not counted)."""
    counts: dict[str, int] = {}
    for request in requests:
        if request.lora_request is not None:
            name = request.lora_request.lora_name
            counts[name] = counts.get(name, 0) + 1
    return counts


def _slice_logprobs(logprobs: Logprobs, start: int, stop: int) -> Logprobs:
    return Logprobs(
        token_ids=logprobs.token_ids[start:stop],
        logprobs=logprobs.logprobs[start:stop],
        ranks=logprobs.ranks[start:stop],
    )


class _SpecStats:
    """Speculative-decoding counters since the last SchedulerStats."""

    def __init__(self, num_speculative_tokens: int):
        self.num_speculative_tokens = num_speculative_tokens
        self._reset()

    def _reset(self) -> None:
        self.num_drafts = 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.accepted_per_pos = [0] * self.num_speculative_tokens

    def add(self, num_drafts: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_drafts
        self.num_accepted_tokens += num_accepted
        for pos in range(num_accepted):
            self.accepted_per_pos[pos] += 1

    def take(self) -> dict:
        """The SchedulerStats fields (empty when there were no drafts), then reset."""
        if not self.num_drafts:
            return {}
        fields = {
            "spec_num_drafts": self.num_drafts,
            "spec_num_draft_tokens": self.num_draft_tokens,
            "spec_num_accepted_tokens": self.num_accepted_tokens,
            "spec_accepted_per_pos": self.accepted_per_pos,
        }
        self._reset()
        return fields


class _KVStats:
    """KV-connector figures since the last SchedulerStats."""

    def __init__(self) -> None:
        self.queries = 0
        self.hits = 0
        self.store_ok = True
        self.seconds: list[float] = []
        self.bytes_loaded = 0
        self.bytes_saved = 0

    def add_step(self, output: ModelRunnerOutput) -> None:
        self.store_ok = output.kv_store_ok
        self.seconds.extend(output.kv_transfer_seconds)
        self.bytes_loaded += output.kv_bytes_loaded
        self.bytes_saved += output.kv_bytes_saved

    def take(self, connector: SchedulerConnector) -> dict:
        store = connector.store_stats()
        fields = {
            "external_prefix_cache_queries": self.queries,
            "external_prefix_cache_hits": self.hits,
            "kv_store_up": connector.store_up and self.store_ok,
            "kv_transfer_seconds": self.seconds,
            "kv_bytes_loaded": self.bytes_loaded,
            "kv_bytes_saved": self.bytes_saved,
        }
        if store is not None:
            fields["kv_store_usage"] = store.used_bytes / max(store.capacity_bytes, 1)
            fields["kv_store_hits"] = store.hits
            fields["kv_store_misses"] = store.misses
        self.queries = self.hits = self.bytes_loaded = self.bytes_saved = 0
        self.seconds = []
        return fields
