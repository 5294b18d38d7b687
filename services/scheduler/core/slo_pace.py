"""What the latency targets' budget rule (latency_targets.py) reads off the requests: the
TPOT slack each running request banked, and the prompts whose TTFT targets are still in reach.

TPOT is an average over a request's output (vLLM's definition: (latency - TTFT) / (output
tokens - 1)), so a step faster than the target banks the difference, and one longer step
can spend it without the request missing its target. `TpotPaces` keeps, per request, when
it was first seen decoding and how many tokens it had then; the request's next token is due
by that time plus the target per token since.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from kvserve.services.scheduler.core.request import Request
from kvserve.services.scheduler.core.request_queue import RequestQueue


class TpotPaces:
    """Each running request's TPOT pace: (first seen decoding, its output tokens then)."""

    def __init__(self) -> None:
        self._starts: dict[str, tuple[float, int]] = {}

    def next_token_allowance(self, request: Request, now: float) -> float:
        """The longest step after which `request` (decoding, with a TPOT target) is still
        on pace: its slack, never less than its target (a request behind its pace gets the
        per-step limit, as if it had no slack)."""
        assert request.slo_tpot_ms is not None
        start = self._starts.setdefault(request.req_id, (now, request.num_output_tokens))
        target_s = request.slo_tpot_ms / 1000
        num_due = request.num_output_tokens - start[1] + 1
        return max(start[0] + target_s * num_due - now, target_s)

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
    """

    num_tokens: int = 0
    num_late_tokens: int = 0
    num_head_tokens: int = 0
    head_slack_s: float = float("inf")


def urgent_prompts(
    running: list[Request], waiting: RequestQueue, seats: int, room: int, now: float
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
    return UrgentPrompts(num_tokens, num_late, _prompt_left(head), _deadline(head) - now)


def _prompt_left(request: Request) -> int:
    return request.num_tokens - request.num_computed_tokens


def _deadline(request: Request) -> float:
    assert request.slo_ttft_ms is not None
    return request.arrival_time + request.slo_ttft_ms / 1000
