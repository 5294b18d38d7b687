"""A block-granular prefix cache with LRU eviction: kvserve's BlockPool, counted not stored.

Blocks are not objects here, only counts and keys:

    num_blocks = used (held by requests) + free
    free       = never-used blocks + blocks in `free_lru`

`free_lru` is the free queue in eviction order (head first). A cached free block sits there
under its hash (weight 1); the unhashed blocks a request frees (partial blocks, generated
tokens, duplicates of cached blocks) sit there as one group entry weighing their count. As in
the engine, a finishing request frees its blocks tail first, so its tail goes in front of its
prefix and is evicted first, and a prefix hit takes a block out of the free queue.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict


class BlockCache:
    """Args:
        num_blocks: KV blocks of the engine.
    """

    def __init__(self, num_blocks: int):
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.num_used = 0
        self.num_never_used = num_blocks
        self.ref_counts: dict[int, int] = {}  # hash -> requests holding the block
        self.free_lru: OrderedDict[object, int] = OrderedDict()  # key -> number of blocks
        self._group_ids = itertools.count()

    @property
    def num_free(self) -> int:
        return self.num_blocks - self.num_used

    def longest_hit(self, block_hashes: list[int], max_blocks: int) -> tuple[int, int]:
        """(blocks of the chain that are cached, how many of those are free) for the first
        `max_blocks` blocks of `block_hashes`."""
        num_hit = num_free_hit = 0
        for block_hash in block_hashes[:max_blocks]:
            if block_hash in self.ref_counts:
                num_hit += 1
            elif block_hash in self.free_lru:
                num_hit += 1
                num_free_hit += 1
            else:
                break
        return num_hit, num_free_hit

    def acquire(self, block_hashes: list[int]) -> None:
        """Take a reference on cached blocks (a prefix hit)."""
        for block_hash in block_hashes:
            if block_hash in self.ref_counts:
                self.ref_counts[block_hash] += 1
            else:
                del self.free_lru[block_hash]
                self.ref_counts[block_hash] = 1
                self.num_used += 1

    def allocate(self, num_new: int) -> None:
        """Take `num_new` free blocks: never-used ones first, then from the LRU head."""
        assert num_new <= self.num_free, f"allocate({num_new}) with {self.num_free} free"
        from_never_used = min(num_new, self.num_never_used)
        self.num_never_used -= from_never_used
        self._evict(num_new - from_never_used)
        self.num_used += num_new

    def _evict(self, num_blocks: int) -> None:
        lru = self.free_lru
        while num_blocks:
            key, weight = next(iter(lru.items()))
            if weight > num_blocks:
                lru[key] = weight - num_blocks  # keeps its place at the head
                return
            del lru[key]
            num_blocks -= weight

    def register(self, block_hash: int) -> bool:
        """Cache a block a request just filled (it already holds the block). False when the
        hash is cached already: the new copy stays unhashed, as a duplicate would."""
        if block_hash in self.ref_counts or block_hash in self.free_lru:
            return False
        self.ref_counts[block_hash] = 1
        return True

    def release(self, held_hashes: list[int], num_unhashed: int) -> None:
        """Free one request's blocks: unhashed ones (its tail) first, then the hashed ones
        in reverse chain order, so the chain's end is evicted before its start."""
        if num_unhashed:
            self.free_lru[("group", next(self._group_ids))] = num_unhashed
            self.num_used -= num_unhashed
        for block_hash in reversed(held_hashes):
            count = self.ref_counts[block_hash] - 1
            if count:
                self.ref_counts[block_hash] = count
            else:
                del self.ref_counts[block_hash]
                self.free_lru[block_hash] = 1
                self.num_used -= 1
