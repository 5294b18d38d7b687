"""Issue 46's two-class workload on the real Scheduler, with steps timed by a fixed step-time
model instead of a model: goodput with and without latency targets, in seconds, no server.

    python bench/slo_sitting/simulate.py                   # rates 0.3 0.5, seeds 11-15
    python bench/slo_sitting/simulate.py --rates 0.5 --seeds 12 --noise 0.35 --modes targets

The workload is part (a) of bench/run_slo_sitting.sh: Poisson arrivals of short chats (128
in / 64 out, targets TTFT 1,343 ms and TPOT 127 ms as in bench/RESULTS.md) and documents
(4,096 in / 64 out, no target), 9 to 1, for 120 s (--duration). A step takes the "truth"
model's time (coefficients near the 2-core machine's: 40 ms a step, ~0.95 s per 1k prompt
tokens, ~4 ms per decode row) times log-normal noise (sigma --noise, 0.30: the real
server's relative error is 0.16-0.33), and then 15-25 ms (--overhead-ms, uniform) pass that
the step's measurement does not hold (the busy loop around the step, output processing, the api), as
on the server, where they are in the client's TPOT; --chunk-ms adds the cost of a step
holding any prompt chunk (the real server's jump off the decode-only fast path, ~100 ms
in a one-thread CPU-time replay; 0 by default, as the figures before it). The scheduler's
own step-time model starts from a start-up-like measurement and refits from the measured
steps, as in the engine (Scheduler.record_step_time after each step). "fcfs" sends no
targets; "targets" gives the short chats theirs. Goodput is as `vllm bench serve` counts
it: the short requests that met both targets (vLLM's TPOT: (last token - first token) /
(tokens - 1)) over the run's duration, from its start to the last request's last token
(documents held back stretch it). A check of the rule's dynamics, not a measurement of the
server. The table at the end: median [range] over seeds.
"""

from __future__ import annotations

import argparse
import random
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field

from kvserve.services.scheduler.core.features import SchedulerFeatures
from kvserve.services.scheduler.core.scheduler import Scheduler
from kvserve.services.scheduler.core.step_time import StepTimeModel, shape_of
from kvserve.shared.config import CacheConfig, SchedulerConfig
from kvserve.shared.messages import EngineCoreRequest, ModelRunnerOutput, SchedulerOutput
from kvserve.shared.sampling_params import SamplingParams

TRUTH = (0.040, 0.95, 0.41, 0.05, 0.41)  # StepTimeModel coefficients of the simulated machine
TTFT_S, TPOT_S = 1.343, 0.127
DURATION_S = 120.0
# Called after each step: the scheduler, its output and the step's measured seconds.
StepHook = Callable[[Scheduler, SchedulerOutput, float], None]


@dataclass
class _Tokens:
    """When each request arrived and got each token."""

    arrival: dict[str, float] = field(default_factory=dict)
    times: dict[str, list[float]] = field(default_factory=dict)


@dataclass(frozen=True)
class Machine:
    """The simulated machine: log-normal sigma of a step's time, unseen seconds per step, and
    what a step holding any prompt chunk costs on top (leaving the decode-only fast path)."""

    noise: float = 0.30
    overhead_s: tuple[float, float] = (0.015, 0.025)
    chunk_s: float = 0.0


def _arrivals(rate: float, seed: int, duration_s: float) -> list[tuple[float, str, int]]:
    rng = random.Random(seed)
    now, arrivals = 0.0, []
    for i in range(int(rate * duration_s + 0.5)):
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


def simulate(
    rate: float,
    seed: int,
    targets: bool,
    machine: Machine,
    duration_s: float = DURATION_S,
    on_step: StepHook | None = None,
) -> _Tokens:
    """Run the workload to the end; the tokens' times (`on_step`: called after each step)."""
    scheduler = Scheduler(
        SchedulerConfig(max_num_batched_tokens=2048, max_num_seqs=256),
        CacheConfig(block_size=16),
        20_000,
        8192,
        features=SchedulerFeatures(),
    )
    truth = StepTimeModel()
    truth.coefficients = [*TRUTH, machine.chunk_s]
    start_up = [(n, TRUTH[0] + n * TRUTH[1] / 1000) for n in (1, 2, 4, 8, 16, 32, 64)]
    scheduler.latency.model = StepTimeModel(start_up)
    rng, clock, tokens = random.Random(seed), [0.0], _Tokens()
    scheduler.latency.clock = lambda: clock[0]
    arrivals = _arrivals(rate, seed, duration_s)
    while arrivals or scheduler.has_requests():
        while arrivals and arrivals[0][0] <= clock[0]:
            arrival, req_id, num_tokens = arrivals.pop(0)
            scheduler.add_request(_request(req_id, num_tokens, arrival, targets))
            tokens.arrival[req_id] = arrival
        if not scheduler.has_requests():
            clock[0] = arrivals[0][0]
            continue
        scheduler_output = scheduler.schedule()
        seconds = truth.predict(shape_of(scheduler_output)) * rng.lognormvariate(0, machine.noise)
        clock[0] += seconds
        runner_output = _runner_output(scheduler, scheduler_output)
        outputs = scheduler.update_from_output(scheduler_output, runner_output)
        scheduler.record_step_time(scheduler_output, seconds)  # as the engine: the step only
        if on_step is not None:
            on_step(scheduler, scheduler_output, seconds)
        clock[0] += rng.uniform(*machine.overhead_s)  # outputs out, the next step's inputs in
        for output in outputs:  # the client sees the token after the unseen time
            tokens.times.setdefault(output.request_id, []).extend(
                [clock[0]] * len(output.new_token_ids)
            )
    return tokens


