"""How many draft tokens each request verifies and proposes: the adaptive speculation rule.

Verifying k drafts costs one forward of k + 1 query tokens. While a step is bandwidth-bound
(small batches) that costs about as much as one token, so drafts are nearly free; once the
batch is large enough that the step is compute-bound, every draft token costs its full
share, and speculation only slows the batch down (vLLM's own guidance).

The rule (adaptive, the default) maximises the step's expected goodput, tokens emitted per
second, with two measured inputs:

- `acceptance`: each request's EWMA of the fraction of its drafts accepted (alpha). Under the
  usual independence assumption its j-th draft is accepted with probability alpha ** j.
- `step_seconds(n)`: the forward's time for n query tokens, measured by the workers at
  start-up (ModelRunner.measure_step_costs) and interpolated, then scaled by what the
  engine's real steps take: an EWMA of measured / modelled step time, one for steps that
  verify drafts (their sampler and proposer work included) and one for steps that do not.
  So when drafts cost more than the forward model says (large batches: the verifying path
  over every draft row, the proposer's own steps), speculation turns down by itself.

A step with B decoding requests emits B tokens at least. Candidate drafts are taken in
order of falling alpha_r ** j, and each is kept while it raises
(B + sum of kept alpha_r ** j) / step_seconds(B + kept). So a low-acceptance request stops
speculating (its alpha ** 1 does not pay for the extra token), and a large batch stops
altogether (the step time grows with every token). A request whose drafts were turned off
retries one draft every `_PROBE_INTERVAL` steps, so a change of text can turn them back on,
unless a draft of a fresh request's acceptance would not pay in the batch.

A proposer that scores its own drafts (suffix decoding: a copy is accepted whole or breaks at
an edit, not token by token at one rate) is asked for up to the cap instead, and each
proposal is cut to the prefix whose expected tokens per second are highest over every
length (`num_worth_verifying`, with the proposer's chance that each prefix is accepted).
"""

from __future__ import annotations

import bisect
import heapq

from kvserve.shared.config import SpeculativeConfig

# EWMA weight of the newest step's acceptance, and the starting acceptance of a request.
_EWMA_WEIGHT = 0.3
_INITIAL_ACCEPTANCE = 0.6
# A request with speculation turned off proposes one draft every this many steps.
_PROBE_INTERVAL = 16
# EWMA weight of the newest step's measured / modelled time, and how fast the drafting
# steps' ratio drifts back to the plain one while no step drafts.
_STEP_RATIO_WEIGHT = 0.2
_STALE_DRIFT = 0.02


class SpecRequestState:
    """One request's speculation: its next drafts and its measured acceptance."""

    __slots__ = ("acceptance", "draft_token_ids", "steps_off")

    def __init__(self) -> None:
        self.draft_token_ids: list[int] = []  # proposed after the last step, not verified
        self.acceptance = _INITIAL_ACCEPTANCE
        self.steps_off = 0

    def record(self, num_drafts: int, num_accepted: int) -> None:
        if num_drafts > 0:
            rate = num_accepted / num_drafts
            self.acceptance += _EWMA_WEIGHT * (rate - self.acceptance)


class StepCostModel:
    """step_seconds(n): the forward time for n query tokens, linear between measured points
    and extrapolated with the last segment's slope."""

    def __init__(self, samples: list[tuple[int, float]]):
        samples = sorted(samples)
        if not samples:
            # No profile (the in-process tests, a proposer without one): a flat step of
            # unit cost, plus 2% per token.
            samples = [(1, 1.0), (2, 1.02)]
        if len(samples) == 1:
            n, t = samples[0]
            samples.append((n + 1, t * 1.02))
        self.num_tokens = [n for n, _ in samples]
        self.seconds = [t for _, t in samples]
        self._memo: dict[int, float] = {}  # the rule asks for the same counts every step

    def __call__(self, num_tokens: int) -> float:
        seconds = self._memo.get(num_tokens)
        if seconds is None:
            seconds = self._memo[num_tokens] = self._interpolate(num_tokens)
        return seconds

    def _interpolate(self, num_tokens: int) -> float:
        ns, ts = self.num_tokens, self.seconds
        i = bisect.bisect_left(ns, num_tokens)
        if i < len(ns) and ns[i] == num_tokens:
            return ts[i]
        lo = min(max(i - 1, 0), len(ns) - 2)
        slope = (ts[lo + 1] - ts[lo]) / (ns[lo + 1] - ns[lo])
        return max(ts[lo] + slope * (num_tokens - ns[lo]), 1e-9)


