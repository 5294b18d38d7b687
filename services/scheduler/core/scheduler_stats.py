"""A step's SchedulerStats: the scheduler's load and counters, as the api's metrics read them."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, Protocol

from kvserve.services.scheduler.core.request import Request
from kvserve.shared.messages import SchedulerStats

if TYPE_CHECKING:
    from kvserve.services.kv_store.connector import SchedulerConnector
    from kvserve.services.scheduler.core.kv_cache_manager import KVCacheManager
    from kvserve.services.scheduler.core.latency_targets import LatencyTargets
    from kvserve.services.scheduler.core.prompt_pins import PinTable
    from kvserve.services.scheduler.core.request_queue import RequestQueue
    from kvserve.services.scheduler.core.spec_scheduler import SpecDecodeScheduler
    from kvserve.services.scheduler.structured_output.manager import StructuredOutputManager
    from kvserve.shared.config import LoRAConfig


class StatsSource(Protocol):
    """What of the Scheduler the stats read (the Scheduler is one)."""

    running: list[Request]
    waiting: RequestQueue
    waiting_for_grammar: dict[str, Request]
    kv_cache_manager: KVCacheManager
    structured_output_manager: StructuredOutputManager | None
    lora_config: LoRAConfig | None
    spec_decode: SpecDecodeScheduler | None
    kv_connector: SchedulerConnector | None
    latency: LatencyTargets
    pins: PinTable | None


def make_scheduler_stats(
    scheduler: StatsSource, num_preemptions: int, num_scheduled_tokens: int
) -> SchedulerStats:
    """The scheduler's load now, with the counters each feature kept since the last call
    (they restart).

    Args:
        scheduler: the Scheduler.
        num_preemptions: preemptions since the last call.
        num_scheduled_tokens: tokens scheduled since the last call.
    """
    prefix_stats = scheduler.kv_cache_manager.make_prefix_cache_stats()
    grammar_queries, grammar_hits, compile_times = 0, 0, list[float]()
    if scheduler.structured_output_manager is not None:
        grammar_queries, grammar_hits, compile_times = (
            scheduler.structured_output_manager.take_stats()
        )
    running, waiting = scheduler.running, scheduler.waiting
    waiting_for_grammar = scheduler.waiting_for_grammar
    has_lora = scheduler.lora_config is not None
    return SchedulerStats(
        num_running_reqs=len(running),
        num_waiting_reqs=len(waiting) + len(waiting_for_grammar),
        kv_cache_usage=scheduler.kv_cache_manager.usage,
        num_preemptions=num_preemptions,
        prefix_cache_queries=prefix_stats.num_queried_tokens,
        prefix_cache_hits=prefix_stats.num_hit_tokens,
        num_scheduled_tokens=num_scheduled_tokens,
        num_waiting_for_grammar=len(waiting_for_grammar),
        grammar_cache_queries=grammar_queries,
        grammar_cache_hits=grammar_hits,
        grammar_compile_times=compile_times,
        running_lora_adapters=count_adapters(running) if has_lora else {},
        waiting_lora_adapters=count_adapters(waiting) if has_lora else {},
        running_by_tenant=count_tenants(running),
        waiting_by_tenant=count_tenants([*waiting, *waiting_for_grammar.values()]),
        step_time_prediction_error=scheduler.latency.model.relative_error,
        **(scheduler.spec_decode.take_stats() if scheduler.spec_decode is not None else {}),
        **(scheduler.kv_connector.take_stats() if scheduler.kv_connector is not None else {}),
        **pin_stats(scheduler.pins),
    )


def pin_stats(pins: PinTable | None) -> dict[str, Any]:
    """The pins' SchedulerStats fields (none without a pin table)."""
    if pins is None:
        return {}
    stats = pins.take_stats()
    return {
        "num_pinned_blocks": pins.num_pinned_blocks,
        "pin_hits": stats.hits,
        "pin_misses": stats.misses,
        "num_pins_expired": stats.num_expired,
        "num_pins_yielded": stats.num_yielded,
    }


def count_tenants(requests: Iterable[Request]) -> dict[str, int]:
    """Requests per tenant name."""
    counts: dict[str, int] = {}
    for request in requests:
        counts[request.tenant] = counts.get(request.tenant, 0) + 1
    return counts


def count_adapters(requests: Iterable[Request]) -> dict[str, int]:
    """Requests per adapter name (the base model's are not counted)."""
    counts: dict[str, int] = {}
    for request in requests:
        if request.lora_request is not None:
            name = request.lora_request.lora_name
            counts[name] = counts.get(name, 0) + 1
    return counts
