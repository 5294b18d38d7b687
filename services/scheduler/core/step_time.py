"""How long an engine step takes, from its shape: the model the latency targets plan with.

A step's time is modelled as linear in its shape, with non-negative coefficients:

    seconds = c0 + c1 * prompt work / 1e3 + c2 * decode rows / 1e2
                 + c3 * context attended / 1e6 + c4 * verify rows / 1e2 + c5 * prompt chunk

where a chunk of p prompt tokens after c computed ones attends p * c + p (p + 1) / 2 keys
(attention's work), verify rows are the drafts verified under speculation, and "prompt
chunk" is 1 when the step holds a request computing more than one known token: such a
step leaves the decode-only fast paths (the CPU's native decode stack, CUDA graphs) for
the module path once, a cost of its own whatever the chunks' number and size
(SmolLM2-135M, float32, 4 decodes: 55 ms alone, 160-190 ms beside a 20-token chunk, in
CPU time; without this term the fit spread that jump over the intercept and the prompt
tokens, and planned such steps at 114 ms). It counted chunks until 2026-12-07: the chats'
first step (4 prompts of 128 tokens, 1.34 s) put most of its time on that feature (4, the
largest), and no later step of one chunk fitted beside the chats under their TPOT target
(bench/slo_sitting/part_b_steps.py).

"Prompt work" is the prompt tokens plus the keys the prompt chunks attend, in tokens'
worth (`prompt_keys_per_token`: the keys whose attention costs what one prompt token's
linear layers cost, from the model's shape, ModelRunner.prompt_keys_per_token; 0: the
prompt's keys count in the context term as the decodes' do). Without it, a document's late
chunks ran 10-23x their prediction (SmolLM2-135M, one thread: a 2,048-token chunk after
6,000 computed tokens 17.4 s of CPU, predicted 0.8 s; the context term is never learned
while short chats are all the engine sees, and the few long chunks that would teach it
come in a burst); priced at the prompt tokens' learned rate and the model's ratio (3,072
keys a token there), 2,048 tokens at 0, 952 at 2,048 and 2,048 at 6,000 computed come to
7.2, 4.5 and 17.7 s against 7.6, 4.7 and 17.4 s measured. The context term then holds the
decodes' keys (memory-bound reads, not the prompts' compute-bound ones). The scales keep
the features near 1, so the fit is well conditioned.

The coefficients start at a prior: from the workers' start-up measurement where there is
one (`SchedulerFeatures.step_costs`: seconds of steps of 1, 2, 4 ... query tokens, measured
for adaptive speculation), else a guess (a GPU prefilling 10k tokens/s). Every
measured step then refits them (`record`): the step enters exponentially decayed normal
equations (half-life ~70 steps, so a machine that gets slower is followed), and a
non-negative least-squares solve, pulled weakly towards the prior in the directions the
steps seen do not pin down, gives the new coefficients: after each of the first
`_REFIT_INTERVAL` steps, then every `_REFIT_INTERVAL` steps. The first steps refit at once
because the prior may be far off: an engine without speculation has no start-up
measurement, and on the 2-core CPU the default guess predicts a 2,048-token step at 0.2 s
where it takes 2-3 s; waiting for eight of them before the first refit let part (c)'s
fair-policy sitting run whole-budget steps beside the light tenant's chats (TTFT target)
for its first 20 s (bench/slo_sitting/simulate_tenants.py reproduces it). The mean relative
prediction error is kept as an EWMA (SchedulerStats.step_time_prediction_error).

The fit predicts a step's mean time; a step varies around it (log-normal, 16-33% on a
2-core CPU server), and steps that carry prompt chunks ran longer than predicted there. So
the model also keeps the latest steps with prompt tokens (the steps the latency targets
size), and at each refit the `ratio_level` quantile of their measured / predicted times
under the new coefficients (`ratio_quantile`, P90 by default; 1.0 until `_MIN_RATIOS` such
steps): a prediction times it is a time the step stays within that often
(latency_targets.py plans with it). The ratios are taken against the current fit, not the
one each step was planned with: a step planned before the fit knew its cost (the prior's
first steps; the first document after decode-only steps, whose prompt coefficient was
still the prior's) ran many times its prediction, and kept as such it held the P90 up for
the next ~100 steps with prompts (part (c) simulated with eight whole-budget steps before
the first refit: a P90 of 10 to 16 for 30 s, and no prompt token beside the decodes).
Plain Python: 6 features, a few microseconds a step.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from kvserve.shared.messages import SchedulerOutput

_SCALES = (1.0, 1e-3, 1e-2, 1e-6, 1e-2, 1.0)  # feature i is raw value i * _SCALES[i]
_NUM_FEATURES = len(_SCALES)
# Without a start-up measurement: 10 ms a step, 0.1 s per 1k prompt tokens, 5 ms per 100
# decode or verify rows, 10 ms per 1M attended keys, 5 ms per prompt chunk.
_DEFAULT_PRIOR = (0.010, 0.100, 0.005, 0.010, 0.005, 0.005)
_DECAY = 0.99  # weight of the past at each new step
_PRIOR_WEIGHT = 0.05  # ridge towards the prior, in steps' worth of evidence
_REFIT_INTERVAL = 8
_SOLVE_SWEEPS = 12
_ERROR_WEIGHT = 0.05  # EWMA weight of the newest step's relative error
_RATIO_WINDOW = 128  # steps with prompt tokens whose measured / predicted ratio is kept
_MIN_RATIOS = 16  # fewer: ratio_quantile stays 1.0 (the mean prediction)
RATIO_LEVEL = 0.9  # the quantile of the ratio that ratio_quantile follows
_MAX_GAP_S = 0.5  # a longer gap between steps is a wait, not the loop's own work


@dataclass(frozen=True)
class StepShape:
    """What a step computes, in the model's raw units.

    Args:
        num_prefill_tokens: prompt tokens (rows of requests computing more than one token).
        num_decode_rows: requests computing one known token (plus drafts, if any).
        num_context_tokens: keys attended, summed over the step's query tokens.
        num_verify_rows: drafts verified (speculative decoding).
        num_prefill_chunks: requests computing more than one known token (prompt chunks).
        num_prefill_context: the keys the prompt chunks attend (part of num_context_tokens).
    """

    num_prefill_tokens: int = 0
    num_decode_rows: int = 0
    num_context_tokens: int = 0
    num_verify_rows: int = 0
    num_prefill_chunks: int = 0
    num_prefill_context: int = 0

    def features(self, prompt_keys_per_token: float = 0.0) -> list[float]:
        """The model's features (module docstring); `prompt_keys_per_token` > 0 prices the
        prompt chunks' keys as prompt work, else they count in the context term."""
        prompt_work: float = self.num_prefill_tokens
        context: float = self.num_context_tokens
        if prompt_keys_per_token > 0:
            prompt_work += self.num_prefill_context / prompt_keys_per_token
            context -= self.num_prefill_context
        raw = (
            1.0,
            prompt_work,
            self.num_decode_rows,
            context,
            self.num_verify_rows,
            min(self.num_prefill_chunks, 1),
        )
        return [value * scale for value, scale in zip(raw, _SCALES)]


