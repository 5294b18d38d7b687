"""What the latency targets' budget rule (latency_targets.py) reads off the requests: the
TPOT slack each running request banked, and the prompts whose TTFT targets are still in reach.

TPOT is an average over a request's output (vLLM's definition: (latency - TTFT) / (output
tokens - 1)), so a step faster than the target banks the difference, and one longer step
can spend it without the request missing its target. `TpotPaces` keeps, per request, when
it was first seen decoding and how many tokens it had then; the request's next token is due
by that time plus the target per token since. The request's later steps are each planned
within the per-step limit (the target times the rule's headroom, at a high quantile), so
the margin between the two over its next BORROW_TOKENS tokens (up to max_tokens) may be
spent now too: a request that just started decoding has banked nothing yet, but its
later steps will.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from kvserve.services.scheduler.core.request import Request
from kvserve.services.scheduler.core.request_queue import RequestQueue

# The most of a request's later tokens whose margin (target - per-step limit) a step may
# spend now (the request may stop before max_tokens: its margin is then not earned).
BORROW_TOKENS = 32


class TpotPaces:
    """Each running request's TPOT pace: (first seen decoding, its output tokens then)."""

    def __init__(self) -> None:
        self._starts: dict[str, tuple[float, int]] = {}

    def next_token_allowance(self, request: Request, now: float, per_step_s: float) -> float:
        """The longest step after which `request` (decoding, with a TPOT target) is still
        on pace: its slack, never less than `per_step_s`, the per-step limit its target
        sets (a request behind its pace gets that limit, as if it had no slack)."""
        assert request.slo_tpot_ms is not None
        start = self._starts.setdefault(request.req_id, (now, request.num_output_tokens))
        target_s = request.slo_tpot_ms / 1000
        num_due = request.num_output_tokens - start[1] + 1
        slack_s = start[0] + target_s * num_due - now
        num_after = 0  # tokens after this step's, each planned within per_step_s
        if request.max_tokens is not None:
            num_after = min(request.max_tokens - request.num_output_tokens - 1, BORROW_TOKENS)
        return max(slack_s + max(num_after, 0) * (target_s - per_step_s), per_step_s)

    def paced_allowance(
        self, request: Request, now: float, pace_s: float, reserve_s: float, floor_s: float
    ) -> float:
        """The longest step after which `request` (decoding, with a TPOT target) is still
        `reserve_s` ahead of a pace of `pace_s` a token since first seen decoding, never
        less than `floor_s` (the per-step limit). Nothing is borrowed from its later
        tokens, so a step may spend this again and again and the request still averages
        within `pace_s`."""
        start = self._starts.setdefault(request.req_id, (now, request.num_output_tokens))
        num_due = request.num_output_tokens - start[1] + 1
        return max(start[0] + pace_s * num_due - reserve_s - now, floor_s)

    def forget(self, request: Request) -> None:
        self._starts.pop(request.req_id, None)


@dataclass(frozen=True)
class UrgentPrompts:
    """Prompt tokens still to compute for requests with a TTFT target (and no token yet).

    Args:
        num_tokens: those of the requests whose deadline is ahead, running or waiting.
        num_late_tokens: those of the requests whose deadline passed: they still go before
            prompts without a target (a late first token beats a later one), but set no pace.
        num_head_tokens: those of the request with the earliest deadline ahead.
        head_slack_s: the time left to that deadline.
        head_pace_s: the time left to that request's pace point, `pace_share` of its TTFT
            target after its arrival (0 once passed): the pace floor aims there, not at
            the deadline, as the last step's time varies.
    """

    num_tokens: int = 0
    num_late_tokens: int = 0
    num_head_tokens: int = 0
    head_slack_s: float = float("inf")
    head_pace_s: float = float("inf")


def urgent_prompts(
    running: list[Request],
    waiting: RequestQueue,
    seats: int,
    room: int,
    now: float,
    pace_share: float = 1.0,
) -> UrgentPrompts:
    """The prompts with a TTFT target: running ones mid-prefill, then waiting ones in
    admission order while seats last, until `room` tokens (a step's most) are counted."""
    ahead: list[Request] = []
    num_tokens = num_late = 0
    waiting_seated = itertools.islice(waiting, max(seats, 0)) if waiting else ()
    for request in itertools.chain(running, waiting_seated):
        if num_tokens + num_late >= room:
            break
        if request.slo_ttft_ms is None or request.num_output_tokens or _prompt_left(request) <= 0:
            continue
        if _deadline(request) > now:
            ahead.append(request)
            num_tokens += _prompt_left(request)
        else:
            num_late += _prompt_left(request)
    if not ahead:
        return UrgentPrompts(0, num_late)
    head = min(ahead, key=_deadline)
    assert head.slo_ttft_ms is not None
    pace_point = head.arrival_time + pace_share * head.slo_ttft_ms / 1000
    return UrgentPrompts(
        num_tokens,
        num_late,
        _prompt_left(head),
        _deadline(head) - now,
        max(pace_point - now, 0.0),
    )


def prompts(running: list[Request], waiting: RequestQueue, seats: int) -> list[Request]:
    """The requests with prompt tokens to compute: running mid-prefill, or waiting in
    admission order while seats last."""
    waiting_seated = itertools.islice(waiting, max(seats, 0)) if waiting else ()
    return [r for r in itertools.chain(running, waiting_seated) if _prompt_left(r) > 1]


def oldest_untargeted_prompt(
    running: list[Request], waiting: RequestQueue, seats: int
) -> float | None:
    """The arrival time of the oldest prompt without a TTFT target (`prompts`; None: no
    such prompt)."""
    arrivals = [r.arrival_time for r in prompts(running, waiting, seats) if r.slo_ttft_ms is None]
    return min(arrivals, default=None)


def has_paced_prompt(running: list[Request], waiting: RequestQueue, seats: int) -> bool:
    """Whether a prompt (`prompts`) has a TPOT target and no TTFT target."""
    return any(
        r.slo_ttft_ms is None and r.slo_tpot_ms is not None
        for r in prompts(running, waiting, seats)
    )


def prompt_tokens_left(running: list[Request], waiting: RequestQueue, seats: int) -> int:
    """The prompt tokens left to compute (`prompts`)."""
    return sum(_prompt_left(r) for r in prompts(running, waiting, seats))


def _prompt_left(request: Request) -> int:
    return request.num_tokens - request.num_computed_tokens


def _deadline(request: Request) -> float:
    assert request.slo_ttft_ms is not None
    return request.arrival_time + request.slo_ttft_ms / 1000
