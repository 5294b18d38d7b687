"""One simulated engine: kvserve's continuous-batching scheduler over the shipped
KVCacheManager (and so BlockPool), with step durations from the fitted step-time model.

The KV cache is kvserve's own: prefix lookup, allocation, caching of full blocks and
freeing are `KVCacheManager` calls, and block hashes come from the engine's own block
hasher (`make_block_hasher` over shared/hashing.py). What is simulated is only the model
(step durations, pre-drawn output tokens) and the scheduling loop, which follows
services/scheduler/core/scheduler.py with the fcfs policy: each step has a token budget and a
sequence cap; running requests go first (a prompt chunk or one decode token), preempting
from the tail when blocks run out; then, unless the step preempted, waiting requests are
admitted in order after a prefix-cache lookup, their prompts chunked to the budget.
Outputs are applied when the step ends.
"""

from __future__ import annotations

import json
from collections import deque
from dataclasses import dataclass

from bench.dp_routing_sim.workload import SimRequest
from kvserve.services.scheduler.core.kv_cache_manager import KVCacheManager
from kvserve.services.scheduler.core.request import make_block_hasher
from kvserve.shared.hashing import HashFn


@dataclass(frozen=True)
class StepTimeModel:
    """step_s = intercept_s + per_prefill_token_s * prefill tokens + per_decode_req_s *
    decode requests + per_decode_ctx_token_s * decode context tokens."""

    intercept_s: float
    per_prefill_token_s: float
    per_decode_req_s: float
    per_decode_ctx_token_s: float

    @classmethod
    def from_json(cls, path: str) -> StepTimeModel:
        """Read the coefficients bench/measure_step_times.py wrote."""
        with open(path) as f:
            coef = json.load(f)["coefficients"]
        return cls(
            coef["intercept_s"],
            coef["num_prefill_tokens"],
            coef["num_decode_reqs"],
            coef["num_decode_ctx_tokens"],
        )

    def step_s(
        self, num_prefill_tokens: int, num_decode_reqs: int, num_decode_ctx_tokens: int
    ) -> float:
        return (
            self.intercept_s
            + self.per_prefill_token_s * num_prefill_tokens
            + self.per_decode_req_s * num_decode_reqs
            + self.per_decode_ctx_token_s * num_decode_ctx_tokens
        )


@dataclass(frozen=True)
class EngineConfig:
    """
    Args:
        num_blocks: KV blocks per engine, the null block included (as the engine reports
            them in its READY handshake, and as the router bounds its record).
        block_size: tokens per block.
        max_num_batched_tokens: token budget of one step.
        max_num_seqs: running requests at most.
    """

    num_blocks: int = 4096
    block_size: int = 16
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 256