def attended(num_query_tokens: int, num_computed_tokens: int) -> int:
    """Keys attended by a run of query tokens that follows num_computed_tokens (causal)."""
    n = num_query_tokens
    return n * num_computed_tokens + n * (n + 1) // 2


def shape_of(scheduler_output: SchedulerOutput) -> StepShape:
    """The shape of a planned step (its SchedulerOutput holds the pre-step computed counts)."""
    computed = {new.req_id: new.num_computed_tokens for new in scheduler_output.scheduled_new_reqs}
    cached = scheduler_output.scheduled_cached_reqs
    computed.update(zip(cached.req_ids, cached.num_computed_tokens))
    drafts = scheduler_output.spec_decode.draft_token_ids
    num_prefill = num_decode = num_context = num_verify = num_chunks = num_prefill_context = 0
    for req_id, num_tokens in scheduler_output.num_scheduled_tokens.items():
        num_drafts = len(drafts[req_id]) if req_id in drafts else 0
        num_known = num_tokens - num_drafts
        keys = attended(num_tokens, computed.get(req_id, 0))
        if num_known == 1:
            num_decode += 1
        else:
            num_prefill += num_known
            num_chunks += 1
            num_prefill_context += keys
        num_verify += num_drafts
        num_context += keys
    return StepShape(
        num_prefill, num_decode, num_context, num_verify, num_chunks, num_prefill_context
    )


def prior_from_step_costs(step_costs: list[tuple[int, float]]) -> tuple[float, ...]:
    """The coefficients a start-up measurement implies: its least-squares line (seconds =
    a + s * query tokens) as the intercept, and s per token for prompt, decode and verify
    rows; the context and prompt-chunk terms keep the default guesses (those steps attend
    almost nothing, and run no prompt chunk beside decodes)."""
    points = [(n, t) for n, t in step_costs if n > 0 and t > 0]
    if len(points) < 2:
        return _DEFAULT_PRIOR
    mean_n = sum(n for n, _ in points) / len(points)
    mean_t = sum(t for _, t in points) / len(points)
    var_n = sum((n - mean_n) ** 2 for n, _ in points)
    slope = max(sum((n - mean_n) * (t - mean_t) for n, t in points) / var_n, 0.0)
    intercept = max(mean_t - slope * mean_n, 1e-4)
    return (
        intercept,
        slope / _SCALES[1],
        slope / _SCALES[2],
        _DEFAULT_PRIOR[3],
        slope / _SCALES[4],
        _DEFAULT_PRIOR[5],
    )


