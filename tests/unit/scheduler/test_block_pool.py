"""The free queue at the pointer level, and the block pool's ref counts and hash map."""

from __future__ import annotations

from functools import partial

import pytest

from kvserve.services.scheduler.core.block_pool import (
    BlockPool,
    FreeKVCacheBlockQueue,
    KVCacheBlock,
)
from tests.support.scheduler import make_hashed_request

BLOCK_SIZE = 4
make_request = partial(make_hashed_request, block_size=BLOCK_SIZE)


def make_blocks(num_blocks: int) -> list[KVCacheBlock]:
    return [KVCacheBlock(block_id) for block_id in range(num_blocks)]


def assert_links(queue: FreeKVCacheBlockQueue, expected_ids: list[int]) -> None:
    """Walk both directions and check every prev/next pointer and the count."""
    forward = []
    block = queue.head.next_free_block
    while block is not queue.tail:
        forward.append(block.block_id)
        assert block.next_free_block.prev_free_block is block
        block = block.next_free_block
    backward = []
    block = queue.tail.prev_free_block
    while block is not queue.head:
        backward.append(block.block_id)
        assert block.prev_free_block.next_free_block is block
        block = block.prev_free_block
    assert forward == expected_ids
    assert backward == expected_ids[::-1]
    assert queue.num_free_blocks == len(expected_ids)
    assert [b.block_id for b in queue.get_all_free_blocks()] == expected_ids


def assert_unlinked(*blocks: KVCacheBlock) -> None:
    for block in blocks:
        assert block.prev_free_block is None and block.next_free_block is None


# ---------------------------------------------------------------------- free queue


def test_free_queue_initial_links():
    blocks = make_blocks(4)
    queue = FreeKVCacheBlockQueue(blocks)
    assert_links(queue, [0, 1, 2, 3])
    assert queue.head.prev_free_block is None and queue.tail.next_free_block is None
    assert queue.head.next_free_block is blocks[0] and blocks[0].prev_free_block is queue.head
    assert queue.tail.prev_free_block is blocks[3] and blocks[3].next_free_block is queue.tail


def test_free_queue_remove_from_middle_head_and_tail():
    blocks = make_blocks(5)
    queue = FreeKVCacheBlockQueue(blocks)
    queue.remove(blocks[2])
    assert_unlinked(blocks[2])
    assert blocks[1].next_free_block is blocks[3] and blocks[3].prev_free_block is blocks[1]
    assert_links(queue, [0, 1, 3, 4])
    queue.remove(blocks[0])
    assert queue.head.next_free_block is blocks[1]
    queue.remove(blocks[4])
    assert queue.tail.prev_free_block is blocks[3]
    assert_links(queue, [1, 3])
    with pytest.raises(AssertionError):
        queue.remove(blocks[2])  # not in the queue any more


def test_free_queue_append_goes_to_tail():
    blocks = make_blocks(4)
    queue = FreeKVCacheBlockQueue(blocks[:2])
    queue.append(blocks[3])
    assert blocks[3].prev_free_block is blocks[1] and blocks[3].next_free_block is queue.tail
    queue.append_n([blocks[2]])
    assert_links(queue, [0, 1, 3, 2])
    with pytest.raises(AssertionError):
        queue.append(blocks[2])  # already queued


def test_free_queue_popleft_and_popleft_n():
    blocks = make_blocks(6)
    queue = FreeKVCacheBlockQueue(blocks)
    assert queue.popleft() is blocks[0]
    assert_unlinked(blocks[0])
    popped = queue.popleft_n(3)
    assert popped == blocks[1:4]
    assert_unlinked(*popped)
    assert queue.head.next_free_block is blocks[4] and blocks[4].prev_free_block is queue.head
    assert_links(queue, [4, 5])
    assert queue.popleft_n(0) == []
    with pytest.raises(ValueError):
        queue.popleft_n(3)
    assert queue.popleft_n(2) == blocks[4:]
    assert_links(queue, [])
    assert queue.head.next_free_block is queue.tail and queue.tail.prev_free_block is queue.head
    with pytest.raises(ValueError, match="no free"):
        queue.popleft()
    queue.append_n(reversed(blocks[:3]))
    assert_links(queue, [2, 1, 0])


def test_block_repr_does_not_recurse():
    queue = FreeKVCacheBlockQueue(make_blocks(3))
    assert "prev=0, next=2" in repr(queue.head.next_free_block.next_free_block)


# ---------------------------------------------------------------------- block pool