@dataclass(frozen=True)
class Figures:
    """One run's figures: short-class goodput (req/s over the run's duration), the run's
    duration (s, to the last request's last token), P99 TTFT and TPOT (s), and the long
    class's P50 and worst TTFT (s)."""

    goodput: float
    run_s: float
    num_met: int
    num_short: int
    short_ttft_p50: float
    short_ttft_p99: float
    short_tpot_p50: float
    short_tpot_p99: float
    short_itl_p99: float
    long_ttft_p50: float
    long_ttft_max: float


def _quantile(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] if values else float("nan")


def figures(tokens: _Tokens) -> Figures:
    shorts = [r for r in tokens.arrival if r.startswith("short")]
    longs = [r for r in tokens.arrival if r.startswith("long")]
    ttfts = [tokens.times[r][0] - tokens.arrival[r] for r in shorts]
    tpots = [(tokens.times[r][-1] - tokens.times[r][0]) / 63 for r in shorts]
    itls = [b - a for r in shorts for a, b in zip(tokens.times[r], tokens.times[r][1:])]
    long_ttfts = [tokens.times[r][0] - tokens.arrival[r] for r in longs]
    met = sum(ttft <= TTFT_S and tpot <= TPOT_S for ttft, tpot in zip(ttfts, tpots))
    run_s = max(times[-1] for times in tokens.times.values())  # the run starts at 0
    return Figures(
        met / run_s,
        run_s,
        met,
        len(shorts),
        _quantile(ttfts, 0.5),
        _quantile(ttfts, 0.99),
        _quantile(tpots, 0.5),
        _quantile(tpots, 0.99),
        _quantile(itls, 0.99),
        _quantile(long_ttfts, 0.5),
        max(long_ttfts, default=float("nan")),
    )


def _line(f: Figures) -> str:
    return (
        f"goodput {f.goodput:.3f} ({f.num_met}/{f.num_short} met, run {f.run_s:.0f} s); "
        f"short TTFT P50 "
        f"{f.short_ttft_p50:.2f} s P99 {f.short_ttft_p99:.2f} s; TPOT P50 "
        f"{f.short_tpot_p50 * 1000:.0f} ms P99 {f.short_tpot_p99 * 1000:.0f} ms; long TTFT "
        f"P50 {f.long_ttft_p50:.1f} s max {f.long_ttft_max:.1f} s"
    )


def _cell(values: list[float], fmt: str = ".3f") -> str:
    return f"{statistics.median(values):{fmt}} [{min(values):{fmt}}-{max(values):{fmt}}]"


def _row(rate: float, name: str, runs: list[Figures]) -> str:
    met = sum(r.num_met for r in runs)
    return (
        f"| {rate} | {name} | {_cell([r.goodput for r in runs])} "
        f"| {_cell([r.run_s for r in runs], '.0f')} "
        f"| {_cell([r.long_ttft_p50 for r in runs], '.1f')} "
        f"| {met} of {sum(r.num_short for r in runs)} "
        f"| {_cell([r.short_ttft_p99 for r in runs], '.2f')} "
        f"| {_cell([r.short_tpot_p99 * 1000 for r in runs], '.0f')} "
        f"| {_cell([r.short_itl_p99 * 1000 for r in runs], '.0f')} |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--rates", type=float, nargs="+", default=[0.3, 0.5])
    parser.add_argument("--seeds", type=int, nargs="+", default=[11, 12, 13, 14, 15])
    parser.add_argument("--noise", type=float, default=0.30, help="log-normal sigma of a step")
    parser.add_argument(
        "--overhead-ms", type=float, nargs=2, default=[15.0, 25.0], help="unseen ms per step"
    )
    parser.add_argument(
        "--chunk-ms", type=float, default=0.0, help="extra ms of a step with a prompt chunk"
    )
    parser.add_argument("--duration", type=float, default=DURATION_S, help="arrivals' window, s")
    parser.add_argument(
        "--modes", nargs="+", choices=["fcfs", "targets"], default=["fcfs", "targets"]
    )
    args = parser.parse_args()
    machine = Machine(
        args.noise, (args.overhead_ms[0] / 1000, args.overhead_ms[1] / 1000), args.chunk_ms / 1000
    )
    rows = []
    for rate in args.rates:
        runs: dict[str, list[Figures]] = {mode: [] for mode in args.modes}
        for seed in args.seeds:
            for mode in args.modes:
                tokens = simulate(rate, seed, mode == "targets", machine, args.duration)
                run = figures(tokens)
                runs[mode].append(run)
                print(f"rate {rate} seed {seed} {mode:7}: {_line(run)}", flush=True)
        rows.extend(_row(rate, mode, runs[mode]) for mode in args.modes)
        if len(args.modes) == 2:
            pairs = zip(runs["fcfs"], runs["targets"])
            ratios = [t.goodput / f.goodput for f, t in pairs if f.goodput]
            rows.append(f"| {rate} | targets / fcfs | {_cell(ratios, '.2f')}x | | | | | | |")
    print(
        "\n| rate | mode | short goodput req/s | run s | long P50 TTFT s | shorts meeting both "
        "| short P99 TTFT s | short P99 TPOT ms | short P99 ITL ms |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
