"""Prompt pins on the real Scheduler and KV cache manager: an LRU flood spares a pinned
prefix, a pin ends at its TTL (refreshed by hits), the budget's oldest pin yields, pins
yield to a request's blocks, and no block leaks once the pins are gone."""

from __future__ import annotations

import itertools

import msgspec

from kvserve.shared.messages import PromptPin
from tests.support.kv import assert_no_leaked_blocks
from tests.support.scheduler import create_request, create_scheduler, run_to_completion

BLOCK_SIZE = 16
NUM_BLOCKS = 21  # 20 usable
_floods = itertools.count()


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _scheduler(fraction: float = 0.5):
    scheduler = create_scheduler(
        num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE, max_pinned_cache_fraction=fraction
    )
    clock = FakeClock()
    assert scheduler.pins is not None
    scheduler.pins.clock = clock
    return scheduler, clock


def _prefix(first: int, num_tokens: int = 4 * BLOCK_SIZE) -> list[int]:
    return list(range(first, first + num_tokens))


def _run(scheduler, req_id, prompt, pins=(), max_tokens=1):
    request = create_request(req_id, prompt_token_ids=prompt, max_tokens=max_tokens)
    request = msgspec.structs.replace(request, pins=list(pins))
    scheduler.add_request(request)
    return run_to_completion(scheduler)[req_id]


def _flood(scheduler, tag: str) -> None:
    """Unique prompts that take every free block in turn: the whole LRU queue is evicted."""
    num_flood_tokens = (scheduler.kv_cache_manager.num_free_blocks - 1) * BLOCK_SIZE
    for index in range(2):
        first = 1_000_000 + 10_000 * next(_floods)
        _run(scheduler, f"flood-{tag}-{index}", _prefix(first, num_flood_tokens))


def _release_and_check_leaks(scheduler) -> None:
    scheduler.pins.release_all()
    assert scheduler.pins.num_pinned_blocks == 0
    assert_no_leaked_blocks(scheduler)


def test_a_pinned_prefix_outlives_a_flood_that_evicts_an_unpinned_one():
    scheduler, _ = _scheduler()
    pinned, unpinned = _prefix(100), _prefix(20_000)
    pin = PromptPin(num_tokens=len(pinned), ttl_s=300.0, ttl_class="5m")
    assert _run(scheduler, "write", [*pinned, 1, 2], [pin]).num_cached_tokens == 0
    _run(scheduler, "plain", [*unpinned, 1, 2])
    assert scheduler.pins.num_pinned_blocks == 4
    _flood(scheduler, "a")
    assert _run(scheduler, "read", [*pinned, 3, 4], [pin]).num_cached_tokens == len(pinned)
    assert _run(scheduler, "gone", [*unpinned, 3, 4]).num_cached_tokens == 0
    stats = scheduler.make_stats()
    assert stats.num_pinned_blocks == 4
    assert stats.pin_misses == {"5m": 1} and stats.pin_hits == {"5m": 1}
    _release_and_check_leaks(scheduler)


def test_a_pin_ends_at_its_ttl_and_a_hit_refreshes_it():
    scheduler, clock = _scheduler()
    prefix = _prefix(100)
    pin = PromptPin(num_tokens=len(prefix), ttl_s=300.0, ttl_class="5m")
    _run(scheduler, "write", [*prefix, 1], [pin])
    clock.now += 200
    # A hit without pins of its own still refreshes the pin it reads.
    assert _run(scheduler, "hit", [*prefix, 2]).num_cached_tokens == len(prefix)
    clock.now += 200  # 400 s after the write, 200 s after the hit
    _flood(scheduler, "b")
    assert scheduler.pins.num_pinned_blocks == 4
    clock.now += 101
    _flood(scheduler, "c")  # the step that schedules it expires the pin first
    assert scheduler.pins.num_pinned_blocks == 0
    assert scheduler.make_stats().num_pins_expired == 1
    assert _run(scheduler, "after", [*prefix, 3]).num_cached_tokens == 0
    assert_no_leaked_blocks(scheduler)


