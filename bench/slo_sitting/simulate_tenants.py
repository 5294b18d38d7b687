"""Issue 28's tenants (part (c) of bench/run_slo_sitting.sh) on the real Scheduler with the
fair policy, steps timed as in simulate.py instead of by a model: the light tenant's TTFT
beside the heavy tenant and alone, in seconds, no server.

    python bench/slo_sitting/simulate_tenants.py                    # seeds 51-55
    python bench/slo_sitting/simulate_tenants.py --seeds 51 --trace 30
    python bench/slo_sitting/simulate_tenants.py --light-ttft-ms 760 --start-up
    python bench/slo_sitting/simulate_tenants.py --start-up --standing   # the key file's way

The workload is part c's `kvserve bench serve --tenants` mix: heavy, 32 requests all at once
(concurrency 32), 1,024 prompt tokens / 64 out, no target; light, 12 requests of 128 / 32 at
Poisson arrivals of 1 req/s (the first at once), at most 4 in flight (the client holds a
request until a slot frees, and times it from its send), TTFT target --light-ttft-ms (the
sitting's 1,343 ms). The api hands the engine one request every --api-ms (2) in send order,
so the engine's first step starts with the first heavy request alone, as on the server
(there the light tenant's first request got its first token after the first heavy one's).
"alone" sends light only, the same arrivals. The engine is `--scheduling-policy fair`,
2,048-token steps, 256 seats. A step takes simulate.py's "truth" time, its prompt term
times --prompt-scale (1.5: the sitting's 2,048-token steps took ~3.1 s, the truth's ~2.0 s),
times log-normal noise, then unseen time (--noise, --overhead-ms, as simulate.py).

The scheduler's step-time model starts as the engine's does without speculation and without
targets configured at start-up (a header's only): with no start-up measurement, so from the
default prior; --start-up gives it simulate.py's start-up-like measurement instead
(what the workers time where targets are expected: --slo-step-timing, which a key file
with targets turns on). --standing: the light tenant's target is in the server's key file,
so every request, the heavy tenant's too, carries it as its standing_ttft_ms (the api
writes it on each), and the steps leave room for a light request before one is live.
A check of the rule's dynamics beside the fair policy, not a measurement of the server.
--trace S prints the scheduler's decisions, step by step, for the first S seconds of the
first seed's mixed run.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from kvserve.services.scheduler.core.features import SchedulerFeatures
from kvserve.services.scheduler.core.scheduler import Scheduler
from kvserve.services.scheduler.core.step_time import StepTimeModel, shape_of
from kvserve.shared.config import CacheConfig, SchedulerConfig
from kvserve.shared.messages import EngineCoreRequest, SchedulerOutput
from kvserve.shared.sampling_params import SamplingParams

if __package__ in (None, ""):  # run as a script: the repository root on sys.path
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.slo_sitting.simulate import TRUTH, Machine, _runner_output  # noqa: E402


@dataclass(frozen=True)
class Tenant:
    """One tenant's traffic, as a --tenants field list."""

    name: str
    rate: float  # requests per second; inf: all at once
    concurrency: int
    input_len: int
    output_len: int
    num: int
    ttft_ms: float | None = None


@dataclass(frozen=True)
class Setup:
    """What a run varies: the light tenant's target, the model's start, the machine."""

    light_ttft_ms: float | None = 1343.0
    start_up: bool = False
    standing: bool = False  # every request carries the light target as standing_ttft_ms
    prompt_scale: float = 1.5
    api_s: float = 0.002  # the api's time per request before the engine has it
    machine: Machine = Machine()


@dataclass
class _Client:
    """The client: each tenant's requests not sent yet, its free slots, and what came back."""

    pending: dict[str, list[tuple[float, str]]] = field(default_factory=dict)
    free_slots: dict[str, list[float]] = field(default_factory=dict)  # when each slot freed
    tenant_of: dict[str, Tenant] = field(default_factory=dict)
    sent: dict[str, float] = field(default_factory=dict)
    times: dict[str, list[float]] = field(default_factory=dict)
    in_api: list[tuple[float, str]] = field(default_factory=list)  # (reaches the engine, id)
    api_free_at: float = 0.0

    def next_event_time(self) -> float | None:
        """The earliest time a request reaches the engine or a free slot sends one."""
        times = [q[0][0] for t, q in self.pending.items() if q and self.free_slots[t]]
        times += [at for at, _ in self.in_api]
        return min(times, default=None)

    def send_due(self, now: float, api_s: float) -> None:
        """Send every request whose arrival came and that has a free slot, timed from
        max(its arrival, when the slot freed); the api takes each in turn, api_s apiece."""
        for name, queue in self.pending.items():
            slots = self.free_slots[name]
            while queue and slots and queue[0][0] <= now:
                arrival, req_id = queue.pop(0)
                slots.sort()
                sent = max(arrival, slots.pop(0))
                self.sent[req_id] = sent
                self.api_free_at = max(sent, self.api_free_at) + api_s
                self.in_api.append((self.api_free_at, req_id))

    def deliver(self, now: float, scheduler: Scheduler, standing_ttft_ms: float | None) -> None:
        """Hand the engine the requests the api is done with."""
        for at, req_id in [entry for entry in self.in_api if entry[0] <= now]:
            self.in_api.remove((at, req_id))
            tenant = self.tenant_of[req_id]
            sent = self.sent[req_id]
            scheduler.add_request(_engine_request(req_id, tenant, sent, standing_ttft_ms))

    def finished(self, req_id: str, now: float) -> None:
        self.free_slots[self.tenant_of[req_id].name].append(now)