class SimEngine:
    """
    Args:
        engine_idx: index in the fleet.
        config: the engine's limits.
        step_model: step durations.
        hash_fn: the block hash function (the engines' default is sha256).
    """

    def __init__(
        self, engine_idx: int, config: EngineConfig, step_model: StepTimeModel, hash_fn: HashFn
    ):
        self.engine_idx = engine_idx
        self.config = config
        self.step_model = step_model
        self.kv_cache_manager = KVCacheManager(config.num_blocks, config.block_size)
        self.block_hasher = make_block_hasher(config.block_size, hash_fn)
        self.waiting: deque[SimRequest] = deque()
        self.running: list[SimRequest] = []
        self.in_step = False
        self.busy_s = 0.0
        self.num_steps = 0
        self.num_preemptions = 0
        self.num_routed = 0
        self._batch: list[SimRequest] = []

    def add_request(self, request: SimRequest) -> None:
        """Queue an arrived (materialized) request and hash its full prompt blocks."""
        request.engine_idx = self.engine_idx
        request.block_hashes.extend(self.block_hasher(request))
        self.num_routed += 1
        self.waiting.append(request)

    def start_step(self) -> float | None:
        """Schedule one step; its duration, or None when there is nothing to run."""
        assert not self.in_step
        budget = self.config.max_num_batched_tokens
        self._batch = batch = []
        num_prefill_tokens = num_decode_reqs = num_decode_ctx_tokens = 0
        preempted = False
        index = 0
        while index < len(self.running) and budget:
            request = self.running[index]
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            num_preempted = self.num_preemptions
            allocated = self._allocate_or_preempt(request, num_new)
            preempted |= self.num_preemptions > num_preempted
            if not allocated:
                break  # the request itself was preempted: the cache is full
            is_decode = num_new == 1 and request.num_computed_tokens >= request.prompt_len
            request.num_computed_tokens += num_new
            batch.append(request)
            budget -= num_new
            index += 1
            if is_decode:
                num_decode_reqs += 1
                num_decode_ctx_tokens += request.num_computed_tokens
            else:
                num_prefill_tokens += num_new
        if not preempted:
            num_prefill_tokens += self._admit_waiting(budget, batch)
        if not batch:
            return None
        self.in_step = True
        self.num_steps += 1
        duration = self.step_model.step_s(
            num_prefill_tokens, num_decode_reqs, num_decode_ctx_tokens
        )
        self.busy_s += duration
        return duration

    def _allocate_or_preempt(self, request: SimRequest, num_new: int) -> bool:
        """Allocate for a running request, preempting from the tail of `running` until it
        fits; False if `request` itself had to go."""
        block_size = self.config.block_size
        # Fast path, most of the work: a decode token inside its last block, which
        # allocate_slots would neither allocate for nor cache (nothing fills up).
        if num_new == 1 and request.num_computed_tokens % block_size not in (0, block_size - 1):
            return True
        while self.kv_cache_manager.allocate_slots(request, num_new) is None:
            victim = self.running.pop()
            self._preempt(victim)
            if victim is request:
                return False
        return True

    def _admit_waiting(self, budget: int, batch: list[SimRequest]) -> int:
        """Admit waiting requests in order while budget, seats and blocks last; returns the
        prompt tokens scheduled."""
        manager = self.kv_cache_manager
        num_scheduled = 0
        while self.waiting and budget and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[0]
            hit_blocks, num_hit_tokens = manager.get_computed_blocks(request)
            num_new = min(request.num_tokens - num_hit_tokens, budget)
            if manager.allocate_slots(request, num_new, num_hit_tokens, hit_blocks) is None:
                break  # waiting requests never preempt running ones
            self.waiting.popleft()
            request.num_computed_tokens = num_hit_tokens + num_new
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_hit_tokens
            self.running.append(request)
            batch.append(request)
            budget -= num_new
            num_scheduled += num_new
        return num_scheduled

    def _preempt(self, request: SimRequest) -> None:
        """Free a running request's blocks and send it back to the front of waiting; its
        prompt and outputs so far are recomputed (prefix hits permitting)."""
        self.kv_cache_manager.free(request)
        request.num_computed_tokens = 0
        self.waiting.appendleft(request)
        self.num_preemptions += 1

    def finish_step(self, now: float) -> list[SimRequest]:
        """Apply the step's outputs at time `now`; returns the requests that finished."""
        assert self.in_step
        self.in_step = False
        finished = []
        block_size = self.config.block_size
        for request in self._batch:
            if request.num_computed_tokens < request.num_tokens:
                continue  # a prompt chunk short of the end: nothing sampled
            request.num_output += 1
            request.num_tokens += 1
            if request.num_tokens % block_size == 0:
                # The sampled token filled a block: hash it, as Request does on append.
                request.block_hashes.extend(self.block_hasher(request))
            if request.num_output == 1:
                request.first_token_s = now
            if request.num_output == request.output_len:
                request.finish_s = now
                self.kv_cache_manager.free(request)
                request.release()
                finished.append(request)
        if finished:
            done = set(map(id, finished))
            self.running = [r for r in self.running if id(r) not in done]
        self._batch = []
        return finished

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)
