"""Latency targets: how much a step may hold so the running requests keep their TPOT target
and a waiting request with a TTFT target gets in.

Each request may carry `slo_ttft_ms` and `slo_tpot_ms` (EngineCoreRequest; the api resolves
the request's own, its tenant's and the server's); one that carries none gets the engine's
--slo-ttft-ms / --slo-tpot-ms here. Admission order is the policies' (deadline_queue.py).
Each step, `step_budget` sets the plan's budget by this rule (what it reads off the
requests is slo_pace.py):

1. The running decodes always fit: every running request computing its next token (and its
   drafts) is in the step, even when they alone are predicted over a target; and they keep
   their rows: running prompt chunks take only the step's prompt share
   (StepPlan.prefill_budget), wherever they stand in the running list.
2. The step's time limit is the tightest of: the TPOT targets of the running decodes (times
   TPOT_HEADROOM, for what happens around the engine, the api's time); the time left to
   the earliest TTFT deadline among the prompts with one (running or waiting), while a
   step holding the decodes and that prompt can still end before it; and, while any live
   request has a TTFT target or one left in the last TARGET_MEMORY_S, a quarter of the
   tightest such target (a request arriving now waits for the step in flight: no
   2,048-token step beside short chats, nor in a lull between them; a half once none has
   been live for MEMORY_GAPS of their mean gap between arrivals: their arrivals stopped,
   and the documents left get longer steps), or twice the decodes' step with a minimal
   prompt chunk where that step alone takes longer than the quarter (out of reach: the
   prompts would otherwise get nothing, step after step). A live request's standing TTFT
   target (Request.standing_ttft_ms: a key file's, which any request may arrive with)
   counts as a live target here, so the steps leave room for such a request before one
   is live.
   A step's time is planned at a high quantile, not the mean (_predict): the model's
   prediction times the P90 of measured / predicted over the latest steps with prompt
   tokens (StepTimeModel.ratio_quantile), plus the P90 of the time between one step's end
   and the next one's start (UnseenTime: the busy loop around the step), which the
   client's time between tokens holds and the step's measurement does not.
3. Prompt tokens (chunks of running prompts and waiting prompts) fill what is left: the most
   whose planned step time keeps within the limit, all of max_num_batched_tokens without
   a limit.
4. The pace floor: the prompts whose TTFT deadline is ahead must all be computed by the
   earliest one's pace point, TTFT_PACE_SHARE (half) of its target after its arrival, so
   a step holds at least the fewest prompt tokens at which steps of that size clear them
   by then (not just in time: the last step's time varies; once the pace point passed,
   as many as the step may hold); such a step may run past the per-step TPOT
   limit by the slack the decodes banked (TPOT is an average over a request's output,
   vLLM's definition: a decode ahead of its pace can afford one longer step; slo_pace.py),
   never further and never past that deadline. With no such prompt, this floor spends
   no slack.
5. The catch-up: while a prompt without a TTFT target has waited past its aging bound
   (arrival_time + slo_aging_ms; running mid-prefill or waiting for a seat), or one with
   a TPOT target (and no TTFT target) gets nothing under rule 3, a step may
   also run as long as every running decode stays CATCH_UP_RESERVE_S ahead of a pace of
   CATCH_UP_PACE of its TPOT target a token since first seen decoding (never shorter than
   rule 3's step, never over CATCH_UP_STEP_CEILING times it: one step is a gap each
   client sees; within the TTFT deadline and the arrival cap of rule 2). Nothing is
   borrowed from later tokens, so this is spent step after step and each decode still
   averages within that pace; the reserve is what a burst of chats' prompts spends at
   once (rule 4). Without it, a document falls behind its arrivals while chats decode:
   each step's fixed cost leaves prompt chunks of ~10 tokens beside them. A chunk
   whose prompt time is under MIN_CHUNK_OVER_JUMP times the model's jump off the
   decode-only fast path (its prompt-chunk term) does not go then, unless prompts with
   a TTFT target wait, a chat with a TPOT target is left nothing, or it holds every
   prompt token left: the decodes bank the step, and a later chunk is larger.
6. Prompts with a TTFT target get their tokens first, within those prompt tokens: running
   prompt chunks without one take only the rest (StepPlan.running_prefill_budget), so a
   short request is admitted now instead of behind another request's long prompt (if a
   seat is free). Those whose deadline passed still go first, but set no pace.

With no live request carrying a target or a standing one (and none with a TTFT target in
the last TARGET_MEMORY_S), the budget is max_num_batched_tokens, as without this module. A missed
target is not refused: the request is served, late.
"""