class SpecDecodePolicy:
    """Decides each step's drafts (see the module docstring).

    Args:
        config: the speculative config.
        step_costs: (query tokens, seconds) pairs the workers measured; empty without.
    """

    def __init__(self, config: SpeculativeConfig, step_costs: list[tuple[int, float]]):
        self.config = config
        self.num_speculative_tokens = config.num_speculative_tokens
        self.step_cost_model = StepCostModel(step_costs)
        # Measured / modelled step time, of steps without drafts and with them.
        self.plain_ratio = 1.0
        self.spec_ratio = 1.0
        # A proposer that scores its own drafts (suffix decoding) proposes up to the cap,
        # and each proposal is trimmed to what pays (num_worth_verifying).
        self.trims_proposals = False
        self.batch_size = 1  # requests that sampled in the last planned step

    def record_step(self, num_tokens: int, seconds: float, verified_drafts: bool) -> None:
        """One engine step's real time (schedule to outputs), for the ratios."""
        if num_tokens <= 0 or seconds <= 0:
            return
        ratio = seconds / self.step_cost_model(num_tokens)
        if verified_drafts:
            self.spec_ratio += _STEP_RATIO_WEIGHT * (ratio - self.spec_ratio)
        else:
            self.plain_ratio += _STEP_RATIO_WEIGHT * (ratio - self.plain_ratio)
            # Without drafts nothing is learned of their cost: the estimate drifts back to
            # the plain one, so a batch that shrank gets to try speculation again.
            self.spec_ratio += _STALE_DRIFT * (self.plain_ratio - self.spec_ratio)

    def step_seconds(self, num_tokens: int, num_drafts: int = 0) -> float:
        """The expected step time of num_tokens query tokens, num_drafts of them drafts."""
        ratio = self.spec_ratio if num_drafts else self.plain_ratio
        return self.step_cost_model(num_tokens) * ratio

    def num_worth_verifying(self, gains: list[float]) -> int:
        """How many of a scored proposal's drafts to verify: the prefix that maximises the
        step's expected tokens per second, (B + sum of its gains) / step_seconds(B + k),
        B the requests of the last planned step. Every length is weighed, not only the
        first that stops paying: a copy is often right whole or wrong at its first token.

        Args:
            gains: the chance that the first j drafts are all accepted, j = 1 .. len.
        """
        base, model = self.batch_size, self.step_cost_model
        best_k, best_rate = 0, base / (model(base) * self.plain_ratio)
        # Rates compared at the drafting steps' ratio (the same for every k >= 1).
        best_rate *= self.spec_ratio
        expected_tokens = float(base)
        for k, gain in enumerate(gains, 1):
            expected_tokens += gain
            rate = expected_tokens / model(base + k)
            if rate > best_rate:
                best_k, best_rate = k, rate
        return best_k

    def num_to_propose(
        self, states: list[SpecRequestState], caps: list[int], num_running: int
    ) -> list[int]:
        """Drafts each decoding request proposes after this step.

        Args:
            states: the requests that sample in this step.
            caps: the most drafts each may take (budget, max_tokens, max_model_len).
            num_running: requests in the batch (for disable_by_batch_size).
        """
        config = self.config
        if config.disable_by_batch_size is not None and num_running >= config.disable_by_batch_size:
            return [0] * len(states)
        caps = [min(cap, self.num_speculative_tokens) for cap in caps]
        self.batch_size = len(states)
        if not config.adaptive or self.trims_proposals:
            return caps
        for state, cap in zip(states, caps):
            state.steps_off = state.steps_off + 1 if cap > 0 else 0
        # Max-heap of the next candidate draft of each request: (-alpha ** j, request, j).
        heap = [(-state.acceptance, i, 1) for i, state in enumerate(states) if caps[i] > 0]
        heapq.heapify(heap)
        chosen = [0] * len(states)
        base = len(states)
        expected_tokens = float(base)
        seconds = self.step_seconds(base)
        num_drafts = 0
        while heap:
            neg_gain, i, j = heapq.heappop(heap)
            gain = -neg_gain
            next_seconds = self.step_seconds(base + num_drafts + 1, num_drafts + 1)
            if (expected_tokens + gain) / next_seconds <= expected_tokens / seconds:
                break  # the best remaining draft does not pay; the others pay less
            chosen[i] = j
            expected_tokens += gain
            seconds = next_seconds
            num_drafts += 1
            if j < caps[i]:
                heapq.heappush(heap, (neg_gain * states[i].acceptance, i, j + 1))
        # A probe is worth it only while a draft of a fresh request's acceptance would pay
        # in this batch (in a large batch, a probe costs every request the verifying path).
        probe = (base + _INITIAL_ACCEPTANCE) / self.step_seconds(
            base + 1, 1
        ) > base / self.step_seconds(base)
        for i, state in enumerate(states):
            if chosen[i]:
                state.steps_off = 0
            elif probe and caps[i] > 0 and state.steps_off >= _PROBE_INTERVAL:
                chosen[i] = 1  # has the text turned predictable?
                state.steps_off = 0
        return chosen
