"""KVCacheManager: allocation, freeing order, prefix hits; every test ends leak-free."""

from __future__ import annotations

from functools import partial

import pytest

from kvserve.services.scheduler.core.kv_cache_manager import KVCacheManager
from kvserve.services.scheduler.core.request import Request
from tests.support.kv import assert_all_blocks_free
from tests.support.scheduler import make_hashed_request

BLOCK_SIZE = 16
make_request = partial(make_hashed_request, block_size=BLOCK_SIZE)


def make_manager(num_blocks: int = 64, enable_caching: bool = True) -> KVCacheManager:
    return KVCacheManager(num_blocks, BLOCK_SIZE, enable_caching, max_model_len=1024)


def schedule_prompt(manager: KVCacheManager, request: Request) -> int:
    """Admit a request as the scheduler would; returns its prefix-hit tokens."""
    hit_blocks, num_hit_tokens = manager.get_computed_blocks(request)
    num_new_tokens = request.num_tokens - num_hit_tokens
    assert manager.allocate_slots(request, num_new_tokens, num_hit_tokens, hit_blocks) is not None
    request.num_computed_tokens = request.num_tokens
    return num_hit_tokens


def test_allocate_grows_by_whole_blocks_and_free_returns_all():
    manager = make_manager()
    request = make_request("a", list(range(20)))
    blocks = manager.allocate_slots(request, 20)
    assert len(blocks) == 2 and manager.num_free_blocks == manager.num_total_blocks - 2
    request.num_computed_tokens = 20
    # Decode: tokens 21..32 fit in block 2; token 33 needs a third block.
    for token_id in range(100, 112):
        request.append_output_token_ids(token_id)
        assert manager.allocate_slots(request, 1) == []
        request.num_computed_tokens += 1
    request.append_output_token_ids(200)
    assert len(manager.allocate_slots(request, 1)) == 1
    assert len(manager.get_block_ids("a")) == 3
    assert manager.usage == pytest.approx(3 / manager.num_total_blocks)
    manager.free(request)
    manager.free(request)  # a second free is a no-op
    assert manager.get_block_ids("a") == []
    assert_all_blocks_free(manager)


def test_allocate_fails_fast_without_side_effects():
    manager = make_manager(num_blocks=4)  # 3 usable blocks
    big = make_request("big", list(range(64)))
    assert manager.allocate_slots(big, 64) is None
    assert "big" not in manager.req_to_blocks
    assert manager.num_free_blocks == 3
    with pytest.raises(ValueError, match="positive"):
        manager.allocate_slots(big, 0)
    assert_all_blocks_free(manager)


def test_free_in_reverse_order_evicts_the_tail_first():
    manager = make_manager(num_blocks=5)  # 4 usable blocks
    prompt = list(range(48))  # 3 full blocks
    first = make_request("a", prompt)
    schedule_prompt(manager, first)
    block_ids = manager.get_block_ids("a")
    manager.free(first)
    free_order = [b.block_id for b in manager.block_pool.free_block_queue.get_all_free_blocks()]
    assert free_order[-3:] == block_ids[::-1]
    # One never-used block plus the tail of "a" get evicted by a 2-block request.
    other = make_request("b", list(range(1000, 1020)))
    schedule_prompt(manager, other)
    assert block_ids[2] in manager.get_block_ids("b")
    # The head of the prefix survived: a new request with the same prompt hits 2 blocks.
    again = make_request("c", prompt)
    hit_blocks, num_hit_tokens = manager.get_computed_blocks(again)
    assert [b.block_id for b in hit_blocks] == block_ids[:2] and num_hit_tokens == 32
    manager.free(other)
    assert_all_blocks_free(manager)


