"""Prompt pins: prefix-cache blocks held out of LRU eviction for a TTL.

A request may carry pins (EngineCoreRequest.pins: Anthropic `cache_control` breakpoints,
OpenAI `prompt_cache_retention`), each the number of leading prompt tokens to keep and for
how long. When the request finishes, the full blocks of each pinned prefix are already
computed and hashed; the pin takes one reference on each, so they stay out of the free
queue (and out of eviction) after the request lets them go:

    request blocks:  [b0 b1 b2 b3 | b4 b5 ...]      pin(num_tokens=70, block_size=16)
                      └── pinned ──┘                 = the 4 full blocks b0..b3

A pin is keyed by the hash of its last block: pinning the same prefix again refreshes it,
as does any prefix-cache hit on that block. A pin ends when its TTL passes (`expire`, each
step), when the budget needs room for a newer one (the oldest yields), or when a running
request needs blocks the free queue lacks (`yield_oldest`, before anyone is preempted): a
request never fails for want of room. Releasing a pin drops its references, tail first, so
its blocks become ordinary LRU blocks, still cached until evicted.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from kvserve.services.scheduler.core.block_pool import BlockPool, KVCacheBlock
from kvserve.services.scheduler.core.kv_cache_manager import KVCacheManager
from kvserve.services.scheduler.core.request import Request
from kvserve.shared.config import CacheConfig
from kvserve.shared.logging import init_logger
from kvserve.shared.messages import PromptPin

logger = init_logger(__name__)


@dataclass(slots=True)
class Pin:
    """One pinned prefix.

    Args:
        blocks: its blocks, in prefix order; the pin holds one reference on each.
        ttl_s: how long it lives after each hit.
        ttl_class: the label its metrics count it under ("5m", "1h", "24h").
        expires_at: the clock's time it ends at unless hit again.
        stored_at: when the KV store last took (or refreshed) it; a hit refreshes the store's
            pin only once a quarter of the TTL has passed since.
    """

    blocks: list[KVCacheBlock]
    ttl_s: float
    ttl_class: str
    expires_at: float
    stored_at: float = 0.0


@dataclass(slots=True)
class PinStats:
    """What the pins did since the last `take_stats`."""

    hits: dict[str, int] = field(default_factory=dict)
    misses: dict[str, int] = field(default_factory=dict)
    num_expired: int = 0
    num_yielded: int = 0


class PinTable:
    """The engine's pinned prefixes, within a budget of blocks.

    Args:
        block_pool: the pool whose blocks are pinned.
        max_pinned_blocks: the most distinct blocks pins may hold (--max-pinned-cache-fraction
            of the cache).
        clock: seconds, monotonic (tests pass their own).

    `on_pin` (set by the scheduler with a KV connector): called with (block hashes, block
    ids, TTL s, save) for a new pin (save True: write the blocks through to the KV store,
    then pin them there) and for a refreshed one (save False: refresh the store's pin).
    """

    on_pin: Callable[[list[bytes], list[int], float, bool], None] | None = None

    def __init__(
        self,
        block_pool: BlockPool,
        max_pinned_blocks: int,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.block_pool = block_pool
        self.max_pinned_blocks = max_pinned_blocks
        self.clock = clock
        # Oldest (least recently pinned or hit) first: the next to yield to the budget.
        self.pins: OrderedDict[bytes, Pin] = OrderedDict()
        # block_id -> how many pins hold it (blocks of nested prefixes are shared).
        self.block_pins: dict[int, int] = {}
        self.stats = PinStats()
        self._next_expiry = float("inf")

    @property
    def num_pinned_blocks(self) -> int:
        return len(self.block_pins)

    # ------------------------------------------------------------------ pinning

    def pin_finished(self, request: Request, manager: KVCacheManager) -> None:
        """Pin a finishing request's prefixes (before `manager` frees its blocks)."""
        self.pin_request(
            request.req_id,
            request.pins,
            manager.req_to_blocks.get(request.req_id, []),
            # Only prompt tokens are pinned, never the reply's.
            min(request.num_computed_tokens, request.num_prompt_tokens),
            max(request.num_cached_tokens, 0),
            manager.block_size,
        )

    def pin_request(
        self,
        req_id: str,
        pins: Sequence[PromptPin],
        blocks: list[KVCacheBlock],
        num_computed_tokens: int,
        num_cached_tokens: int,
        block_size: int,
    ) -> None:
        """Pin a finishing request's prefixes and count each as a hit or a miss.

        Args:
            req_id: for the log.
            pins: the request's breakpoints.
            blocks: the blocks it holds, in order (still referenced by it).
            num_computed_tokens: tokens whose K/V it computed or hit.
            num_cached_tokens: its prefix-cache hit at the first schedule.
            block_size: tokens per block.
        """
        for prompt_pin in pins:
            num_blocks = min(prompt_pin.num_tokens, num_computed_tokens) // block_size
            prefix = blocks[:num_blocks]
            if not prefix or any(block.block_hash is None for block in prefix):
                continue  # too short for a full block, or not cached (prefix caching off)
            counts = (
                self.stats.hits
                if num_cached_tokens >= num_blocks * block_size
                else (self.stats.misses)
            )
            counts[prompt_pin.ttl_class] = counts.get(prompt_pin.ttl_class, 0) + 1
            self.pin(prefix, prompt_pin.ttl_s, prompt_pin.ttl_class, req_id)

    def pin(self, blocks: list[KVCacheBlock], ttl_s: float, ttl_class: str, req_id: str) -> bool:
        """Pin `blocks` (a cached prefix) for `ttl_s`, or refresh the pin that holds it.

        Returns:
            False when the prefix alone is larger than the whole budget (nothing pinned).
        """
        key = blocks[-1].block_hash
        assert key is not None, "only cached blocks are pinned"
        now = self.clock()
        existing = self.pins.get(key)
        if existing is not None:
            existing.ttl_s = max(existing.ttl_s, ttl_s)
            self._refresh(key, existing, now)
            return True
        if len(blocks) > self.max_pinned_blocks:
            logger.info(
                "request %s: a %d-block prefix exceeds the pin budget (%d blocks); not pinned",
                req_id,
                len(blocks),
                self.max_pinned_blocks,
            )
            return False
        while self.pins and self.num_pinned_blocks + self._num_new(blocks) > self.max_pinned_blocks:
            self._release_oldest("it yielded to the pin budget")
        self.block_pool.touch(blocks)
        for block in blocks:
            self.block_pins[block.block_id] = self.block_pins.get(block.block_id, 0) + 1
        self.pins[key] = Pin(list(blocks), ttl_s, ttl_class, now + ttl_s, stored_at=now)
        self._next_expiry = min(self._next_expiry, now + ttl_s)
        if self.on_pin is not None:
            self.on_pin(*self._hashes_and_ids(blocks), ttl_s, True)
        logger.info(
            "request %s pinned %d blocks for %gs (%s)", req_id, len(blocks), ttl_s, ttl_class
        )
        return True

    def refresh_hits(self, hit_blocks: list[KVCacheBlock]) -> None:
        """A prefix-cache hit refreshes every pin whose last block it read."""
        if not self.pins:
            return
        now = self.clock()
        for block in hit_blocks:
            pin = self.pins.get(block.block_hash) if block.block_hash is not None else None
            if pin is not None and block.block_hash is not None:
                self._refresh(block.block_hash, pin, now)

    def _refresh(self, key: bytes, pin: Pin, now: float) -> None:
        pin.expires_at = max(pin.expires_at, now + pin.ttl_s)
        self.pins.move_to_end(key)
        if self.on_pin is not None and now - pin.stored_at >= pin.ttl_s / 4:
            pin.stored_at = now
            self.on_pin(*self._hashes_and_ids(pin.blocks), pin.ttl_s, False)

    @staticmethod
    def _hashes_and_ids(blocks: list[KVCacheBlock]) -> tuple[list[bytes], list[int]]:
        hashes = [block.block_hash for block in blocks if block.block_hash is not None]
        return hashes, [block.block_id for block in blocks]

    # ------------------------------------------------------------------ ending pins

    def expire(self) -> int:
        """Release the pins whose TTL has passed; returns how many."""
        now = self.clock()
        if now < self._next_expiry:
            return 0
        expired = [key for key, pin in self.pins.items() if pin.expires_at <= now]
        for key in expired:
            self._release(key, "its TTL passed")
        self.stats.num_expired += len(expired)
        self._next_expiry = min(
            (pin.expires_at for pin in self.pins.values()), default=float("inf")
        )
        return len(expired)

    def yield_oldest(self) -> bool:
        """Release the oldest pin so a request can have its blocks; False when none is left."""
        if not self.pins:
            return False
        self._release_oldest("a request needed its blocks")
        return True

    def release_all(self) -> None:
        """Drop every pin (a prefix-cache reset)."""
        for key in list(self.pins):
            self._release(key, "the prefix cache was reset")

    def take_stats(self) -> PinStats:
        stats, self.stats = self.stats, PinStats()
        return stats

    def _num_new(self, blocks: list[KVCacheBlock]) -> int:
        return sum(1 for block in blocks if block.block_id not in self.block_pins)

    def _release_oldest(self, reason: str) -> None:
        self._release(next(iter(self.pins)), reason)
        self.stats.num_yielded += 1

    def _release(self, key: bytes, reason: str) -> None:
        pin = self.pins.pop(key)
        for block in pin.blocks:
            count = self.block_pins[block.block_id] - 1
            if count:
                self.block_pins[block.block_id] = count
            else:
                del self.block_pins[block.block_id]
        # Tail first, as a request frees: the head of the prefix stays cached longest.
        self.block_pool.free_blocks(reversed(pin.blocks))
        logger.info("a %d-block pin (%s) ended: %s", len(pin.blocks), pin.ttl_class, reason)


def make_pin_table(manager: object, cache_config: CacheConfig) -> PinTable | None:
    """The scheduler's pin table over `manager`'s pool, which then refreshes pins on its
    prefix hits; None where pins cannot work: prefix caching off, KV cache groups (several
    block tables), or a zero budget."""
    fraction = cache_config.max_pinned_cache_fraction
    if not 0.0 <= fraction <= 1.0:
        raise ValueError(f"--max-pinned-cache-fraction must be in [0, 1], got {fraction}")
    if not (
        type(manager) is KVCacheManager
        and cache_config.enable_prefix_caching
        and cache_config.max_pinned_cache_fraction > 0
    ):
        return None
    budget = int(fraction * manager.num_total_blocks)
    table = PinTable(manager.block_pool, budget)
    manager.pins = table
    return table
