"""What the status page costs the api process: per engine step, per reading, per poll.

Drives the shipped DashboardSampler and dashboard_state over a real ApiMetrics (an engine
client without engines, as the unit tests build it), with a full window of readings (one a
second over WINDOW_S). Prints one JSON object: microseconds per call (best of --repeats)
and the JSON body's size.

    .venv/bin/python bench/dashboard_cost.py
"""

from __future__ import annotations

import argparse
import json
import timeit
from types import SimpleNamespace

import msgspec

from kvserve.services.api.engine_client.client import EngineClient
from kvserve.services.api.observability.dashboard import dashboard_state
from kvserve.services.api.observability.dashboard_sampler import WINDOW_S, DashboardSampler
from kvserve.services.api.observability.metrics import ApiMetrics
from kvserve.services.api.observability.stats import IterationStats
from kvserve.shared.messages import SchedulerStats


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _best_us(call, number: int, repeats: int) -> float:
    return min(timeit.repeat(call, number=number, repeat=repeats)) / number * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()

    client = EngineClient(SimpleNamespace(tokenizer=None), max_model_len=4096, model_name="m")
    metrics = ApiMetrics(client, "m")
    clock = _Clock()
    sampler = DashboardSampler(client, metrics, clock=clock)
    stats = SchedulerStats(num_running_reqs=8, kv_cache_usage=0.3, prefix_cache_queries=64)
    iteration = IterationStats(now=0.0, engine_timestamp=0.0)
    iteration.time_to_first_tokens = [0.05]
    iteration.inter_token_latencies = [0.02] * 8
    iteration.num_generation_tokens = 8
    client.latest_stats = stats
    for _ in range(int(WINDOW_S) + 30):  # a full window of readings, one a second
        clock.now += 1.0
        metrics.record(0, stats, iteration)
        client.stats_totals.add(stats)
        sampler.sample()
    state = dashboard_state(sampler, "m", "dev", show_tenants=True)
    result = {
        "num_readings": len(sampler.readings),
        # An engine step within the interval (the common case): a clock read and a compare.
        "record_throttled_us": _best_us(
            lambda: sampler.record(0, stats, iteration), 100_000, args.repeats
        ),
        # ApiMetrics' own work for the same step, for scale.
        "api_metrics_record_us": _best_us(
            lambda: metrics.record(0, stats, iteration), 10_000, args.repeats
        ),
        "reading_us": _best_us(sampler.read, 2_000, args.repeats),
        "state_poll_us": _best_us(
            lambda: msgspec.json.encode(dashboard_state(sampler, "m", "dev", True)),
            200,
            args.repeats,
        ),
        "state_json_bytes": len(msgspec.json.encode(state)),
    }
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
