"""Latency targets: how much a step may hold so the running requests keep their TPOT target
and a waiting request with a TTFT target gets in.

Each request may carry `slo_ttft_ms` and `slo_tpot_ms` (EngineCoreRequest; the api resolves
the request's own, its tenant's and the server's); one that carries none gets the engine's
--slo-ttft-ms / --slo-tpot-ms here. Admission order is the policies' (deadline_queue.py).
Each step, `step_budget` sets the plan's budget by this rule:

1. The running decodes always fit: every running request computing its next token (and its
   drafts) is in the step, even when they alone are predicted over a target.
2. The step's time limit is the tightest TPOT target among the running decodes; and, when
   the waiting queue's head has a TTFT target whose deadline the step can still meet (its
   decodes and the head's prompt fit before it), the time left to that deadline.
3. Prompt tokens (chunks of running prompts and waiting prompts) fill what is left: the most
   whose predicted step time (step_time.py) keeps within the limit, all of
   max_num_batched_tokens without a limit.
4. A waiting head with a TTFT target gets room for its prompt first, within those prompt
   tokens (so the TPOT targets still hold: a long one gets a chunk): running prompt chunks
   take only the rest (StepPlan.running_prefill_budget), so it is admitted in this step
   instead of waiting behind another request's long prompt (if a seat is free).

With no live request carrying a target, the budget is max_num_batched_tokens, as without
this module. A missed target is not refused: the request is served, late.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from kvserve.services.scheduler.core.request import Request
from kvserve.services.scheduler.core.request_queue import RequestQueue
from kvserve.services.scheduler.core.step_time import StepShape, StepTimeModel, attended, shape_of
from kvserve.shared.config import SchedulerConfig
from kvserve.shared.messages import SchedulerOutput

# With a step limit and no decodes, a step still computes this many prompt tokens.
_MIN_PREFILL_TOKENS = 16


@dataclass(frozen=True)
class StepBudget:
    """A step's token budget, and what of it running prompt chunks may take (None: all)."""

    token_budget: int
    running_prefill_budget: int | None = None


@dataclass
class _Decodes:
    """The running decodes of a step: rows, drafts and the keys they attend."""

    num_rows: int = 0
    num_drafts: int = 0
    num_context: int = 0
    tightest_tpot_s: float = float("inf")
    prefill_context: int = 0  # computed tokens of the first running prompt (its chunk's start)


class LatencyTargets:
    """The targets' defaults, the step-time model and the budget rule (module docstring).

    Args:
        config: the scheduler's config (defaults, max_num_batched_tokens).
        step_costs: the workers' start-up measurement (SchedulerFeatures.step_costs).
        clock: now, in the clock of EngineCoreRequest.arrival_time (the api's time.time()).
    """

    def __init__(
        self,
        config: SchedulerConfig,
        step_costs: list[tuple[int, float]] | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.config = config
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.model = StepTimeModel(step_costs)
        self.clock = clock
        self.num_targeted = 0  # live requests with a target

    def add(self, request: Request) -> None:
        """A request arrived: give it the engine's default targets where it carries none."""
        if request.slo_ttft_ms is None:
            request.slo_ttft_ms = self.config.slo_ttft_ms
        if request.slo_tpot_ms is None:
            request.slo_tpot_ms = self.config.slo_tpot_ms
        if request.slo_ttft_ms is not None or request.slo_tpot_ms is not None:
            self.num_targeted += 1

    def remove(self, request: Request) -> None:
        if request.slo_ttft_ms is not None or request.slo_tpot_ms is not None:
            self.num_targeted -= 1

    def record_step(self, scheduler_output: SchedulerOutput, seconds: float) -> None:
        """A measured step (schedule to outputs) refits the step-time model."""
        if scheduler_output.total_num_scheduled_tokens:
            self.model.record(shape_of(scheduler_output), seconds)

    def step_budget(self, running: list[Request], waiting: RequestQueue) -> StepBudget:
        """This step's budget under the targets of `running` and of the waiting head."""
        if not self.num_targeted:
            return StepBudget(self.max_num_batched_tokens)
        decodes = _running_decodes(running)
        num_decode_tokens = decodes.num_rows + decodes.num_drafts
        head = waiting.peek_request() if waiting else None
        num_reserved = 0
        has_seat = len(running) < self.config.max_num_seqs
        if head is not None and head.slo_ttft_ms is not None and has_seat:
            room = max(self.max_num_batched_tokens - num_decode_tokens, 0)
            num_reserved = min(head.num_tokens - head.num_computed_tokens, room)
        limit_s = min(decodes.tightest_tpot_s, self._ttft_limit(head, decodes, num_reserved))
        num_prefill = self._max_prefill_tokens(decodes, limit_s)
        num_reserved = min(num_reserved, num_prefill)  # the TPOT targets come first
        return StepBudget(
            num_decode_tokens + num_prefill,
            num_prefill - num_reserved if num_reserved else None,
        )

    def _ttft_limit(self, head: Request | None, decodes: _Decodes, num_reserved: int) -> float:
        """The time left to the waiting head's TTFT deadline, if a step holding the decodes
        and its prompt could still end before it (else its target is missed anyway)."""
        if head is None or head.slo_ttft_ms is None:
            return float("inf")
        slack_s = head.arrival_time + head.slo_ttft_ms / 1000 - self.clock()
        if self._predict(decodes, num_reserved) > slack_s:
            return float("inf")
        return slack_s

    def _max_prefill_tokens(self, decodes: _Decodes, limit_s: float) -> int:
        """The most prompt tokens whose step is predicted within `limit_s` (binary search:
        the prediction grows with the tokens)."""
        room = max(self.max_num_batched_tokens - decodes.num_rows - decodes.num_drafts, 0)
        if limit_s == float("inf") or self._predict(decodes, room) <= limit_s:
            return room
        low, high = 0, room  # predict(low) may be over the limit; predict(high) is
        while high - low > 1:
            middle = (low + high) // 2
            if self._predict(decodes, middle) <= limit_s:
                low = middle
            else:
                high = middle
        if low == 0 and decodes.num_rows == 0:
            return min(_MIN_PREFILL_TOKENS, room)  # no decodes to protect: progress
        return low

    def _predict(self, decodes: _Decodes, num_prefill: int) -> float:
        return self.model.predict(
            StepShape(
                num_prefill_tokens=num_prefill,
                num_decode_rows=decodes.num_rows,
                num_context_tokens=decodes.num_context
                + attended(num_prefill, decodes.prefill_context),
                num_verify_rows=decodes.num_drafts,
            )
        )


def _running_decodes(running: list[Request]) -> _Decodes:
    """The running requests' next step: decode rows (and their drafts), the keys they attend,
    the tightest TPOT target among them, and where the first running prompt's chunk starts."""
    decodes = _Decodes()
    found_prefill = False
    for request in running:
        num_left = request.num_tokens - request.num_computed_tokens
        if num_left > 1:
            if not found_prefill:
                decodes.prefill_context = request.num_computed_tokens
                found_prefill = True
            continue
        num_drafts = len(request.spec.draft_token_ids) if request.spec is not None else 0
        decodes.num_rows += 1
        decodes.num_drafts += num_drafts
        decodes.num_context += attended(1 + num_drafts, request.num_computed_tokens)
        if request.slo_tpot_ms is not None:
            decodes.tightest_tpot_s = min(decodes.tightest_tpot_s, request.slo_tpot_ms / 1000)
    return decodes