from __future__ import annotations

import logging
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass

from kvserve.services.scheduler.core.request import Request
from kvserve.services.scheduler.core.request_queue import RequestQueue
from kvserve.services.scheduler.core.slo_pace import (
    TpotPaces,
    UrgentPrompts,
    has_paced_prompt,
    oldest_untargeted_prompt,
    prompt_tokens_left,
    urgent_prompts,
)
from kvserve.services.scheduler.core.step_time import (
    StepShape,
    StepTimeModel,
    UnseenTime,
    attended,
    shape_of,
)
from kvserve.shared.config import SchedulerConfig
from kvserve.shared.logging import init_logger
from kvserve.shared.messages import SchedulerOutput

logger = init_logger(__name__)

# With a step limit and no decodes, a step still computes this many prompt tokens.
_MIN_PREFILL_TOKENS = 16
# While requests with a TTFT target are live, a step is at most this share of the tightest.
_ARRIVAL_STEPS = 4
# ... and for this long after the last of them left.
TARGET_MEMORY_S = 30.0
# Once no request with a TTFT target has been live for MEMORY_GAPS times the mean gap
# between their latest arrivals (a lull no longer between two of them: their arrivals have
# stopped, or paused), the limit is a half of that target instead of a quarter, for the rest
# of TARGET_MEMORY_S: one arriving then still waits at most half its target for the step in
# flight, and the documents left behind get steps twice as long (bench/RESULTS.md: the
# quarter held the run's tail of documents to short steps for 30 s after the last chat).
MEMORY_GAPS = 5.0
_LULL_ARRIVAL_STEPS = 2
# The latest arrivals with a TTFT target whose mean gap measures the lull (fewer than
# _MIN_ARRIVALS: none is a lull before TARGET_MEMORY_S passed).
_ARRIVAL_WINDOW = 16
_MIN_ARRIVALS = 4
# Where the decodes with a minimal prompt chunk run past that share, a step may be this many
# times that step's time (prompts then get about half the machine instead of nothing).
ARRIVAL_OUT_OF_REACH = 2.0
# The pace floor aims to clear the prompts with a TTFT deadline ahead by this share of the
# earliest one's target after its arrival (not just in time: the last step's time varies).
TTFT_PACE_SHARE = 0.5
# Steps aim at this share of the tightest TPOT target, not at the target itself: the plan
# holds the step at its P90 and the engine's time between steps, not the api's time around
# them (the 2026-12-07 sitting, steps planned at the mean and at exactly the target:
# short-class P50 TPOT 130 ms against a 127 ms target; 0.8 of it, and the mean, P99 140).
TPOT_HEADROOM = 0.9
# A prompt without a TTFT target past its aging bound may spend what the decodes banked
# under a pace of this share of their TPOT target, less a reserve that the pace floor can
# still spend on a burst of chats' prompts (in the simulation, catch-up at the per-step
# limit's pace and no reserve left the decodes nothing for bursts: 9-18 of ~2,140 short
# chats missed a target at rate 0.5, against 4 without catch-up; 0.85 and 0.3 s: 4-5).
CATCH_UP_PACE = 0.85
CATCH_UP_RESERVE_S = 0.3
# ... and a catch-up step plans at most this many times the per-step limit: the decodes'
# bank grows by ~80 ms a token while they decode alone, and spent in one step it is a gap
# every client sees (part (b) of the 2026-12-08 sitting: a 1,898-token step of 4.9 s beside
# three chats with a 127 ms target, their P99 ITL 9.3x alone; with this ceiling 1.1-1.2x).
CATCH_UP_STEP_CEILING = 1.5
# Beside decodes, a prompt chunk without a TTFT target goes only if its prompt tokens take at
# least this many times the jump off the decode-only fast path (the model's prompt-chunk
# term): a smaller one spends the decodes' slack mostly on the jump.
MIN_CHUNK_OVER_JUMP = 1.0