def _tenants(light_ttft_ms: float | None) -> list[Tenant]:
    return [
        Tenant("heavy", float("inf"), 32, 1024, 64, 32),
        Tenant("light", 1.0, 4, 128, 32, 12, light_ttft_ms),
    ]


def _client(tenants: list[Tenant], seed: int) -> _Client:
    """Each tenant's arrivals, seeded by the seed and its position: the first at once."""
    client = _Client()
    for index, tenant in enumerate(tenants):
        rng = random.Random(seed * 100 + index)
        now, queue = 0.0, []
        for i in range(tenant.num):
            if i and tenant.rate != float("inf"):
                now += rng.expovariate(tenant.rate)
            req_id = f"{tenant.name}{i}"
            queue.append((now, req_id))
            client.tenant_of[req_id] = tenant
        client.pending[tenant.name] = queue
        client.free_slots[tenant.name] = [0.0] * tenant.concurrency
    return client


def _engine_request(
    req_id: str, tenant: Tenant, sent: float, standing_ttft_ms: float | None
) -> EngineCoreRequest:
    number = int(req_id.removeprefix(tenant.name)) + (1000 if tenant.name == "light" else 0)
    first_id = 100 + 10_000 * number  # no two prompts share a block
    return EngineCoreRequest(
        request_id=req_id,
        prompt_token_ids=list(range(first_id, first_id + tenant.input_len)),
        sampling_params=SamplingParams(max_tokens=tenant.output_len),
        eos_token_id=None,
        arrival_time=sent,
        slo_ttft_ms=tenant.ttft_ms,
        tenant=tenant.name,
        standing_ttft_ms=standing_ttft_ms,
    )


def _scheduler(setup: Setup, clock: list[float]) -> Scheduler:
    scheduler = Scheduler(
        SchedulerConfig(max_num_batched_tokens=2048, max_num_seqs=256, scheduling_policy="fair"),
        CacheConfig(block_size=16),
        20_000,
        8192,
        features=SchedulerFeatures(),
    )
    if setup.start_up:  # simulate.py's start-up-like measurement
        start_up = [(n, TRUTH[0] + n * TRUTH[1] / 1000) for n in (1, 2, 4, 8, 16, 32, 64)]
        scheduler.latency.model = StepTimeModel(start_up)
    scheduler.latency.clock = lambda: clock[0]
    return scheduler


def simulate(setup: Setup, seed: int, alone: bool, trace_s: float = 0.0) -> _Client:
    """Run the mix (or light alone) to the end; the client's sends and token times."""
    tenants = _tenants(setup.light_ttft_ms)
    client = _client(tenants[1:] if alone else tenants, seed)
    clock = [0.0]
    scheduler = _scheduler(setup, clock)
    truth = StepTimeModel()
    truth.coefficients = [TRUTH[0], TRUTH[1] * setup.prompt_scale, *TRUTH[2:]]
    rng = random.Random(seed)
    while True:
        client.send_due(clock[0], setup.api_s)
        client.deliver(clock[0], scheduler, setup.light_ttft_ms if setup.standing else None)
        if not scheduler.has_requests():
            next_event = client.next_event_time()
            if next_event is None:
                return client
            clock[0] = max(clock[0], next_event)
            continue
        if clock[0] < trace_s:
            print(_trace_line(scheduler, clock[0]), end="", flush=True)
        scheduler_output = scheduler.schedule()
        seconds = truth.predict(shape_of(scheduler_output))
        seconds *= rng.lognormvariate(0, setup.machine.noise)
        clock[0] += seconds
        if clock[0] - seconds < trace_s:
            print(_trace_step(scheduler, scheduler_output, seconds), flush=True)
        runner_output = _runner_output(scheduler, scheduler_output)
        outputs = scheduler.update_from_output(scheduler_output, runner_output)
        scheduler.record_step_time(scheduler_output, seconds)  # as the engine: the step only
        clock[0] += rng.uniform(*setup.machine.overhead_s)
        for output in outputs:  # the client sees the token after the unseen time
            client.times.setdefault(output.request_id, []).extend(
                [clock[0]] * len(output.new_token_ids)
            )
            if output.finished:
                client.finished(output.request_id, clock[0])


