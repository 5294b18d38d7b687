"""One simulated engine: kvserve's continuous-batching scheduler over a BlockCache, with step
durations from the fitted step-time model.

Scheduling follows services/scheduler: no prefill/decode phases, each request has
`num_computed` (tokens with KV) and `num_tokens` (tokens known); each step has a token budget
and a sequence cap. Running requests go first (a prompt chunk or one decode token), preempting
from the tail when blocks run out; then waiting requests are admitted in FCFS order after a
prefix-cache lookup, their prompts chunked to the budget, unless the step preempted. Blocks are
allocated and full prompt blocks cached at schedule time (so a request admitted in the same
step already hits them); outputs are applied when the step ends.
"""

from __future__ import annotations

import json
from collections import deque
from dataclasses import dataclass

from bench.dp_routing_sim.block_cache import BlockCache
from bench.dp_routing_sim.workload import SimRequest


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
        return cls(coef["intercept_s"], coef["num_prefill_tokens"],
                   coef["num_decode_reqs"], coef["num_decode_ctx_tokens"])

    def step_s(self, num_prefill_tokens: int, num_decode_reqs: int,
               num_decode_ctx_tokens: int) -> float:
        return (self.intercept_s + self.per_prefill_token_s * num_prefill_tokens
                + self.per_decode_req_s * num_decode_reqs
                + self.per_decode_ctx_token_s * num_decode_ctx_tokens)


@dataclass(frozen=True)
class EngineConfig:
    """Args:
        num_blocks: KV blocks per engine.
        block_size: tokens per block.
        max_num_batched_tokens: token budget of one step.
        max_num_seqs: running requests at most.
    """

    num_blocks: int = 4096
    block_size: int = 16
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 256


class SimEngine:
    """Args:
        engine_idx: index in the fleet.
        config: the engine's limits.
        step_model: step durations.
    """

    def __init__(self, engine_idx: int, config: EngineConfig, step_model: StepTimeModel):
        self.engine_idx = engine_idx
        self.config = config
        self.step_model = step_model
        self.cache = BlockCache(config.num_blocks)
        self.waiting: deque[SimRequest] = deque()
        self.running: list[SimRequest] = []
        self.in_step = False
        self.busy_s = 0.0
        self.num_steps = 0
        self.num_preemptions = 0
        self.num_routed = 0
        self._batch: list[SimRequest] = []

    def add_request(self, request: SimRequest) -> None:
        request.engine_idx = self.engine_idx
        self.num_routed += 1
        self.waiting.append(request)

    def start_step(self) -> float | None:
        """Schedule one step; its duration, or None when there is nothing to run."""
        assert not self.in_step
        budget = self.config.max_num_batched_tokens
        self._batch = batch = []
        num_prefill_tokens = num_decode_reqs = num_decode_ctx_tokens = 0
        preempted = False
        block_size = self.config.block_size
        index = 0
        while index < len(self.running) and budget:
            request = self.running[index]
            num_new = min(request.num_tokens - request.num_computed, budget)
            if (num_new == 1 and request.num_computed % block_size
                    and request.num_computed >= request.prompt_len):
                # Fast path, most of the work: a decode token that fits the last block.
                request.num_computed += 1
                batch.append(request)
                budget -= 1
                index += 1
                num_decode_reqs += 1
                num_decode_ctx_tokens += request.num_computed
                continue
            if not self._grow(request, num_new):
                preempted = True
                if request not in self.running:  # it preempted itself: the tail is done
                    break
                continue  # a tail request made room; try again
            batch.append(request)
            budget -= num_new
            index += 1
            if num_new == 1 and request.num_computed > request.prompt_len:
                num_decode_reqs += 1
                num_decode_ctx_tokens += request.num_computed
            else:
                num_prefill_tokens += num_new
        if not preempted:
            num_prefill_tokens += self._admit_waiting(budget, batch)
        if not batch:
            return None
        self.in_step = True
        self.num_steps += 1
        duration = self.step_model.step_s(num_prefill_tokens, num_decode_reqs,
                                          num_decode_ctx_tokens)
        self.busy_s += duration
        return duration

    def _grow(self, request: SimRequest, num_new: int) -> bool:
        """Allocate blocks for `num_new` more tokens of a running request, preempting from
        the tail of `running` while short; False if anything was preempted (the caller
        re-reads `running`)."""
        num_needed = self._blocks_for(request.num_computed + num_new) - request.num_blocks
        if num_needed > self.cache.num_free:
            while num_needed > self.cache.num_free and self.running:
                victim = self.running.pop()
                self._preempt(victim)
                if victim is request:
                    break
            return False
        self._advance(request, num_new, num_needed)
        return True

    def _admit_waiting(self, budget: int, batch: list[SimRequest]) -> int:
        """Admit waiting requests in order while budget, seats and blocks last; returns the
        prompt tokens scheduled."""
        cache = self.cache
        block_size = self.config.block_size
        num_scheduled = 0
        while self.waiting and budget and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[0]
            # The last token is always computed: it yields the next token's logits.
            max_hit_blocks = min(len(request.block_hashes),
                                 (request.num_tokens - 1) // block_size)
            num_hit, num_free_hit = cache.longest_hit(request.block_hashes, max_hit_blocks)
            num_new = min(request.num_tokens - num_hit * block_size, budget)
            num_needed = self._blocks_for(num_hit * block_size + num_new) - num_hit
            if num_needed + num_free_hit > cache.num_free:
                break
            self.waiting.popleft()
            hit_hashes = request.block_hashes[:num_hit]
            cache.acquire(hit_hashes)
            request.held_hashes = hit_hashes
            request.num_blocks = num_hit
            request.num_computed = num_hit * block_size
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_hit * block_size
            self._advance(request, num_new, num_needed)
            self.running.append(request)
            batch.append(request)
            budget -= num_new
            num_scheduled += num_new
        return num_scheduled

    def _advance(self, request: SimRequest, num_new: int, num_new_blocks: int) -> None:
        """Allocate, cache the prompt blocks this chunk fills, and move num_computed."""
        self.cache.allocate(num_new_blocks)
        request.num_blocks += num_new_blocks
        block_size = self.config.block_size
        first_full = request.num_computed // block_size
        request.num_computed += num_new
        last_full = min(request.num_computed // block_size, len(request.block_hashes))
        for block_hash in request.block_hashes[first_full:last_full]:
            if self.cache.register(block_hash):
                request.held_hashes.append(block_hash)

    def _preempt(self, request: SimRequest) -> None:
        """Free a running request's blocks and send it back to the front of waiting; its
        prompt and outputs so far are recomputed (prefix hits permitting)."""
        self._free(request)
        request.num_computed = 0
        self.waiting.appendleft(request)
        self.num_preemptions += 1

    def _free(self, request: SimRequest) -> None:
        self.cache.release(request.held_hashes, request.num_blocks - len(request.held_hashes))
        request.held_hashes = []
        request.num_blocks = 0

    def _blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.config.block_size)

    def finish_step(self, now: float) -> list[SimRequest]:
        """Apply the step's outputs at time `now`; returns the requests that finished."""
        assert self.in_step
        self.in_step = False
        finished = []
        for request in self._batch:
            if request.num_computed < request.num_tokens:
                continue  # a prompt chunk short of the end: nothing sampled
            request.num_output += 1
            request.num_tokens += 1
            if request.num_output == 1:
                request.first_token_s = now
            if request.num_output == request.output_len:
                request.finish_s = now
                self._free(request)
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
