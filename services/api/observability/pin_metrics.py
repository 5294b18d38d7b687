"""Prompt pins on /metrics (kvserve's own series; vLLM has none), read at scrape time from
each engine's SchedulerStats (scheduler/core/prompt_pins.py):

- kvserve:prompt_pinned_blocks             gauge: KV blocks pins hold now
- kvserve:prompt_pin_hits_total{ttl}       pinned prefixes a request found whole in the cache
- kvserve:prompt_pin_misses_total{ttl}     pinned prefixes it had to compute (a write)
- kvserve:prompt_pin_expirations_total     pins whose TTL passed
- kvserve:prompt_pins_yielded_total        pins released early: to the budget
                                           (--max-pinned-cache-fraction) or to a request
"""

from __future__ import annotations

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

LABELS = ["model_name", "engine"]


class PinStatsCollector:
    """
    Args:
        engine_client: its per_engine_stats() gives each engine's latest stats and sums.
        model_name: the `model_name` label.
    """

    def __init__(self, engine_client, model_name: str):
        self.engine_client = engine_client
        self.model_name = model_name

    def collect(self):
        per_engine = self.engine_client.per_engine_stats()
        gauge = GaugeMetricFamily(
            "kvserve:prompt_pinned_blocks",
            "KV-cache blocks held by prompt pins (cache_control, prompt_cache_retention).",
            labels=LABELS,
        )
        hits = CounterMetricFamily(
            "kvserve:prompt_pin_hits",
            "Pinned prompt prefixes found whole in the prefix cache, by TTL class.",
            labels=[*LABELS, "ttl"],
        )
        misses = CounterMetricFamily(
            "kvserve:prompt_pin_misses",
            "Pinned prompt prefixes computed (written) because they were not cached, by TTL class.",
            labels=[*LABELS, "ttl"],
        )
        expired = CounterMetricFamily(
            "kvserve:prompt_pin_expirations", "Prompt pins whose TTL passed.", labels=LABELS
        )
        yielded = CounterMetricFamily(
            "kvserve:prompt_pins_yielded",
            "Prompt pins released before their TTL, to the pin budget or to a request's blocks.",
            labels=LABELS,
        )
        for engine_index, stats, totals in per_engine:
            labels = [self.model_name, str(engine_index)]
            gauge.add_metric(labels, stats.num_pinned_blocks if stats else 0)
            for ttl, count in sorted(totals.pin_hits.items()):
                hits.add_metric([*labels, ttl], count)
            for ttl, count in sorted(totals.pin_misses.items()):
                misses.add_metric([*labels, ttl], count)
            expired.add_metric(labels, totals.num_pins_expired)
            yielded.add_metric(labels, totals.num_pins_yielded)
        yield from (gauge, hits, misses, expired, yielded)