@dataclass(frozen=True)
class StepBudget:
    """A step's token budget; what of it running prompt chunks may take, and what those
    without a TTFT target may take (None: all)."""

    token_budget: int
    prefill_budget: int | None = None
    running_prefill_budget: int | None = None


@dataclass
class _Decodes:
    """The running decodes of a step: rows, drafts and the keys they attend."""

    num_rows: int = 0
    num_drafts: int = 0
    num_context: int = 0
    tightest_tpot_s: float = float("inf")
    prefill_context: int = 0  # computed tokens of the first running prompt (its chunk's start)
    banked_s: float = float("inf")  # the longest step every TPOT average still allows
    paced_s: float = float("inf")  # ... every per-step pace (slo_pace.paced_allowance)


class LatencyTargets:
    """The targets' defaults, the step-time model and the budget rule (module docstring).

    Args:
        config: the scheduler's config (defaults, max_num_batched_tokens).
        step_costs: the workers' start-up measurement (SchedulerFeatures.step_costs).
        clock: now, in the clock of EngineCoreRequest.arrival_time (the api's time.time()).
        prompt_keys_per_token: the model's attended keys worth one prompt token
            (SchedulerFeatures.prompt_keys_per_token; 0: unknown).
    """

    def __init__(
        self,
        config: SchedulerConfig,
        step_costs: list[tuple[int, float]] | None = None,
        clock: Callable[[], float] = time.time,
        prompt_keys_per_token: float = 0.0,
    ) -> None:
        self.config = config
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.model = StepTimeModel(step_costs, prompt_keys_per_token)
        self.clock = clock
        self.num_targeted = 0  # live requests with a target
        self._ttft_targets_ms: Counter[float] = Counter()  # of the live requests
        self._standing_ms: Counter[float] = Counter()  # the live requests' standing_ttft_ms
        # The TTFT target of the latest request with one to leave, and until when it
        # still sets the arrival limit (a lull between short chats is no licence for a
        # 2,048-token step that the next one would wait behind); the latest arrivals with
        # one, and from when the limit is a half of it (MEMORY_GAPS).
        self._recent_ttft: tuple[float, float] | None = None
        self._ttft_arrivals: deque[float] = deque(maxlen=_ARRIVAL_WINDOW)
        self._lull_from = float("inf")
        self._paces = TpotPaces()
        self.unseen = UnseenTime(self.model.ratio_level)

    def add(self, request: Request) -> None:
        """A request arrived: give it the engine's default targets where it carries none."""
        if request.slo_ttft_ms is None:
            request.slo_ttft_ms = self.config.slo_ttft_ms
        if request.slo_tpot_ms is None:
            request.slo_tpot_ms = self.config.slo_tpot_ms
        if request.slo_ttft_ms is not None or request.slo_tpot_ms is not None:
            self.num_targeted += 1
        if request.slo_ttft_ms is not None:
            self._ttft_targets_ms[request.slo_ttft_ms] += 1
            self._ttft_arrivals.append(request.arrival_time)
        if request.standing_ttft_ms is not None:
            self._standing_ms[request.standing_ttft_ms] += 1

    def remove(self, request: Request) -> None:
        if request.slo_ttft_ms is not None or request.slo_tpot_ms is not None:
            self.num_targeted -= 1
        if request.slo_ttft_ms is not None:
            self._ttft_targets_ms[request.slo_ttft_ms] -= 1
            if not self._ttft_targets_ms[request.slo_ttft_ms]:
                del self._ttft_targets_ms[request.slo_ttft_ms]
            now = self.clock()
            self._recent_ttft = (request.slo_ttft_ms, now + TARGET_MEMORY_S)
            self._lull_from = now + self.lull_after_s()
        if request.standing_ttft_ms is not None:
            self._standing_ms[request.standing_ttft_ms] -= 1
            if not self._standing_ms[request.standing_ttft_ms]:
                del self._standing_ms[request.standing_ttft_ms]
        self._paces.forget(request)

    def lull_after_s(self) -> float:
        """How long after the last request with a TTFT target left the arrival limit
        relaxes to a half of that target: MEMORY_GAPS times the mean gap between the
        latest such arrivals, at most TARGET_MEMORY_S (also until _MIN_ARRIVALS of them
        arrived: their rate unknown)."""
        arrivals = sorted(self._ttft_arrivals)
        if len(arrivals) < _MIN_ARRIVALS:
            return TARGET_MEMORY_S
        mean_gap_s = (arrivals[-1] - arrivals[0]) / (len(arrivals) - 1)
        return min(TARGET_MEMORY_S, MEMORY_GAPS * mean_gap_s)

    def record_step(
        self, scheduler_output: SchedulerOutput, seconds: float, next_step_follows: bool = True
    ) -> None:
        """A measured step (schedule to outputs) refits the step-time model; the time to
        the next step's start (`next_step_follows`: requests are left) is the unseen time."""
        if scheduler_output.total_num_scheduled_tokens:
            shape = shape_of(scheduler_output)
            if logger.isEnabledFor(logging.DEBUG):  # KVSERVE_LOG_LEVEL=debug: each step
                self._log_step(shape, seconds)
            self.model.record(shape, seconds)
        self.unseen.step_ended(self.clock(), next_step_follows)

    def _log_step(self, shape: StepShape, seconds: float) -> None:
        """One line per step: its shape, its time against the model's prediction, and the
        time between the previous step's end and its start (what a client's gap adds)."""
        logger.debug(
            "step: %d prompt tokens in %d chunks (%d keys), %d decode rows (%d keys), %d "
            "drafts; %.1f ms, predicted %.1f ms (P90 ratio %.2f); %.1f ms after the last",
            shape.num_prefill_tokens,
            shape.num_prefill_chunks,
            shape.num_prefill_context,
            shape.num_decode_rows,
            shape.num_context_tokens - shape.num_prefill_context,
            shape.num_verify_rows,
            seconds * 1e3,
            self.model.predict(shape) * 1e3,
            self.model.ratio_quantile,
            self.unseen.last_gap_s * 1e3,
        )

    def step_budget(self, running: list[Request], waiting: RequestQueue) -> StepBudget:
        """This step's budget under the targets of `running` and of the waiting queue."""
        now = self.clock()
        self.unseen.step_started(now)
        if self._recent_ttft is not None and self._recent_ttft[1] <= now:
            self._recent_ttft = None
        if not self.num_targeted and self._recent_ttft is None and not self._standing_ms:
            return StepBudget(self.max_num_batched_tokens)
        decodes = self._running_decodes(running, now)
        num_decode_tokens = decodes.num_rows + decodes.num_drafts
        room = max(self.max_num_batched_tokens - num_decode_tokens, 0)
        seats = self.config.max_num_seqs - len(running)
        urgent = urgent_prompts(running, waiting, seats, room, now, TTFT_PACE_SHARE)
        cap_s = min(self._ttft_limit(urgent, decodes), self._arrival_limit(decodes))
        num_prefill = self._max_prefill_tokens(decodes, min(decodes.tightest_tpot_s, cap_s))
        starved = not num_prefill and has_paced_prompt(running, waiting, seats)
        if starved or self._has_aged_prompt(running, waiting, seats, now):
            # Catch-up: what the decodes banked under the per-step pace (module doc, 5).
            catch_up = self._max_prefill_tokens(decodes, min(decodes.paced_s, cap_s))
            num_prefill = max(num_prefill, catch_up)
            # A starved chat's chunk goes even if small: under the catch-up ceiling a larger
            # one may never fit, and it would wait for the decodes to end.
            waits = urgent.num_tokens + urgent.num_late_tokens or starved
            if not waits and not self._worth_the_jump(
                decodes, num_prefill, prompt_tokens_left(running, waiting, seats)
            ):
                num_prefill = 0  # the decodes bank it for a larger chunk (module doc, 5)
        num_prefill = max(num_prefill, self._urgent_floor(decodes, urgent, num_prefill))
        num_reserved = min(urgent.num_tokens + urgent.num_late_tokens, num_prefill)
        return StepBudget(
            num_decode_tokens + num_prefill,
            num_prefill,
            num_prefill - num_reserved if num_reserved else None,
        )

    def _worth_the_jump(self, decodes: _Decodes, num_prefill: int, num_left: int) -> bool:
        """Whether `num_prefill` prompt tokens beside the decodes are worth the step's jump
        off the decode-only fast path: their own time (the model's prompt-token term) at
        least MIN_CHUNK_OVER_JUMP times the jump (its prompt-chunk term), or they are all
        `num_left`, the prompt tokens left (no later chunk is larger: a short chat's whole
        prompt). Without decodes there is no fast path to leave."""
        if not decodes.num_rows or not num_prefill or num_prefill >= num_left:
            return True
        base_s = self.model.predict(StepShape())
        prompt_s = self.model.predict(StepShape(num_prefill_tokens=num_prefill)) - base_s
        jump_s = self.model.predict(StepShape(num_prefill_chunks=1)) - base_s
        return prompt_s >= MIN_CHUNK_OVER_JUMP * jump_s

    def _running_decodes(self, running: list[Request], now: float) -> _Decodes:
        """The running decodes (_running_decodes), with the TPOT slack they banked."""
        decodes = _running_decodes(running)
        for request in running:
            if request.slo_tpot_ms is not None and request.num_output_tokens:
                per_step_s = request.slo_tpot_ms / 1000 * TPOT_HEADROOM
                allowance = self._paces.next_token_allowance(request, now, per_step_s)
                decodes.banked_s = min(decodes.banked_s, allowance)
                pace_s = request.slo_tpot_ms / 1000 * CATCH_UP_PACE
                paced = self._paces.paced_allowance(
                    request, now, pace_s, CATCH_UP_RESERVE_S, per_step_s
                )
                ceiling_s = per_step_s * CATCH_UP_STEP_CEILING
                decodes.paced_s = min(decodes.paced_s, paced, ceiling_s)
        return decodes

    def _has_aged_prompt(
        self, running: list[Request], waiting: RequestQueue, seats: int, now: float
    ) -> bool:
        """Whether a prompt without a TTFT target has tokens left past its aging bound
        (arrival_time + slo_aging_ms): behind its arrival, it may spend the decodes'
        slack under the per-step pace. (One with a TPOT target may also when the per-step
        limit leaves the prompts nothing: `starved` in step_budget; a prompt without any
        target waits for its aging bound.)"""
        oldest = oldest_untargeted_prompt(running, waiting, seats)
        return oldest is not None and now >= oldest + self.config.slo_aging_ms / 1000

    def _ttft_limit(self, urgent: UrgentPrompts, decodes: _Decodes) -> float:
        """The time left to the earliest TTFT deadline among the prompts, if a step holding
        the decodes and that prompt could still end before it (else it is missed anyway)."""
        if not urgent.num_tokens:
            return float("inf")
        if self._predict(decodes, urgent.num_head_tokens) > urgent.head_slack_s:
            return float("inf")
        return urgent.head_slack_s

    def _arrival_limit(self, decodes: _Decodes) -> float:
        """While requests with a TTFT target are live, or one left in the last
        TARGET_MEMORY_S, no step longer than a share of the tightest such target: one
        arriving now waits for the step in flight (lever against 2,048-token steps beside
        short chats); a quarter, or a half once none has been live for the lull
        (lull_after_s); or a quarter of the tightest standing target of the live requests
        (a key file's: one may arrive at any time). Where the decodes with the fewest prompt
        tokens a step takes
        (_MIN_PREFILL_TOKENS) run longer than that share (a slow machine, a large batch),
        it is out of reach and would leave every prompt 0 tokens step after step: the
        limit is then ARRIVAL_OUT_OF_REACH times that smallest prompt-carrying step."""
        targets_ms = list(self._ttft_targets_ms)
        steps = _ARRIVAL_STEPS
        if self._recent_ttft is not None:
            targets_ms.append(self._recent_ttft[0])
            if not self._ttft_targets_ms and self.clock() >= self._lull_from:
                steps = _LULL_ARRIVAL_STEPS
        limits_s = [min(targets_ms) / 1000 / steps] if targets_ms else []
        if self._standing_ms:
            limits_s.append(min(self._standing_ms) / 1000 / _ARRIVAL_STEPS)
        if not limits_s:
            return float("inf")
        limit_s = min(limits_s)
        if not decodes.num_rows:
            return limit_s
        smallest_s = self._predict(decodes, _MIN_PREFILL_TOKENS)
        return limit_s if smallest_s <= limit_s else ARRIVAL_OUT_OF_REACH * smallest_s

    def _urgent_floor(self, decodes: _Decodes, urgent: UrgentPrompts, num_prefill: int) -> int:
        """The prompt tokens this step needs so the prompts with TTFT targets keep pace:
        enough per step to clear them all by the earliest deadline's pace point
        (TTFT_PACE_SHARE of its target after its arrival; once that passed, as many as
        the rest of this rule allows). Such a step may run past the decodes' per-step
        TPOT limit by the slack they banked (TPOT is an average over a request's output;
        slo_pace.py), never further (at the planned quantile: _predict), and never past
        that deadline."""
        if not urgent.num_tokens or urgent.head_slack_s <= 0:
            return 0
        allowance_s = min(decodes.banked_s, urgent.head_slack_s)
        upper = min(self._max_prefill_tokens(decodes, allowance_s), urgent.num_tokens)
        if upper <= num_prefill:
            return num_prefill
        low, high = num_prefill, upper  # the fewest tokens a step that keeps pace holds
        while high - low > 1:
            middle = (low + high) // 2
            if self._keeps_pace(decodes, urgent, middle):
                high = middle
            else:
                low = middle
        return high

    def _keeps_pace(self, decodes: _Decodes, urgent: UrgentPrompts, num_prefill: int) -> bool:
        """Whether steps of `num_prefill` prompt tokens clear the urgent prompts in time."""
        num_steps = urgent.head_pace_s / self._predict(decodes, num_prefill)
        return num_prefill * max(int(num_steps), 1) >= urgent.num_tokens

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
        """The time a step with `num_prefill` prompt tokens beside the decodes stays within
        most often (the model's ratio_level quantile, P90), with the time between steps
        that its measurement does not hold: what a client sees between two tokens."""
        prefill_context = attended(num_prefill, decodes.prefill_context)
        return self.unseen.quantile_s + self.model.ratio_quantile * self.model.predict(
            StepShape(
                num_prefill_tokens=num_prefill,
                num_decode_rows=decodes.num_rows,
                num_context_tokens=decodes.num_context + prefill_context,
                num_verify_rows=decodes.num_drafts,
                # Any prompt chunk takes the step off the decode-only fast path.
                num_prefill_chunks=int(num_prefill > 0),
                num_prefill_context=prefill_context,
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
            target_s = request.slo_tpot_ms / 1000 * TPOT_HEADROOM
            decodes.tightest_tpot_s = min(decodes.tightest_tpot_s, target_s)
    return decodes
