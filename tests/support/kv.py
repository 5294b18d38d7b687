"""The leak checks: after a test, every KV block is back in the free queue.

Cached blocks count as free (they sit in the free queue, evictable); a block still referenced
or still mapped to a request is a leak.
"""

from __future__ import annotations


def assert_all_blocks_free(manager) -> None:
    """No request holds a block of this KVCacheManager, and no block has a reference."""
    assert not manager.req_to_blocks, f"requests still hold blocks: {list(manager.req_to_blocks)}"
    held_by_group = getattr(manager, "req_to_group_blocks", {})  # GroupedKVCacheManager
    assert not held_by_group, f"requests still hold blocks: {list(held_by_group)}"
    assert manager.num_free_blocks == manager.num_total_blocks, (
        f"{manager.num_total_blocks - manager.num_free_blocks} KV blocks leaked"
    )
    assert all(block.ref_cnt == 0 for block in manager.block_pool.blocks)


def assert_no_leaked_blocks(scheduler) -> None:
    """The check every scheduler and engine test ends with: every request gone (finished or
    aborted), every block free.

    Args:
        scheduler: a Scheduler; for an engine, `engine_core.scheduler`.
    """
    assert not scheduler.has_unfinished_requests()
    assert not scheduler.requests, f"requests never freed: {list(scheduler.requests)}"
    assert_all_blocks_free(scheduler.kv_cache_manager)
