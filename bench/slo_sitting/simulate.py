"""Issue 46's two-class workload on the real Scheduler, with steps timed by a fixed step-time
model instead of a model: goodput with and without latency targets, in seconds, no server.

    python bench/slo_sitting/simulate.py                   # rates 0.3 0.45 0.6, seeds 11-13
    python bench/slo_sitting/simulate.py --rates 0.45 --seeds 12

The workload is part (a) of bench/run_slo_sitting.sh: Poisson arrivals of short chats (128
in / 64 out, targets TTFT 1,343 ms and TPOT 127 ms as in bench/RESULTS.md) and documents
(4,096 in / 64 out, no target), 9 to 1, for 150 s. A step takes the "truth" model's time
(coefficients near the 2-core machine's: 40 ms a step, ~0.95 s per 1k prompt tokens, ~4 ms
per decode row) times log-normal noise, plus 15 ms the model does not see; the scheduler's
own step-time model starts from a start-up-like measurement and refits from those steps,
as in the engine. "fcfs" sends no targets; "targets" gives the short chats theirs. Goodput
is the short requests per second that met both targets (vLLM's TPOT: (last token - first
token) / (tokens - 1)). A check of the rule's dynamics, not a measurement of the server.
"""

from __future__ import annotations

import argparse
import random
from dataclasses import dataclass, field

from kvserve.services.scheduler.core.features import SchedulerFeatures
from kvserve.services.scheduler.core.scheduler import Scheduler
from kvserve.services.scheduler.core.step_time import StepTimeModel, shape_of
from kvserve.shared.config import CacheConfig, SchedulerConfig
from kvserve.shared.messages import EngineCoreRequest, ModelRunnerOutput, SchedulerOutput
from kvserve.shared.sampling_params import SamplingParams

TRUTH = (0.040, 0.95, 0.41, 0.05, 0.41)  # StepTimeModel coefficients of the simulated machine
NOISE = 0.25  # sigma of the log-normal factor on each step's time
OVERHEAD_S = 0.015  # per step, unseen by the model
TTFT_S, TPOT_S = 1.343, 0.127
DURATION_S = 150.0


@dataclass
class _Tokens:
    """When each request arrived and got each token."""

    arrival: dict[str, float] = field(default_factory=dict)
    times: dict[str, list[float]] = field(default_factory=dict)


def _arrivals(rate: float, seed: int) -> list[tuple[float, str, int]]:
    rng = random.Random(seed)
    now, arrivals = 0.0, []
    for i in range(int(rate * DURATION_S + 0.5)):
        now += rng.expovariate(rate)
        short = rng.random() < 0.9
        arrivals.append((now, f"{'short' if short else 'long'}{i}", 128 if short else 4096))
    return arrivals


def _request(req_id: str, num_tokens: int, arrival: float, targets: bool) -> EngineCoreRequest:
    first_id = 100 + 10_000 * int(req_id.removeprefix("short").removeprefix("long"))
    targeted = targets and req_id.startswith("short")
    return EngineCoreRequest(
        request_id=req_id,
        prompt_token_ids=list(range(first_id, first_id + num_tokens)),
        sampling_params=SamplingParams(max_tokens=64),
        eos_token_id=None,
        arrival_time=arrival,
        slo_ttft_ms=TTFT_S * 1000 if targeted else None,
        slo_tpot_ms=TPOT_S * 1000 if targeted else None,
    )


def _runner_output(scheduler: Scheduler, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
    """One sampled token for each request whose tokens are all computed after the step."""
    req_ids = list(scheduler_output.num_scheduled_tokens)
    sampled = []
    for req_id in req_ids:
        request = scheduler.requests.get(req_id)
        done = request is not None and request.num_computed_tokens >= request.num_tokens
        sampled.append([7] if done else [])
    return ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=sampled, spec_token_ids={})


def simulate(rate: float, seed: int, targets: bool) -> _Tokens:
    """Run the workload to the end; the tokens' times."""
    scheduler = Scheduler(
        SchedulerConfig(max_num_batched_tokens=2048, max_num_seqs=256),
        CacheConfig(block_size=16),
        20_000,
        8192,
        features=SchedulerFeatures(),
    )
    truth = StepTimeModel()
    truth.coefficients = list(TRUTH)
    start_up = [(n, TRUTH[0] + n * TRUTH[1] / 1000) for n in (1, 2, 4, 8, 16, 32, 64)]
    scheduler.latency.model = StepTimeModel(start_up)
    rng, clock, tokens = random.Random(seed), [0.0], _Tokens()
    scheduler.latency.clock = lambda: clock[0]
    arrivals = _arrivals(rate, seed)
    while arrivals or scheduler.has_requests():
        while arrivals and arrivals[0][0] <= clock[0]:
            arrival, req_id, num_tokens = arrivals.pop(0)
            scheduler.add_request(_request(req_id, num_tokens, arrival, targets))
            tokens.arrival[req_id] = arrival
        if not scheduler.has_requests():
            clock[0] = arrivals[0][0]
            continue
        scheduler_output = scheduler.schedule()
        seconds = truth.predict(shape_of(scheduler_output)) * rng.lognormvariate(0, NOISE)
        seconds += OVERHEAD_S
        scheduler.latency.record_step(scheduler_output, seconds)
        clock[0] += seconds
        runner_output = _runner_output(scheduler, scheduler_output)
        for output in scheduler.update_from_output(scheduler_output, runner_output):
            tokens.times.setdefault(output.request_id, []).extend(
                [clock[0]] * len(output.new_token_ids)
            )
    return tokens


def _report(tokens: _Tokens) -> str:
    shorts = [req_id for req_id in tokens.arrival if req_id.startswith("short")]
    ttfts = sorted(tokens.times[r][0] - tokens.arrival[r] for r in shorts)
    tpots = sorted((tokens.times[r][-1] - tokens.times[r][0]) / 63 for r in shorts)
    met = sum(
        tokens.times[r][0] - tokens.arrival[r] <= TTFT_S
        and (tokens.times[r][-1] - tokens.times[r][0]) / 63 <= TPOT_S
        for r in shorts
    )

    def p(values: list[float], q: float) -> float:
        return values[min(len(values) - 1, int(q * len(values)))]

    return (
        f"goodput {met / DURATION_S:.3f} ({met}/{len(shorts)} met); short TTFT P50 "
        f"{p(ttfts, 0.5):.2f} s P99 {p(ttfts, 0.99):.2f} s; TPOT P50 {p(tpots, 0.5) * 1000:.0f}"
        f" ms P99 {p(tpots, 0.99) * 1000:.0f} ms"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rates", type=float, nargs="+", default=[0.3, 0.45, 0.6])
    parser.add_argument("--seeds", type=int, nargs="+", default=[11, 12, 13])
    args = parser.parse_args()
    for rate in args.rates:
        for seed in args.seeds:
            for targets in (False, True):
                tokens = simulate(rate, seed, targets)
                name = "targets" if targets else "fcfs   "
                print(f"rate {rate} seed {seed} {name}: {_report(tokens)}")


if __name__ == "__main__":
    main()
