"""Blocks per KV cache group: sliding-window and chunked-local groups give back what their
layers no longer read (shared/kv_cache_groups.py says what a group is).

Every group of a request has a block table of the same length, ceil(tokens / block_size);
a block that fell out of its group's window is given back to the pool and its place in the
table holds the null block (block 0, never read: the attention kernels skip or mask keys
before the window). Window 16, block size 4, 26 tokens computed:

    full group:     [ 3  7  9  2  8  5  1]
    sliding group:  [ 0  0  0  6 11 12 4]   keys from 26 - 16 + 1 = 11 on: blocks 2.. needed
                                             (block 2 went back when the first query passed 20)

A prefix hit covers k blocks when every full group has all k and every other group has the
blocks its first query past them reads; each group keys its blocks under the request's hashes
plus its own suffix, so a window's early blocks being gone never makes a hit claim them.
Block ids leave the manager group-major: G equal slices, group 0 first.
"""

from __future__ import annotations

from kvserve.services.scheduler.core.block_pool import KVCacheBlock
from kvserve.services.scheduler.core.kv_cache_manager import KVCacheManager, cdiv
from kvserve.services.scheduler.core.request import Request
from kvserve.shared.kv_cache_groups import KVCacheGroupSpec, hash_suffix


class GroupedKVCacheManager(KVCacheManager):
    """A KVCacheManager whose requests hold one block table per KV cache group, from one pool.

    The lists it takes and returns (`get_computed_blocks`' hits, `allocate_slots`' new
    blocks, `get_block_ids`) are group-major: G equal slices, one per group.

    Args:
        num_blocks, block_size, enable_caching, max_model_len: as KVCacheManager's.
        groups: the model's KV cache groups (the worker's `kv_cache_groups`).
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        groups: list[KVCacheGroupSpec],
        enable_caching: bool = True,
        max_model_len: int | None = None,
    ) -> None:
        super().__init__(num_blocks, block_size, enable_caching, max_model_len)
        self.groups = groups
        self.num_groups = len(groups)
        # Group 0 keys blocks under the request's hashes, group g under hash + g.
        self.hash_suffixes = [hash_suffix(g) for g in range(len(groups))]
        self.req_to_group_blocks: dict[str, list[list[KVCacheBlock]]] = {}
        # Per request and group: the leading places already null (given back or never
        # needed), so each step looks only at the blocks that left the window since.
        self.num_null_blocks: dict[str, list[int]] = {}

    # ------------------------------------------------------------------ prefix lookup

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """The longest cached prefix every group can serve (see the module docstring), as
        group-major hit blocks (null where a group no longer needs a block)."""
        if not self.enable_caching or request.skip_reading_prefix_cache:
            return [], 0
        max_num_hit_blocks = (request.num_tokens - 1) // self.block_size
        hashes = request.block_hashes[:max_num_hit_blocks]
        num_hit_blocks = len(hashes)
        lookups: list[list[KVCacheBlock | None]] = [[] for _ in self.groups]
        for g, group in enumerate(self.groups):
            if group.is_full:  # a chain: each hash implies its whole prefix
                lookups[g] = list(self._walk_chain(hashes[:num_hit_blocks], self.hash_suffixes[g]))
                num_hit_blocks = min(num_hit_blocks, len(lookups[g]))
        for g, group in enumerate(self.groups):
            if not group.is_full:  # any block may be gone: look each one up
                suffix = self.hash_suffixes[g]
                pool = self.block_pool
                lookups[g] = [pool.get_cached_block(h + suffix) for h in hashes[:num_hit_blocks]]
        last_misses = [_last_miss_before(found) for found in lookups]
        while num_hit_blocks > 0 and not self._all_groups_hit(last_misses, num_hit_blocks):
            num_hit_blocks -= 1
        blocks = []
        for group, found in zip(self.groups, lookups):
            first = self._first_needed_block(group, num_hit_blocks * self.block_size)
            blocks.extend([self.block_pool.null_block] * first)
            blocks.extend(block for block in found[first:num_hit_blocks] if block is not None)
        num_hit_tokens = num_hit_blocks * self.block_size
        self.prefix_cache_stats.num_requests += 1
        self.prefix_cache_stats.num_queried_tokens += request.num_tokens
        self.prefix_cache_stats.num_hit_tokens += num_hit_tokens
        return blocks, num_hit_tokens

    def _walk_chain(self, block_hashes: list[bytes], suffix: bytes) -> list[KVCacheBlock]:
        blocks = []
        for block_hash in block_hashes:
            block = self.block_pool.get_cached_block(block_hash + suffix)
            if block is None:
                break
            blocks.append(block)
        return blocks

    def _all_groups_hit(self, last_misses: list[list[int]], num_blocks: int) -> bool:
        """Every group holds the blocks that a query at token num_blocks * block_size reads
        (`last_misses[g][k]`: group g's last missing block before block k, -1 if none)."""
        for group, last_miss in zip(self.groups, last_misses):
            if last_miss[num_blocks] >= self._first_needed_block(
                group, num_blocks * self.block_size
            ):
                return False
        return True

    def _first_needed_block(self, group: KVCacheGroupSpec, num_computed_tokens: int) -> int:
        return group.first_needed_token(num_computed_tokens) // self.block_size

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
        """KVCacheManager.allocate_slots per group: first the blocks that fell out of a
        window go back (they are not read again, whether or not this allocation succeeds),
        then each group gets the same number of new blocks. Returns them group-major."""
        if num_new_tokens <= 0:
            raise ValueError(f"num_new_tokens must be positive, got {num_new_tokens}")
        num_groups = self.num_groups
        hit_blocks = new_computed_blocks or []
        held = self.req_to_group_blocks.get(request.req_id)
        assert not (hit_blocks and held), (
            f"{request} already holds blocks; prefix hits apply to new requests only"
        )
        num_computed_tokens = request.num_computed_tokens + num_new_computed_tokens
        num_tokens_with_slots = num_computed_tokens + num_new_tokens + num_lookahead_tokens
        assert self.max_model_len is None or num_tokens_with_slots <= self.max_model_len, (
            f"{request} would hold {num_tokens_with_slots} > max_model_len tokens"
        )
        if held is not None:
            self._free_out_of_window(request.req_id, held, num_computed_tokens)
        num_held = len(held[0]) if held is not None else len(hit_blocks) // num_groups
        num_new_per_group = max(0, cdiv(num_tokens_with_slots, self.block_size) - num_held)
        num_evictable_hit_blocks = sum(
            1 for block in hit_blocks if block.ref_cnt == 0 and not block.is_null
        )
        if (
            num_groups * num_new_per_group + num_evictable_hit_blocks
            > self.block_pool.get_num_free_blocks()
        ):
            return None

        if held is None:
            held = [hit_blocks[g * num_held : (g + 1) * num_held] for g in range(num_groups)]
            self.req_to_group_blocks[request.req_id] = held
            self.num_null_blocks[request.req_id] = [
                sum(1 for block in blocks if block.is_null) for blocks in held
            ]
            self.block_pool.touch(block for block in hit_blocks if not block.is_null)
            self.num_cached_block[request.req_id] = num_held
        new_blocks = self.block_pool.get_new_blocks(num_groups * num_new_per_group)
        for g, blocks in enumerate(held):
            blocks.extend(new_blocks[g * num_new_per_group : (g + 1) * num_new_per_group])
        if self.enable_caching and cache_new_blocks:
            self._cache_full_blocks_of_groups(request, held, num_tokens_with_slots)
        return new_blocks

    def allocate_for_load(
        self,
        request: Request,
        num_load_tokens: int,
        num_hit_tokens: int,
        hit_blocks: list[KVCacheBlock],
    ) -> list[KVCacheBlock] | None:
        """KVCacheManager.allocate_for_load per group: a windowed group gets only the blocks
        its first query past the loaded ones reads (its table is null before them), as a
        local hit of that length would give it. Returns the new blocks, group after group."""
        assert request.req_id not in self.req_to_group_blocks, f"{request} already holds blocks"
        num_held = len(hit_blocks) // self.num_groups
        num_tokens = num_hit_tokens + num_load_tokens
        end = cdiv(num_tokens, self.block_size)
        firsts = [
            min(max(num_held, self._first_needed_block(group, num_tokens)), end)
            for group in self.groups
        ]
        num_new = sum(end - first for first in firsts)
        num_evictable_hit_blocks = sum(
            1 for block in hit_blocks if block.ref_cnt == 0 and not block.is_null
        )
        if num_new + num_evictable_hit_blocks > self.block_pool.get_num_free_blocks():
            return None
        self.block_pool.touch(block for block in hit_blocks if not block.is_null)
        new_blocks = self.block_pool.get_new_blocks(num_new)
        held, taken = [], 0
        for g, first in enumerate(firsts):
            blocks = hit_blocks[g * num_held : (g + 1) * num_held]
            blocks += [self.block_pool.null_block] * (first - num_held)
            blocks += new_blocks[taken : taken + end - first]
            taken += end - first
            held.append(blocks)
        self.req_to_group_blocks[request.req_id] = held
        self.num_null_blocks[request.req_id] = [_num_leading_null(blocks) for blocks in held]
        self.num_cached_block[request.req_id] = num_held
        return new_blocks

    def holds_window_from(self, request: Request, num_computed_tokens: int) -> bool:
        held = self.req_to_group_blocks.get(request.req_id, ())
        return all(
            not block.is_null
            for group, blocks in zip(self.groups, held)
            for block in blocks[self._first_needed_block(group, num_computed_tokens) :]
        )

    def _free_out_of_window(
        self, req_id: str, held: list[list[KVCacheBlock]], num_computed: int
    ) -> None:
        """Give back each windowed group's blocks that no query from num_computed on reads."""
        null_block = self.block_pool.null_block
        num_null = self.num_null_blocks[req_id]
        for g, (group, blocks) in enumerate(zip(self.groups, held)):
            if group.is_full:
                continue
            first = min(self._first_needed_block(group, num_computed), len(blocks))
            if first <= num_null[g]:
                continue
            freed = [block for block in blocks[num_null[g] : first] if not block.is_null]
            blocks[num_null[g] : first] = [null_block] * (first - num_null[g])
            num_null[g] = first
            self.block_pool.free_blocks(reversed(freed))

    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        """Register the request's blocks of its first `num_tokens` (loaded by a KV connector,
        which fills a windowed group's window only): the blocks a windowed group no longer
        reads go back first, so that no block that was never filled enters the cache."""
        held = self.req_to_group_blocks.get(request.req_id)
        if held is None:
            return
        self._free_out_of_window(request.req_id, held, num_tokens)
        if self.enable_caching:
            self._cache_full_blocks_of_groups(request, held, num_tokens)

    def _cache_full_blocks_of_groups(
        self, request: Request, held: list[list[KVCacheBlock]], num_tokens_with_slots: int
    ) -> None:
        num_full_blocks = min(num_tokens_with_slots // self.block_size, len(request.block_hashes))
        num_cached_blocks = self.num_cached_block[request.req_id]
        if num_full_blocks <= num_cached_blocks:
            return
        for g, blocks in enumerate(held):
            self.block_pool.cache_full_blocks(
                request, blocks, num_cached_blocks, num_full_blocks, g
            )
        self.num_cached_block[request.req_id] = num_full_blocks

    def free(self, request: Request) -> None:
        """Release every group's blocks (no-op if the request holds none)."""
        held = self.req_to_group_blocks.pop(request.req_id, [])
        self.num_cached_block.pop(request.req_id, None)
        self.num_null_blocks.pop(request.req_id, None)
        for blocks in held:
            self.block_pool.free_blocks(block for block in reversed(blocks) if not block.is_null)

    def enable_kv_events(self) -> None:
        """Events per group, naming it (vLLM's hybrid KV events)."""
        self.block_pool.enable_kv_events(self.block_size, self.groups)

    # ------------------------------------------------------------------ queries

    def get_block_ids(self, req_id: str) -> list[int]:
        """Every group's table, group-major (null blocks as 0)."""
        held = self.req_to_group_blocks.get(req_id, ())
        return [block.block_id for blocks in held for block in blocks]

    def get_group_block_ids(self, req_id: str) -> list[list[int]]:
        """Each group's table (null blocks as 0)."""
        held = self.req_to_group_blocks.get(req_id, ())
        return [[block.block_id for block in blocks] for blocks in held]

    def num_held_blocks(self, req_id: str) -> int:
        """Blocks the request holds over all groups (null places not counted)."""
        held = self.req_to_group_blocks.get(req_id, ())
        return sum(1 for blocks in held for block in blocks if not block.is_null)


def max_tokens_in_cache(
    groups: list[KVCacheGroupSpec], num_blocks: int, block_size: int, max_num_batched_tokens: int
) -> int | None:
    """The longest request the cache holds alone: windowed groups need at most their window
    plus a step's tokens, the full groups grow with it. None: no full group, no bound."""
    num_full = sum(1 for group in groups if group.is_full)
    windowed = [group for group in groups if not group.is_full]
    num_windowed_blocks = sum(
        cdiv(max(group.sliding_window, group.chunk_size) + max_num_batched_tokens, block_size) + 1
        for group in windowed
    )
    num_usable = num_blocks - 1 - num_windowed_blocks
    if num_full == 0:
        return None if num_usable >= 0 else 0
    return max(0, num_usable // num_full) * block_size


def _last_miss_before(found: list[KVCacheBlock | None]) -> list[int]:
    """[k] -> the last index < k whose block is missing (None), -1 if none: so a hit of k
    blocks is served from block f on when last_miss[k] < f, for every k in one pass."""
    last_miss = [-1]
    for index, block in enumerate(found):
        last_miss.append(index if block is None else last_miss[-1])
    return last_miss


def _num_leading_null(blocks: list[KVCacheBlock]) -> int:
    return next((i for i, block in enumerate(blocks) if not block.is_null), len(blocks))