def test_shared_200_token_prefix_hits_192_tokens():
    manager = make_manager()
    prefix = list(range(5000, 5200))
    first = make_request("a", prefix + [1, 2, 3])
    assert schedule_prompt(manager, first) == 0
    second = make_request("b", prefix + [9, 9, 9, 9])
    assert schedule_prompt(manager, second) >= 192
    assert manager.get_block_ids("b")[:12] == manager.get_block_ids("a")[:12]
    assert all(block.ref_cnt == 2 for block in manager.req_to_blocks["a"][:12])
    stats = manager.make_prefix_cache_stats()
    assert (stats.num_requests, stats.num_queried_tokens, stats.num_hit_tokens) == (
        2,
        203 + 204,
        192,
    )
    assert manager.make_prefix_cache_stats().num_requests == 0
    manager.free(first)
    manager.free(second)
    assert_all_blocks_free(manager)


def test_last_token_is_always_recomputed():
    manager = make_manager()
    prompt = list(range(32))  # exactly 2 blocks
    first = make_request("a", prompt)
    schedule_prompt(manager, first)
    second = make_request("b", prompt)
    hit_blocks, num_hit_tokens = manager.get_computed_blocks(second)
    assert num_hit_tokens == 16 and len(hit_blocks) == 1
    manager.free(first)
    assert_all_blocks_free(manager)


def test_hit_blocks_in_the_free_queue_count_as_needed():
    manager = make_manager(num_blocks=4)  # 3 usable blocks
    first = make_request("a", list(range(33)))  # 2 full blocks cached, 3 held
    schedule_prompt(manager, first)
    manager.free(first)
    second = make_request("b", list(range(32)) + list(range(500, 532)))  # needs 4 blocks
    hit_blocks, num_hit_tokens = manager.get_computed_blocks(second)
    assert num_hit_tokens == 32
    # 2 hit blocks + 2 new blocks > 3 free blocks, though only 2 are "new".
    assert manager.allocate_slots(second, 32, num_hit_tokens, hit_blocks) is None
    assert all(block.ref_cnt == 0 for block in hit_blocks)
    assert_all_blocks_free(manager)


def test_prompt_logprobs_disable_cache_reads_and_salt_isolates():
    manager = make_manager()
    prompt = list(range(64))
    schedule_prompt(manager, make_request("a", prompt))
    assert schedule_prompt(manager, make_request("b", prompt, prompt_logprobs=1)) == 0
    assert schedule_prompt(manager, make_request("c", prompt, cache_salt="tenant")) == 0
    assert schedule_prompt(manager, make_request("d", prompt)) == 48
    for req_id in "abcd":
        manager.free(make_request(req_id, []))
    assert_all_blocks_free(manager)


def test_blocks_are_cached_when_allocated_so_the_same_step_can_hit_them():
    manager = make_manager()
    prompt = list(range(40))
    first = make_request("a", prompt)
    assert manager.allocate_slots(first, 40) is not None  # not computed yet
    second = make_request("b", prompt)
    assert manager.get_computed_blocks(second)[1] == 32
    manager.free(first)
    assert_all_blocks_free(manager)


def test_decode_blocks_are_cached_when_they_fill():
    manager = make_manager()
    request = make_request("a", list(range(10)), hash_algo="xxhash")
    schedule_prompt(manager, request)
    for token_id in range(300, 306):  # fills block 0 (16 tokens) by the last decode step
        request.append_output_token_ids(token_id)
        manager.allocate_slots(request, 1)
        request.num_computed_tokens += 1
    assert manager.req_to_blocks["a"][0].block_hash == request.block_hashes[0]
    follower = make_request("b", list(range(10)) + list(range(300, 306)) + [1], hash_algo="xxhash")
    assert manager.get_computed_blocks(follower)[1] == 16
    manager.free(request)
    assert_all_blocks_free(manager)


def test_caching_disabled_never_hits():
    manager = make_manager(enable_caching=False)
    prompt = list(range(64))
    assert schedule_prompt(manager, make_request("a", prompt)) == 0
    assert schedule_prompt(manager, make_request("b", prompt)) == 0
    assert not manager.block_pool.cached_block_hash_to_block
    manager.free(make_request("a", []))
    manager.free(make_request("b", []))
    assert_all_blocks_free(manager)
