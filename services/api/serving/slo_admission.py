"""--slo-admission reject: a request whose TTFT target is already out of reach is answered
503 at once, with Retry-After and a body naming the target, instead of being queued to miss
it. A request already admitted is never dropped; --slo-admission serve (the default) admits
every request as before.

Out of reach: the engine's estimated TTFT for a prompt of this length
(observability/ttft_estimate.py) exceeds the request's TTFT target. Only the targets the api
resolved count (the body's, a header's, the tenant's key file line's); the engine's own
--slo-ttft-ms default is not known here.
"""

from __future__ import annotations

import math

from kvserve.services.api.observability.ttft_estimate import TtftEstimator
from kvserve.services.api.serving.errors import APIError
from kvserve.services.api.serving.latency_targets import LatencyTargets


class SloAdmission:
    """Refuses requests whose TTFT target the estimate says cannot be met.

    Args:
        estimator: the engines' recent queue and prefill times (one of the engine client's
            stat loggers).
    """

    def __init__(self, estimator: TtftEstimator):
        self.estimator = estimator

    def check(self, targets: LatencyTargets, num_prompt_tokens: int) -> None:
        """Raises APIError (503 with Retry-After) when `targets.ttft_ms` is out of reach for a
        prompt of `num_prompt_tokens` tokens; nothing without a TTFT target."""
        if targets.ttft_ms is None:
            return
        estimate_s = self.estimator.estimate_s(num_prompt_tokens)
        if estimate_s * 1000.0 <= targets.ttft_ms:
            return
        raise APIError(
            503,
            f"the TTFT target of {targets.ttft_ms:g} ms cannot be met: the estimated time to "
            f"first token is {estimate_s * 1000.0:.1f} ms (--slo-admission reject)",
            param="slo.ttft_ms",
            headers={"Retry-After": str(max(1, math.ceil(estimate_s)))},
        )
