"""The discrete-event loop and its metrics.

Three kinds of event, in time order (ties: step ends, then table refreshes, then arrivals):
an engine's step ends (outputs applied, next step scheduled at once if there is work), the
coordinator publishes a load table (every `refresh_s`; the router gets it through
`update_loads`, as the api's load-table task feeds it), a request arrives (its token ids
materialized, routed by `choose`, queued, and its engine woken if idle). Steps are never
preempted by arrivals: a request that lands mid-step waits for the next one, as in the real
engine loop.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass

import numpy as np

from bench.dp_routing_sim.engine import EngineConfig, SimEngine, StepTimeModel
from bench.dp_routing_sim.routers import RoundRobinRouter
from bench.dp_routing_sim.workload import SimRequest, ideal_cached_tokens
from kvserve.services.api.engine_client.dp_router import DPRouter
from kvserve.shared.hashing import HashFn
from kvserve.shared.wire import EngineLoad


@dataclass(frozen=True)
class RunMetrics:
    """What one (fleet, router) run measured, over requests after the warm-up.

    hit_rate: cached prompt tokens / prompt tokens. ideal_hit_rate: the same for one engine
    with unbounded KV (only each tenant's first request misses). busy_skew: max / mean of
    per-engine busy seconds (time spent in steps); req_skew: the same for requests routed.
    utilization: mean busy seconds / makespan.
    """

    num_engines: int
    router: str
    num_requests: int
    rate_per_s: float
    hit_rate: float
    ideal_hit_rate: float
    ttft_mean_s: float
    ttft_p99_s: float
    tpot_mean_s: float
    busy_skew: float
    req_skew: float
    utilization: float
    num_preemptions: int
    makespan_s: float


def simulate(
    requests: list[SimRequest],
    engines: list[SimEngine],
    router: DPRouter | RoundRobinRouter,
    refresh_s: float = 0.1,
) -> float:
    """Run every request to completion; returns the makespan (last finish time)."""
    heap: list[tuple[float, int, int]] = []  # (step end, tie-breaker, engine index)
    sequence = 0
    next_refresh = 0.0
    num_finished = 0
    now = 0.0
    for request in requests:
        # Drain every step end and refresh that comes before this arrival.
        while True:
            step_end = heap[0][0] if heap else math.inf
            if step_end <= request.arrival_s and step_end <= next_refresh:
                now, _, engine_idx = heapq.heappop(heap)
                num_finished += len(engines[engine_idx].finish_step(now))
                sequence = _start_step(engines[engine_idx], now, heap, sequence)
            elif next_refresh <= request.arrival_s:
                router.update_loads(
                    [EngineLoad(e.engine_idx, e.num_waiting, e.num_running) for e in engines]
                )
                next_refresh += refresh_s
            else:
                break
        now = request.arrival_s
        request.materialize()
        engine = engines[router.choose(request.prompt_token_ids)]
        engine.add_request(request)
        if not engine.in_step:
            sequence = _start_step(engine, now, heap, sequence)
    # All arrived: no more routing, so no more refreshes.
    while heap:
        now, _, engine_idx = heapq.heappop(heap)
        num_finished += len(engines[engine_idx].finish_step(now))
        sequence = _start_step(engines[engine_idx], now, heap, sequence)
    assert num_finished == len(requests), f"{len(requests) - num_finished} requests stuck"
    return now


def _start_step(engine: SimEngine, now: float, heap: list, sequence: int) -> int:
    duration = engine.start_step()
    if duration is not None:
        heapq.heappush(heap, (now + duration, sequence, engine.engine_idx))
        sequence += 1
    return sequence


def make_engines(
    num_engines: int, config: EngineConfig, step_model: StepTimeModel, hash_fn: HashFn
) -> list[SimEngine]:
    return [SimEngine(i, config, step_model, hash_fn) for i in range(num_engines)]


def summarize(
    requests: list[SimRequest],
    engines: list[SimEngine],
    router_name: str,
    rate_per_s: float,
    makespan_s: float,
    block_size: int,
    warmup_frac: float,
) -> RunMetrics:
    """Metrics over the requests after the first `warmup_frac` (caches start cold)."""
    ideal = ideal_cached_tokens(requests, block_size)
    start = int(len(requests) * warmup_frac)
    measured = requests[start:]
    prompt_tokens = sum(r.prompt_len for r in measured)
    ttft = np.array([r.first_token_s - r.arrival_s for r in measured])
    tpot = np.array(
        [(r.finish_s - r.first_token_s) / (r.output_len - 1) for r in measured if r.output_len > 1]
    )
    busy = np.array([e.busy_s for e in engines])
    routed = np.array([e.num_routed for e in engines])
    return RunMetrics(
        num_engines=len(engines),
        router=router_name,
        num_requests=len(measured),
        rate_per_s=rate_per_s,
        hit_rate=sum(r.num_cached_tokens for r in measured) / prompt_tokens,
        ideal_hit_rate=sum(ideal[start:]) / prompt_tokens,
        ttft_mean_s=float(ttft.mean()),
        ttft_p99_s=float(np.percentile(ttft, 99)),
        tpot_mean_s=float(tpot.mean()) if tpot.size else 0.0,
        busy_skew=float(busy.max() / busy.mean()) if busy.mean() > 0 else 1.0,
        req_skew=float(routed.max() / routed.mean()),
        utilization=float(busy.mean() / makespan_s) if makespan_s > 0 else 0.0,
        num_preemptions=sum(e.num_preemptions for e in engines),
        makespan_s=makespan_s,
    )
