"""DP routing by TTFT target: a request with a TTFT target goes to an engine whose predicted
queue delay meets it.

Each engine publishes, in its load report, the step-time model's predicted time until a
request arriving now gets its first step (EngineLoad.predicted_queue_delay_ms,
services/scheduler/core/queue_delay.py). For a request with a TTFT target the DP router keeps
only the candidate engines whose predicted delay is within the target, and applies its usual
rule (the load score, the prefix preference) among them. When no engine meets the target, or
the request has none, every candidate stays: the usual rule decides, as without targets.
The engine's own --slo-ttft-ms default is not known to the api, so only the targets the api
resolved (body, header, key file) route.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence


def engines_meeting_ttft(
    candidate_ids: Sequence[int],
    predicted_delay_ms: Callable[[int], float],
    ttft_ms: float | None,
) -> list[int]:
    """The candidates whose predicted queue delay meets `ttft_ms` (all of them when none
    does or there is no target).

    Args:
        candidate_ids: the engines that may take the request.
        predicted_delay_ms: an engine's latest predicted queue delay, in ms.
        ttft_ms: the request's TTFT target (None: no target).
    """
    if ttft_ms is None:
        return list(candidate_ids)
    meeting = [i for i in candidate_ids if predicted_delay_ms(i) <= ttft_ms]
    return meeting or list(candidate_ids)
