"""Requests whose prefix a KV connector loads: parked, then admitted holding their blocks.

A waiting request with external prefix hits (`SchedulerConnector.num_external_blocks`) gets
slots for them and waits in `Scheduler.waiting_for_remote_kvs` while the step in flight loads
them (`park_for_load`); the loaded blocks then count as computed (`finish_loads`), and the
request is scheduled from there (`admit_loaded`). Each takes the Scheduler whose queues and
KV cache manager it moves the request between.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Protocol

from kvserve.services.scheduler.core.request import Request, RequestStatus
from kvserve.shared.logging import init_logger

if TYPE_CHECKING:
    from kvserve.services.kv_store.connector import SchedulerConnector
    from kvserve.services.scheduler.core.block_pool import KVCacheBlock
    from kvserve.services.scheduler.core.kv_cache_manager import KVCacheManager
    from kvserve.services.scheduler.core.request_queue import RequestQueue
    from kvserve.services.scheduler.core.step_plan import StepPlan
    from kvserve.shared.config import CacheConfig

logger = init_logger(__name__)


class LoadingScheduler(Protocol):
    """What of the Scheduler these functions use (the Scheduler is one)."""

    kv_connector: SchedulerConnector | None
    kv_cache_manager: KVCacheManager
    cache_config: CacheConfig
    waiting: RequestQueue
    running: list[Request]
    waiting_for_remote_kvs: dict[str, Request]

    def _lora_blocked(self, request: Request, lora_ids: set[int]) -> bool: ...

    def _num_tokens_to_schedule(
        self, request: Request, num_computed_tokens: int, token_budget: int
    ) -> int: ...

    def _plan_add(
        self, plan: StepPlan, request: Request, num_new_tokens: int, new_blocks: list[KVCacheBlock]
    ) -> None: ...


def park_for_load(
    scheduler: LoadingScheduler,
    request: Request,
    hit_blocks: list[KVCacheBlock],
    num_hit_tokens: int,
) -> bool:
    """When the connector can load full blocks past the request's local hits, give the
    request their slots (not yet in the prefix cache) and park it until they arrive.
    True when parked."""
    connector = scheduler.kv_connector
    assert connector is not None
    if request.skip_reading_prefix_cache or request.kv_loaded:
        return False
    num_local_blocks = num_hit_tokens // scheduler.cache_config.block_size
    num_external = connector.num_external_blocks(request, num_local_blocks)
    if num_external <= 0:
        return False
    new_blocks = scheduler.kv_cache_manager.allocate_for_load(
        request, num_external * scheduler.cache_config.block_size, num_hit_tokens, hit_blocks
    )
    if new_blocks is None:
        return False  # no room to load into: compute it as usual
    scheduler.waiting.pop_request()
    request.status = RequestStatus.WAITING_FOR_REMOTE_KVS
    request.num_computed_tokens = num_hit_tokens
    scheduler.waiting_for_remote_kvs[request.req_id] = request
    connector.start_load(request, num_local_blocks, num_external)
    if request.trace is not None:
        request.trace.kv_load_started(time.time_ns(), num_external)
    return True


def finish_loads(scheduler: LoadingScheduler, num_loaded_blocks: dict[str, int]) -> None:
    """Loaded blocks count as computed (and enter the prefix cache); what did not load is
    recomputed. The request goes back to the head of the queue, holding its blocks (with
    KV cache groups, unless a short load left a window without the blocks its recompute
    writes: then it holds none and starts over from the local prefix cache)."""
    for req_id, num_loaded in num_loaded_blocks.items():
        request = scheduler.waiting_for_remote_kvs.pop(req_id, None)
        if request is None:
            continue  # aborted while loading
        num_computed = request.num_computed_tokens + num_loaded * scheduler.cache_config.block_size
        if request.trace is not None:
            request.trace.kv_load_done(time.time_ns(), num_loaded)
        manager = scheduler.kv_cache_manager
        request.kv_loaded = True
        request.status = RequestStatus.WAITING
        if not manager.holds_window_from(request, num_computed):
            # A short load left a windowed group (KV cache groups) without blocks it must
            # recompute into: start over from the local prefix cache.
            logger.info("request %s: the short load leaves a window unfilled; recomputing", req_id)
            manager.free(request)
            request.num_computed_tokens = 0
            scheduler.waiting.prepend_request(request)
            continue
        request.num_computed_tokens = num_computed
        manager.cache_blocks(request, num_computed)
        if request.num_cached_tokens < 0:
            request.num_cached_tokens = request.num_computed_tokens
        scheduler.waiting.prepend_request(request)


def admit_loaded(
    scheduler: LoadingScheduler, request: Request, plan: StepPlan, lora_ids: set[int]
) -> bool:
    """Schedule a request whose prefix loaded: it holds its blocks already. False when it
    cannot run in this step (it stays at the head of the queue)."""
    if scheduler._lora_blocked(request, lora_ids):
        return False
    num_new_tokens = scheduler._num_tokens_to_schedule(
        request, request.num_computed_tokens, plan.token_budget
    )
    new_blocks = scheduler.kv_cache_manager.allocate_slots(request, num_new_tokens)
    if new_blocks is None:
        return False
    scheduler.waiting.pop_request()
    scheduler.running.append(request)
    request.status = RequestStatus.RUNNING
    scheduler._plan_add(plan, request, num_new_tokens, new_blocks)
    plan.scheduled_new.append(request)
    if request.lora_int_id:
        lora_ids.add(request.lora_int_id)
    return True
