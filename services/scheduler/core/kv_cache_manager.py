"""Which KV-cache blocks each request holds: prefix lookup, allocation and freeing."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from kvserve.services.scheduler.core.block_pool import BlockPool, KVCacheBlock
from kvserve.services.scheduler.core.request import Request
from kvserve.shared.kv_cache_groups import KVCacheGroupSpec
from kvserve.shared.kv_events import KVEvent


class HitListener(Protocol):
    """Told of every prefix-cache hit (the prompt pins, which hits refresh)."""

    def refresh_hits(self, hit_blocks: list[KVCacheBlock]) -> None: ...


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(slots=True)
class PrefixCacheStats:
    """Prefix-cache lookups since the last reset, in tokens."""

    num_requests: int = 0
    num_queried_tokens: int = 0
    num_hit_tokens: int = 0


class KVCacheManager:
    """Maps requests to blocks of one BlockPool.

    Args:
        num_blocks: blocks in the cache, the null block included.
        block_size: tokens per block.
        enable_caching: reuse blocks of shared prefixes.
        max_model_len: longest sequence; no request may hold more than
            ceil(max_model_len / block_size) blocks.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_caching: bool = True,
        max_model_len: int | None = None,
    ) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.max_model_len = max_model_len
        self.block_pool = BlockPool(num_blocks, enable_caching)
        # One group of every layer, keyed by the request's own hashes (what a KV connector
        # walks; GroupedKVCacheManager has several).
        self.groups = [KVCacheGroupSpec(layer_indices=[])]
        self.hash_suffixes = [b""]
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # How many leading blocks of each request are registered in the prefix cache.
        self.num_cached_block: dict[str, int] = {}
        self.prefix_cache_stats = PrefixCacheStats()
        # Prompt pins, refreshed by the hits here (set by prompt_pins.make_pin_table).
        self.pins: HitListener | None = None

    # ------------------------------------------------------------------ prefix lookup

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """The longest cached prefix of a request that holds no blocks yet.

        The last token is always recomputed (its logits are needed to sample), so at most
        (num_tokens - 1) // block_size blocks can hit. The blocks are not touched here: pass
        them to `allocate_slots`, before anything else allocates.

        Returns:
            (the hit blocks, the number of tokens they hold).
        """
        if not self.enable_caching or request.skip_reading_prefix_cache:
            return [], 0
        max_num_hit_blocks = (request.num_tokens - 1) // self.block_size
        blocks = self.find_longest_cache_hit(request.block_hashes[:max_num_hit_blocks])
        num_hit_tokens = len(blocks) * self.block_size
        if self.pins is not None:
            self.pins.refresh_hits(blocks)
        self.prefix_cache_stats.num_requests += 1
        self.prefix_cache_stats.num_queried_tokens += request.num_tokens
        self.prefix_cache_stats.num_hit_tokens += num_hit_tokens
        return blocks, num_hit_tokens

    def find_longest_cache_hit(self, block_hashes: list[bytes]) -> list[KVCacheBlock]:
        """Walk the hash chain until the first miss; each hash implies its whole prefix."""
        blocks = []
        for block_hash in block_hashes:
            block = self.block_pool.get_cached_block(block_hash)
            if block is None:
                break
            blocks.append(block)
        return blocks

    # ------------------------------------------------------------------ allocation

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: list[KVCacheBlock] | None = None,
        num_lookahead_tokens: int = 0,
        cache_new_blocks: bool = True,
    ) -> list[KVCacheBlock] | None:
        """Give a request blocks for `num_new_tokens` more tokens, or fail without side effects.

            | computed (held) | new computed (prefix hit) | new tokens  | ... |
            0        request.num_computed_tokens     + num_new_computed  + num_new_tokens

        Full blocks are registered in the prefix cache as soon as they are allocated, even
        those this step only computes: every layer writes all of the step's K/V before it
        attends, so a request that hits them in the same step reads written slots.

        Args:
            request: the request to grow.
            num_new_tokens: tokens to compute this step (> 0).
            num_new_computed_tokens: prefix-hit tokens from `get_computed_blocks`.
            new_computed_blocks: the hit blocks from `get_computed_blocks`.
            num_lookahead_tokens: slots past the new tokens that a draft model writes after
                the step (speculative decoding); never part of the prefix cache.
            cache_new_blocks: register the full new blocks in the prefix cache now; False
                for blocks a KV connector still has to load (`cache_blocks` registers them
                once they hold their data).

        Returns:
            The newly allocated blocks (possibly empty), or None if the pool lacks blocks.
        """
        if num_new_tokens <= 0:
            raise ValueError(f"num_new_tokens must be positive, got {num_new_tokens}")
        new_computed_blocks = new_computed_blocks or []
        held_blocks = self.req_to_blocks.get(request.req_id, [])
        assert not (new_computed_blocks and held_blocks), (
            f"{request} already holds blocks; prefix hits apply to new requests only"
        )
        num_computed_tokens = request.num_computed_tokens + num_new_computed_tokens
        num_tokens_with_slots = num_computed_tokens + num_new_tokens + num_lookahead_tokens
        assert self.max_model_len is None or num_tokens_with_slots <= self.max_model_len, (
            f"{request} would hold {num_tokens_with_slots} > max_model_len tokens"
        )

        num_required_blocks = cdiv(num_tokens_with_slots, self.block_size)
        num_blocks_to_allocate = max(
            0, num_required_blocks - len(held_blocks) - len(new_computed_blocks)
        )
        # Hit blocks that sit in the free queue leave it when touched, so they count too.
        num_evictable_hit_blocks = sum(1 for block in new_computed_blocks if block.ref_cnt == 0)
        if (
            num_blocks_to_allocate + num_evictable_hit_blocks
            > self.block_pool.get_num_free_blocks()
        ):
            return None

        if request.req_id not in self.req_to_blocks:
            self.req_to_blocks[request.req_id] = held_blocks
            self.num_cached_block[request.req_id] = 0
        if new_computed_blocks:
            self.block_pool.touch(new_computed_blocks)
            held_blocks.extend(new_computed_blocks)
            self.num_cached_block[request.req_id] = len(held_blocks)
        new_blocks = self.block_pool.get_new_blocks(num_blocks_to_allocate)
        held_blocks.extend(new_blocks)

        if self.enable_caching and cache_new_blocks:
            self._cache_full_blocks(request, held_blocks, num_tokens_with_slots)
        return new_blocks

    def allocate_for_load(
        self,
        request: Request,
        num_load_tokens: int,
        num_hit_tokens: int,
        hit_blocks: list[KVCacheBlock],
    ) -> list[KVCacheBlock] | None:
        """Slots for `num_load_tokens` that a KV connector loads past a new request's prefix
        hit, kept out of the prefix cache until they hold their data (`cache_blocks`)."""
        return self.allocate_slots(
            request, num_load_tokens, num_hit_tokens, hit_blocks, cache_new_blocks=False
        )

    def holds_window_from(self, request: Request, num_computed_tokens: int) -> bool:
        """Whether the request holds every block its queries from `num_computed_tokens` on
        read (after a short load; one table always does)."""
        return True

    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        """Register the request's full blocks up to `num_tokens` in the prefix cache (blocks
        loaded by a KV connector, now that they hold their data)."""
        if self.enable_caching and request.req_id in self.req_to_blocks:
            self._cache_full_blocks(request, self.req_to_blocks[request.req_id], num_tokens)

    def _cache_full_blocks(
        self, request: Request, blocks: list[KVCacheBlock], num_tokens_with_slots: int
    ) -> None:
        # Blocks past the request's known tokens (speculative slots) have no hash yet.
        num_full_blocks = min(num_tokens_with_slots // self.block_size, len(request.block_hashes))
        num_cached_blocks = self.num_cached_block[request.req_id]
        if num_full_blocks > num_cached_blocks:
            self.block_pool.cache_full_blocks(request, blocks, num_cached_blocks, num_full_blocks)
            self.num_cached_block[request.req_id] = num_full_blocks

    def free(self, request: Request) -> None:
        """Release all of a request's blocks (no-op if it holds none)."""
        blocks = self.req_to_blocks.pop(request.req_id, [])
        self.num_cached_block.pop(request.req_id, None)
        # Tail blocks go back first, so they are evicted first: the shared head of a prefix
        # stays cached longest.
        self.block_pool.free_blocks(reversed(blocks))

    # ------------------------------------------------------------------ queries

    def get_block_ids(self, req_id: str) -> list[int]:
        return [block.block_id for block in self.req_to_blocks.get(req_id, ())]

    def get_group_block_ids(self, req_id: str) -> list[list[int]]:
        """Each group's block table (here the one table)."""
        return [self.get_block_ids(req_id)]

    def enable_kv_events(self) -> None:
        """Collect prefix-cache events (--kv-events-config); `take_events` drains them."""
        self.block_pool.enable_kv_events(self.block_size)

    def take_events(self) -> list[KVEvent]:
        return self.block_pool.take_events()

    def reset_prefix_cache(self) -> bool:
        return self.block_pool.reset_prefix_cache()

    def make_prefix_cache_stats(self) -> PrefixCacheStats:
        """The stats since the last call, then start counting afresh."""
        stats, self.prefix_cache_stats = self.prefix_cache_stats, PrefixCacheStats()
        return stats

    @property
    def usage(self) -> float:
        return self.block_pool.get_usage()

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.get_num_free_blocks()

    @property
    def num_total_blocks(self) -> int:
        """Allocatable blocks (the null block excluded): num_free_blocks when nothing is held."""
        return self.block_pool.num_blocks - 1
