"""KV-cache blocks, their free queue, and the pool that hands them out and caches them."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvserve.shared.kv_cache_groups import KVCacheGroupSpec, hash_suffix
from kvserve.shared.kv_events import (
    MEDIUM_GPU,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
)

if TYPE_CHECKING:
    from kvserve.services.scheduler.core.request import Request


@dataclass(slots=True, eq=False)
class KVCacheBlock:
    """One block of `block_size` token slots in every layer's KV cache.

    Compared by identity (eq=False): two blocks are never "equal", and a field-wise eq would
    walk the free-list links.

    Args:
        block_id: index in the cache tensors; the worker's block tables hold these.
        ref_cnt: requests holding the block. 0 means free (in the free queue), though a free
            block may keep its hash until it is evicted.
        block_hash: the prefix hash of its tokens once full and cached, else None.
        prev_free_block, next_free_block: free-queue links, None while not in the queue.
        is_null: block 0, a placeholder that is never allocated.
        group_idx: the KV cache group whose key `block_hash` is (0 without groups).
    """

    block_id: int
    ref_cnt: int = 0
    block_hash: bytes | None = None
    prev_free_block: KVCacheBlock | None = None
    next_free_block: KVCacheBlock | None = None
    is_null: bool = False
    group_idx: int = 0  # the KV cache group it is cached for (its hash carries the suffix)

    def __repr__(self) -> str:
        # Only neighbour ids: the default repr would recurse along the whole list.
        prev_id = self.prev_free_block.block_id if self.prev_free_block else None
        next_id = self.next_free_block.block_id if self.next_free_block else None
        return (
            f"KVCacheBlock(id={self.block_id}, ref_cnt={self.ref_cnt}, "
            f"hashed={self.block_hash is not None}, prev={prev_id}, next={next_id})"
        )


class FreeKVCacheBlockQueue:
    """Free blocks in eviction order, as an intrusive doubly linked list.

        head <-> b3 <-> b7 <-> b1 <-> tail      (popleft takes b3; append puts after b1)

    The links live in the blocks themselves, so `remove` of a block in the middle (a cached
    free block that gets a prefix hit) is O(1) and no operation allocates. The sentinels
    remove every None check on the way: every link between them is set, which the asserts
    only tell the type checker.

    Args:
        blocks: the initially free blocks, in order.
    """

    def __init__(self, blocks: list[KVCacheBlock]) -> None:
        self.num_free_blocks = len(blocks)
        self.head = KVCacheBlock(block_id=-1)
        self.tail = KVCacheBlock(block_id=-1)
        chain = [self.head, *blocks, self.tail]
        for left, right in zip(chain, chain[1:]):
            left.next_free_block = right
            right.prev_free_block = left

    def popleft(self) -> KVCacheBlock:
        """Take the block that is next to be evicted."""
        block = self.head.next_free_block
        assert block is not None, "the head sentinel is always linked"
        if block is self.tail:
            raise ValueError("no free KV-cache blocks left")
        self.remove(block)
        return block

    def popleft_n(self, num_blocks: int) -> list[KVCacheBlock]:
        """Take the first `num_blocks` blocks, relinking the head once."""
        if num_blocks > self.num_free_blocks:
            raise ValueError(
                f"asked for {num_blocks} free blocks, only {self.num_free_blocks} left"
            )
        if num_blocks == 0:
            return []
        blocks = []
        block = self.head.next_free_block
        for _ in range(num_blocks):
            # At most num_free_blocks steps from the head: never past the tail sentinel.
            assert block is not None
            blocks.append(block)
            next_block = block.next_free_block
            block.prev_free_block = block.next_free_block = None
            block = next_block
        assert block is not None
        self.head.next_free_block = block
        block.prev_free_block = self.head
        self.num_free_blocks -= num_blocks
        return blocks

    def remove(self, block: KVCacheBlock) -> None:
        """Unlink `block` from wherever it sits in the queue."""
        prev_block, next_block = block.prev_free_block, block.next_free_block
        assert prev_block is not None and next_block is not None, (
            f"{block} is not in the free queue"
        )
        prev_block.next_free_block = next_block
        next_block.prev_free_block = prev_block
        block.prev_free_block = block.next_free_block = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        """Put `block` at the tail: it will be evicted last."""
        assert block.prev_free_block is None and block.next_free_block is None, (
            f"{block} is already in the free queue"
        )
        last = self.tail.prev_free_block
        assert last is not None, "the tail sentinel is always linked"
        last.next_free_block = block
        block.prev_free_block = last
        block.next_free_block = self.tail
        self.tail.prev_free_block = block
        self.num_free_blocks += 1

    def append_n(self, blocks: Iterable[KVCacheBlock]) -> None:
        for block in blocks:
            self.append(block)

    def get_all_free_blocks(self) -> list[KVCacheBlock]:
        """The free blocks head to tail (O(n): for tests and integrity checks)."""
        blocks = []
        block = self.head.next_free_block
        while block is not self.tail:
            assert block is not None, "the free queue is broken before its tail"
            blocks.append(block)
            block = block.next_free_block
        return blocks


class BlockPool:
    """Every KV-cache block, with ref counts, the free queue and the prefix-cache map.

    Block 0 is the null block: it never enters the free queue, so it is never handed out.

    Args:
        num_blocks: blocks in the cache, the null block included.
        enable_caching: keep hashes of full blocks so later requests can reuse them.
    """

    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks < 2:
            raise ValueError(
                f"the KV cache needs at least 2 blocks (block 0 is reserved), "
                f"got {num_blocks}; give it more memory"
            )
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(block_id) for block_id in range(num_blocks)]
        self.free_block_queue = FreeKVCacheBlockQueue(self.blocks)
        self.null_block = self.free_block_queue.popleft()
        self.null_block.is_null = True
        # hash -> the one block holding it. Two requests that computed the same prefix at the
        # same time leave duplicates; only then is the value a {block_id: block} dict.
        self.cached_block_hash_to_block: dict[bytes, KVCacheBlock | dict[int, KVCacheBlock]] = {}
        self.num_cached_block_evictions = 0
        # (hash, block id) of each cached block evicted for reuse, while a KV connector's
        # offload tier collects them (None: not collected).
        self.evicted: list[tuple[bytes, int]] | None = None
        # Prefix-cache changes for --kv-events-config, taken once per step (None: off, and
        # nothing is collected).
        self.kv_events: list[KVEvent] | None = None
        self.block_size = 0
        # The KV cache groups the events name (None: one table, events without groups).
        self.event_groups: list[KVCacheGroupSpec] | None = None

    def enable_kv_events(
        self, block_size: int, groups: list[KVCacheGroupSpec] | None = None
    ) -> None:
        """Collect a BlockStored / BlockRemoved / AllBlocksCleared per prefix-cache change;
        with `groups`, one per group, naming it (vLLM's hybrid events)."""
        self.kv_events = []
        self.block_size = block_size
        self.event_groups = groups

    def take_events(self) -> list[KVEvent]:
        """The events since the last call, oldest first."""
        if not self.kv_events:
            return []
        events, self.kv_events = self.kv_events, []
        return events

    # ------------------------------------------------------------------ allocation

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Take `num_blocks` blocks from the free-queue head, evicting their cached hashes."""
        if num_blocks > self.get_num_free_blocks():
            raise ValueError(
                f"cannot get {num_blocks} blocks, only {self.get_num_free_blocks()} free"
            )
        blocks = self.free_block_queue.popleft_n(num_blocks)
        for block in blocks:
            assert block.ref_cnt == 0, f"{block} was in the free queue while held"
            if self.evicted is not None and block.block_hash is not None:
                self.evicted.append((block.block_hash, block.block_id))
            self._evict_cached_block(block)
            block.ref_cnt = 1
        return blocks

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take one more reference on each block (prefix hits); a free one leaves the queue."""
        for block in blocks:
            if block.ref_cnt == 0 and not block.is_null:
                self.free_block_queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference on each block; unreferenced ones join the queue tail in order.

        Args:
            ordered_blocks: in eviction order, first to be evicted first (callers pass a
                request's blocks reversed so its tail goes first).
        """
        for block in ordered_blocks:
            assert block.ref_cnt > 0, f"{block} freed more often than taken"
            block.ref_cnt -= 1
            if block.ref_cnt == 0 and not block.is_null:
                self.free_block_queue.append(block)

    # ------------------------------------------------------------------ prefix cache

    def cache_full_blocks(
        self,
        request: Request,
        blocks: list[KVCacheBlock],
        num_cached_blocks: int,
        num_full_blocks: int,
        group_idx: int = 0,
    ) -> None:
        """Register blocks[num_cached_blocks:num_full_blocks] under the request's hashes.

        Args:
            request: supplies `block_hashes` (block i of the request has hash i).
            blocks: all blocks of the request, in order.
            num_cached_blocks: blocks already registered (prefix hits or earlier steps).
            num_full_blocks: blocks that are full once this step's tokens are written.
            group_idx: the KV cache group the blocks serve; its suffix goes after each
                hash (`hash_suffix`: a group's own key, so that its blocks never answer
                another group's lookup). Null blocks (given back) are skipped.
        """
        if not self.enable_caching or num_cached_blocks >= num_full_blocks:
            return
        assert len(request.block_hashes) >= num_full_blocks, (
            f"{request} has {len(request.block_hashes)} hashes, needs {num_full_blocks}"
        )
        suffix = hash_suffix(group_idx)
        run_start = None  # the first block of the current run of cached blocks
        for block_index in range(num_cached_blocks, num_full_blocks):
            block = blocks[block_index]
            if block.is_null:  # given back: a run ends (one BlockStored per run)
                self._record_stored(request, run_start, block_index, group_idx)
                run_start = None
                continue
            assert block.block_hash is None, f"{block} is cached twice"
            block_hash = request.block_hashes[block_index] + suffix
            block.block_hash = block_hash
            block.group_idx = group_idx
            self._insert_cached_block(block_hash, block)
            if run_start is None:
                run_start = block_index
        self._record_stored(request, run_start, num_full_blocks, group_idx)

    def _record_stored(self, request: Request, start: int | None, end: int, group_idx: int) -> None:
        if start is not None and self.kv_events is not None:
            self.kv_events.append(self._stored_event(request, start, end, group_idx))

    def _stored_event(self, request: Request, start: int, end: int, group_idx: int) -> BlockStored:
        """BlockStored for the request's blocks [start, end), chained to block start - 1."""
        lora = request.lora_request
        event = BlockStored(
            block_hashes=list(request.block_hashes[start:end]),
            parent_block_hash=request.block_hashes[start - 1] if start > 0 else None,
            token_ids=request.all_token_ids[start * self.block_size : end * self.block_size],
            block_size=self.block_size,
            lora_id=lora.lora_int_id if lora is not None else None,
            medium=MEDIUM_GPU,
            lora_name=lora.lora_name if lora is not None else None,
        )
        if self.event_groups is not None:
            group = self.event_groups[group_idx]
            event.group_idx = group_idx
            event.kv_cache_spec_kind = group.spec_kind
            event.kv_cache_spec_sliding_window = group.sliding_window or None
        return event

    def get_cached_block(self, block_hash: bytes) -> KVCacheBlock | None:
        """Any block that holds `block_hash`, or None."""
        entry = self.cached_block_hash_to_block.get(block_hash)
        if entry is None or isinstance(entry, KVCacheBlock):
            return entry
        return next(iter(entry.values()))

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; only possible while no block is held.

        Returns:
            True if the cache was reset, False if some request still holds blocks.
        """
        if self.get_num_free_blocks() != self.num_blocks - 1:
            return False
        self.cached_block_hash_to_block.clear()
        for block in self.blocks:
            block.block_hash = None
        if self.kv_events is not None:
            self.kv_events.append(AllBlocksCleared())
        return True

    def _insert_cached_block(self, block_hash: bytes, block: KVCacheBlock) -> None:
        entry = self.cached_block_hash_to_block.get(block_hash)
        if entry is None:
            self.cached_block_hash_to_block[block_hash] = block
        elif isinstance(entry, KVCacheBlock):
            self.cached_block_hash_to_block[block_hash] = {
                entry.block_id: entry,
                block.block_id: block,
            }
        else:
            entry[block.block_id] = block

    def _removed_event(self, block: KVCacheBlock) -> BlockRemoved:
        """BlockRemoved for a cached block: the request's hash (its group's suffix off)."""
        assert block.block_hash is not None
        key_size = len(block.block_hash) - len(hash_suffix(block.group_idx))
        event = BlockRemoved(block_hashes=[block.block_hash[:key_size]], medium=MEDIUM_GPU)
        if self.event_groups is not None:
            event.group_idx = block.group_idx
        return event

    def _evict_cached_block(self, block: KVCacheBlock) -> None:
        block_hash = block.block_hash
        if block_hash is None:
            return
        self.num_cached_block_evictions += 1
        if self.kv_events is not None:
            self.kv_events.append(self._removed_event(block))
        block.block_hash = None
        entry = self.cached_block_hash_to_block.get(block_hash)
        if isinstance(entry, KVCacheBlock):
            assert entry is block, f"hash map points at {entry}, not {block}"
            del self.cached_block_hash_to_block[block_hash]
            return
        assert entry is not None and block.block_id in entry, f"{block} missing from map"
        del entry[block.block_id]
        if len(entry) == 1:
            # Back to the common single-block form.
            self.cached_block_hash_to_block[block_hash] = next(iter(entry.values()))

    # ------------------------------------------------------------------ accounting

    def get_num_free_blocks(self) -> int:
        return self.free_block_queue.num_free_blocks

    def get_usage(self) -> float:
        """Fraction of allocatable blocks held by requests, 0..1."""
        num_usable = self.num_blocks - 1
        return 1.0 - self.get_num_free_blocks() / num_usable