def test_null_block_is_never_allocated():
    pool = BlockPool(num_blocks=5)
    assert pool.null_block.block_id == 0 and pool.null_block.is_null
    assert pool.get_num_free_blocks() == 4
    blocks = pool.get_new_blocks(4)
    assert sorted(b.block_id for b in blocks) == [1, 2, 3, 4]
    assert all(b.ref_cnt == 1 for b in blocks)
    assert pool.get_usage() == 1.0
    with pytest.raises(ValueError):
        pool.get_new_blocks(1)
    pool.free_blocks(blocks)
    assert pool.get_num_free_blocks() == 4 and pool.get_usage() == 0.0
    with pytest.raises(ValueError, match="at least 2 blocks"):
        BlockPool(num_blocks=1)


def test_free_blocks_keeps_the_given_order_and_ref_counts():
    pool = BlockPool(num_blocks=5)
    blocks = pool.get_new_blocks(3)
    pool.touch(blocks[:1])  # a second holder of the first block
    pool.free_blocks(reversed(blocks))
    assert blocks[0].ref_cnt == 1
    assert [b.block_id for b in pool.free_block_queue.get_all_free_blocks()] == [
        4,
        blocks[2].block_id,
        blocks[1].block_id,
    ]
    pool.free_blocks(blocks[:1])
    assert pool.get_num_free_blocks() == 4
    with pytest.raises(AssertionError):
        pool.free_blocks(blocks[:1])


def test_cache_hit_and_eviction():
    pool = BlockPool(num_blocks=4)
    request = make_request("a", list(range(10)))  # 2 full blocks of 4
    blocks = pool.get_new_blocks(3)
    pool.cache_full_blocks(request, blocks, num_cached_blocks=0, num_full_blocks=2)
    assert [b.block_hash for b in blocks[:2]] == request.block_hashes
    assert blocks[2].block_hash is None
    assert pool.get_cached_block(request.block_hashes[1]) is blocks[1]

    pool.free_blocks(reversed(blocks))
    # Freed but still cached: a hit takes the block back out of the free queue.
    pool.touch([blocks[0]])
    assert blocks[0].ref_cnt == 1 and blocks[0].next_free_block is None
    assert pool.get_num_free_blocks() == 2
    # New allocations evict from the head: the unhashed tail, then the second block.
    new_blocks = pool.get_new_blocks(2)
    assert new_blocks == [blocks[2], blocks[1]]
    assert blocks[1].block_hash is None
    assert pool.get_cached_block(request.block_hashes[1]) is None
    assert pool.get_cached_block(request.block_hashes[0]) is blocks[0]
    assert pool.num_cached_block_evictions == 1
    pool.free_blocks([*new_blocks, blocks[0]])
    assert pool.get_num_free_blocks() == 3


def test_duplicate_hashes_share_one_map_entry():
    pool = BlockPool(num_blocks=4)
    first, second = make_request("a", [1, 2, 3, 4]), make_request("b", [1, 2, 3, 4])
    block_a, block_b = pool.get_new_blocks(2)
    pool.cache_full_blocks(first, [block_a], 0, 1)
    pool.cache_full_blocks(second, [block_b], 0, 1)
    block_hash = first.block_hashes[0]
    assert pool.cached_block_hash_to_block[block_hash] == {
        block_a.block_id: block_a,
        block_b.block_id: block_b,
    }
    assert pool.get_cached_block(block_hash) is block_a  # the first cached of the duplicates
    pool.free_blocks([block_a, block_b])
    evicted = pool.get_new_blocks(1)[0]  # block 3, never hashed
    assert evicted.block_id == 3
    evicted_hashed = pool.get_new_blocks(1)[0]
    assert evicted_hashed is block_a
    # Back to the single-block form, pointing at the survivor.
    assert pool.cached_block_hash_to_block[block_hash] is block_b
    pool.free_blocks([evicted, evicted_hashed])
    assert pool.get_num_free_blocks() == 3


def test_reset_prefix_cache_only_when_nothing_is_held():
    pool = BlockPool(num_blocks=4)
    request = make_request("a", [1, 2, 3, 4])
    blocks = pool.get_new_blocks(1)
    pool.cache_full_blocks(request, blocks, 0, 1)
    assert not pool.reset_prefix_cache()
    assert pool.get_cached_block(request.block_hashes[0]) is blocks[0]
    pool.free_blocks(blocks)
    assert pool.reset_prefix_cache()
    assert pool.get_cached_block(request.block_hashes[0]) is None
    assert blocks[0].block_hash is None
    assert pool.get_num_free_blocks() == 3


def test_caching_disabled_registers_nothing():
    pool = BlockPool(num_blocks=3, enable_caching=False)
    request = make_request("a", [1, 2, 3, 4])
    blocks = pool.get_new_blocks(1)
    pool.cache_full_blocks(request, blocks, 0, 1)
    assert blocks[0].block_hash is None and not pool.cached_block_hash_to_block
    pool.free_blocks(blocks)
    assert pool.get_num_free_blocks() == 2