def test_the_oldest_pin_yields_to_the_budget():
    scheduler, _ = _scheduler(fraction=0.25)  # 5 of 20 blocks
    first, second = _prefix(100), _prefix(20_000)
    _run(scheduler, "a", [*first, 1], [PromptPin(len(first), 3600.0, "1h")])
    _run(scheduler, "b", [*second, 1], [PromptPin(len(second), 300.0, "5m")])
    assert scheduler.pins.num_pinned_blocks == 4
    assert list(scheduler.pins.pins.values())[0].ttl_class == "5m"
    assert scheduler.make_stats().num_pins_yielded == 1
    # A prefix larger than the whole budget is not pinned at all.
    big = _prefix(40_000, 6 * BLOCK_SIZE)
    _run(scheduler, "big", [*big, 1], [PromptPin(len(big), 300.0, "5m")])
    assert scheduler.pins.num_pinned_blocks == 4
    _release_and_check_leaks(scheduler)


def test_pins_yield_to_a_request_that_needs_their_blocks():
    scheduler, _ = _scheduler(fraction=1.0)
    for index in range(4):
        prefix = _prefix(100 + 10_000 * index)
        _run(scheduler, f"pin{index}", [*prefix, 1], [PromptPin(len(prefix), 300.0, "5m")])
    assert scheduler.pins.num_pinned_blocks == 16
    # 18 blocks of prompt: it runs (never fails) once enough pins yielded.
    final = _run(scheduler, "big", _prefix(900_000, 18 * BLOCK_SIZE - 3), max_tokens=2)
    assert final.finish_reason is not None and final.error is None
    assert scheduler.pins.num_pinned_blocks <= 20 - 18
    assert scheduler.make_stats().num_pins_yielded >= 3
    _release_and_check_leaks(scheduler)


def test_nested_breakpoints_share_blocks_and_a_repin_refreshes():
    scheduler, clock = _scheduler()
    prefix = _prefix(100, 6 * BLOCK_SIZE)
    pins = [
        PromptPin(2 * BLOCK_SIZE + 5, 3600.0, "1h"),
        PromptPin(len(prefix), 300.0, "5m"),
    ]
    _run(scheduler, "a", [*prefix, 1], pins)
    assert len(scheduler.pins.pins) == 2
    assert scheduler.pins.num_pinned_blocks == 6  # the 2 blocks of the short one are shared
    clock.now += 299
    _run(scheduler, "b", [*prefix, 2], pins)
    assert len(scheduler.pins.pins) == 2
    clock.now += 299
    scheduler.pins.expire()
    assert scheduler.pins.num_pinned_blocks == 6
    clock.now += 3600
    scheduler.pins.expire()
    assert scheduler.pins.num_pinned_blocks == 0
    assert_no_leaked_blocks(scheduler)


def test_reset_prefix_cache_drops_the_pins():
    scheduler, _ = _scheduler()
    prefix = _prefix(100)
    _run(scheduler, "a", [*prefix, 1], [PromptPin(len(prefix), 300.0, "5m")])
    assert scheduler.reset_prefix_cache()
    assert scheduler.pins.num_pinned_blocks == 0
    assert_no_leaked_blocks(scheduler)


def test_no_pin_table_without_prefix_caching_or_budget():
    assert create_scheduler(enable_prefix_caching=False).pins is None
    assert create_scheduler(max_pinned_cache_fraction=0.0).pins is None


def test_a_new_pin_is_written_through_and_a_later_hit_refreshes_the_store():
    scheduler, clock = _scheduler()
    calls = []
    scheduler.pins.on_pin = lambda hashes, ids, ttl_s, save: calls.append(
        (len(hashes), ttl_s, save)
    )
    prefix = _prefix(100)
    _run(scheduler, "a", [*prefix, 1], [PromptPin(len(prefix), 300.0, "5m")])
    assert calls == [(4, 300.0, True)]
    clock.now += 10  # too soon to refresh the store's pin
    _run(scheduler, "b", [*prefix, 2])
    clock.now += 100
    _run(scheduler, "c", [*prefix, 3])
    assert calls == [(4, 300.0, True), (4, 300.0, False)]
    _release_and_check_leaks(scheduler)