class StepTimeModel:
    """Predicts a step's seconds from its shape and refits from measured steps (see the
    module docstring).

    Args:
        step_costs: (query tokens, seconds) the workers measured at start-up; empty: the
            default prior.
        prompt_keys_per_token: attended keys worth one prompt token (module docstring; 0:
            the prompt chunks' keys count in the context term).
    """

    def __init__(
        self,
        step_costs: list[tuple[int, float]] | None = None,
        prompt_keys_per_token: float = 0.0,
    ) -> None:
        self.prompt_keys_per_token = prompt_keys_per_token
        self.prior = list(prior_from_step_costs(step_costs or []))
        self.coefficients = list(self.prior)
        self._gram = [[0.0] * _NUM_FEATURES for _ in range(_NUM_FEATURES)]  # sum w x x^T
        self._moment = [0.0] * _NUM_FEATURES  # sum w x y
        self._num_since_refit = 0
        self.num_steps = 0
        self.relative_error = 0.0  # EWMA of |predicted - measured| / measured
        self.ratio_level = RATIO_LEVEL
        self.ratio_quantile = 1.0  # of measured / predicted, steps with prompt tokens
        # The latest steps with prompt tokens: (features, measured seconds).
        self._prompt_steps: deque[tuple[list[float], float]] = deque(maxlen=_RATIO_WINDOW)

    def predict(self, shape: StepShape) -> float:
        features = shape.features(self.prompt_keys_per_token)
        return sum(c * x for c, x in zip(self.coefficients, features))

    def record(self, shape: StepShape, seconds: float) -> None:
        """One measured step: track the error of its prediction, then learn from it."""
        if seconds <= 0:
            return
        x = shape.features(self.prompt_keys_per_token)
        predicted = sum(c * xi for c, xi in zip(self.coefficients, x))
        error = abs(predicted - seconds) / seconds
        if shape.num_prefill_tokens:
            self._prompt_steps.append((x, seconds))
        if self.num_steps == 0:
            self.relative_error = error
        else:
            self.relative_error += _ERROR_WEIGHT * (error - self.relative_error)
        self.num_steps += 1
        self._moment = [_DECAY * m + xi * seconds for m, xi in zip(self._moment, x)]
        self._gram = [
            [_DECAY * g + xi * xj for g, xj in zip(row, x)] for row, xi in zip(self._gram, x)
        ]
        self._num_since_refit += 1
        if self._num_since_refit >= _REFIT_INTERVAL or self.num_steps <= _REFIT_INTERVAL:
            self.refit()

    def refit(self) -> None:
        """Non-negative least squares on the decayed normal equations, with a ridge towards
        the prior (projected Gauss-Seidel, warm-started from the current coefficients); then
        the ratio quantile under the new coefficients."""
        self._num_since_refit = 0
        gram, coefficients = self._gram, self.coefficients
        targets = [m + _PRIOR_WEIGHT * p for m, p in zip(self._moment, self.prior)]
        diagonals = [gram[i][i] + _PRIOR_WEIGHT for i in range(_NUM_FEATURES)]
        for _ in range(_SOLVE_SWEEPS):
            for i, row in enumerate(gram):
                # Row i of the normal equations, solved for coefficient i (the others held).
                rest = sum([a * c for a, c in zip(row, coefficients)]) - row[i] * coefficients[i]
                coefficients[i] = max((targets[i] - rest) / diagonals[i], 0.0)
        if len(self._prompt_steps) >= _MIN_RATIOS:
            ratios = sorted(
                seconds / predicted
                for x, seconds in self._prompt_steps
                if (predicted := sum(c * xi for c, xi in zip(coefficients, x))) > 0
            )
            if ratios:
                index = min(int(self.ratio_level * len(ratios)), len(ratios) - 1)
                self.ratio_quantile = ratios[index]


class UnseenTime:
    """The seconds between a measured step's end and the next step's start, while requests
    wait for it: the busy loop around the step (outputs out, inputs in), which the time
    between a client's tokens holds but the step's own measurement does not. Keeps the
    latest gaps and their running `level` quantile (`quantile_s`; 0 until `_MIN_RATIOS`).

    Args:
        level: the quantile followed (the step-time model's ratio_level).
    """

    def __init__(self, level: float = RATIO_LEVEL) -> None:
        self.level = level
        self.quantile_s = 0.0
        self.last_gap_s = 0.0  # the latest gap (0: the engine may have idled before)
        self._gaps: deque[float] = deque(maxlen=_RATIO_WINDOW)
        self._step_end: float | None = None
        self._num_since_update = 0

    def step_ended(self, now: float, next_step_follows: bool) -> None:
        """A step was measured; `next_step_follows`: requests are left, so the engine
        steps again at once (else it may idle, and the gap is no step's)."""
        self._step_end = now if next_step_follows else None

    def step_started(self, now: float) -> None:
        self.last_gap_s = 0.0
        if self._step_end is None:
            return
        gap, self._step_end = now - self._step_end, None
        self.last_gap_s = gap
        if not 0 <= gap <= _MAX_GAP_S:
            return  # a clock step, or a wait (a pause, grammars compiling): not the loop's
        self._gaps.append(gap)
        self._num_since_update += 1
        if len(self._gaps) >= _MIN_RATIOS and self._num_since_update >= _REFIT_INTERVAL:
            self._num_since_update = 0
            gaps = sorted(self._gaps)
            self.quantile_s = gaps[min(int(self.level * len(gaps)), len(gaps) - 1)]