def _trace_line(scheduler: Scheduler, now: float) -> str:
    """Before a step: the time, the light requests waiting and the model's state."""
    waiting = [r.req_id for r in scheduler.waiting if r.tenant == "light"]
    model = scheduler.latency.model
    return (
        f"{now:7.2f} s  light waiting {len(waiting)}  model c0 {model.coefficients[0]:.3f} "
        f"c1 {model.coefficients[1]:.2f} ratio P90 {model.ratio_quantile:.2f}  "
    )


def _trace_step(scheduler: Scheduler, out: SchedulerOutput, seconds: float) -> str:
    """A step: its prompt tokens and decode rows per tenant, and its time."""
    prompt: dict[str, int] = {}
    decode: dict[str, int] = {}
    for req_id, num in out.num_scheduled_tokens.items():
        tenant = "light" if req_id.startswith("light") else "heavy"
        into = decode if num == 1 else prompt
        into[tenant] = into.get(tenant, 0) + num
    return (
        f"step {seconds:5.2f} s: prompt {prompt or '-'} decode rows {decode or '-'} "
        f"new {[r.req_id for r in out.scheduled_new_reqs]}"
    )


@dataclass(frozen=True)
class Figures:
    """One run's light-tenant figures (s), and the heavy tenant's output tokens per second."""

    light_ttft_p50: float
    light_ttft_p99: float
    light_itl_max: float
    heavy_tok_s: float
    duration: float


def figures(client: _Client) -> Figures:
    """Percentiles as the bench takes them (numpy's, linear)."""
    light = [r for r in client.sent if r.startswith("light")]
    heavy = [r for r in client.sent if r.startswith("heavy")]
    ttfts = [client.times[r][0] - client.sent[r] for r in light]
    itls = [b - a for r in light for a, b in zip(client.times[r], client.times[r][1:])]
    end = max(t[-1] for t in client.times.values())
    heavy_tokens = sum(len(client.times[r]) for r in heavy)
    return Figures(
        float(np.percentile(ttfts, 50)),
        float(np.percentile(ttfts, 99)),
        max(itls, default=0.0),
        heavy_tokens / end if heavy else float("nan"),
        end,
    )


def _line(mix: Figures, alone: Figures) -> str:
    return (
        f"light P99 TTFT {mix.light_ttft_p99:.2f} s beside heavy, {alone.light_ttft_p99:.2f} s "
        f"alone = {mix.light_ttft_p99 / alone.light_ttft_p99:.1f}x; P50 "
        f"{mix.light_ttft_p50:.2f} s; max ITL {mix.light_itl_max:.2f} s; heavy "
        f"{mix.heavy_tok_s:.1f} out tok/s; run {mix.duration:.0f} s"
    )


def _cell(values: list[float], fmt: str) -> str:
    return f"{statistics.median(values):{fmt}} [{min(values):{fmt}}-{max(values):{fmt}}]"


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[51, 52, 53, 54, 55])
    parser.add_argument("--light-ttft-ms", type=float, default=1343.0)
    parser.add_argument("--start-up", action="store_true", help="a start-up measurement")
    parser.add_argument(
        "--standing",
        action="store_true",
        help="every request carries the light target as standing_ttft_ms (the key file's)",
    )
    parser.add_argument("--prompt-scale", type=float, default=1.5, help="x truth's prompt cost")
    parser.add_argument("--noise", type=float, default=0.30, help="log-normal sigma of a step")
    parser.add_argument(
        "--overhead-ms", type=float, nargs=2, default=[15.0, 25.0], help="unseen ms per step"
    )
    parser.add_argument("--api-ms", type=float, default=2.0, help="api ms per request")
    parser.add_argument("--trace", type=float, default=0.0, help="trace the first S seconds")
    args = parser.parse_args()
    machine = Machine(args.noise, (args.overhead_ms[0] / 1000, args.overhead_ms[1] / 1000))
    setup = Setup(
        args.light_ttft_ms,
        args.start_up,
        args.standing,
        args.prompt_scale,
        args.api_ms / 1000,
        machine,
    )
    runs: list[tuple[Figures, Figures]] = []
    for i, seed in enumerate(args.seeds):
        mix = figures(simulate(setup, seed, alone=False, trace_s=args.trace if not i else 0))
        alone = figures(simulate(setup, seed, alone=True))
        runs.append((mix, alone))
        print(f"seed {seed}: {_line(mix, alone)}", flush=True)
    print("\n| light P99 TTFT beside / alone | beside s | alone s | max ITL s | heavy tok/s |")
    print("|---|---|---|---|---|")
    print(
        f"| {_cell([m.light_ttft_p99 / a.light_ttft_p99 for m, a in runs], '.1f')}x "
        f"| {_cell([m.light_ttft_p99 for m, _ in runs], '.2f')} "
        f"| {_cell([a.light_ttft_p99 for _, a in runs], '.2f')} "
        f"| {_cell([m.light_itl_max for m, _ in runs], '.2f')} "
        f"| {_cell([m.heavy_tok_s for m, _ in runs], '.1f')} |"
    )


if __name__ == "__main__":
    main()
