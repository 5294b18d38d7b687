"""GroupedKVCacheManager and the grouping rule: what a sliding-window or chunked-local group
gives back, what admission counts, and how long a prefix hit is; every test ends leak-free."""

from __future__ import annotations

from functools import partial

from kvserve.services.scheduler.core.features import SchedulerFeatures
from kvserve.services.scheduler.core.kv_cache_groups import (
    GroupedKVCacheManager,
    max_tokens_in_cache,
)
from kvserve.services.scheduler.core.kv_cache_manager import KVCacheManager
from kvserve.services.scheduler.core.scheduler import Scheduler
from kvserve.shared.config import CacheConfig, SchedulerConfig
from kvserve.shared.kv_cache_groups import KVCacheGroupSpec, make_kv_cache_groups
from tests.support.kv import assert_all_blocks_free
from tests.support.scheduler import make_hashed_request

BLOCK_SIZE = 4
WINDOW = 8
make_request = partial(make_hashed_request, block_size=BLOCK_SIZE)
FULL = KVCacheGroupSpec(layer_indices=[1])
SLIDING = KVCacheGroupSpec(layer_indices=[0], sliding_window=WINDOW)


def make_manager(groups=(SLIDING, FULL), num_blocks: int = 64) -> GroupedKVCacheManager:
    return GroupedKVCacheManager(num_blocks, BLOCK_SIZE, list(groups), max_model_len=256)


def table(manager: GroupedKVCacheManager, req_id: str, group: int) -> list[int]:
    return [block.block_id for block in manager.req_to_group_blocks[req_id][group]]


def advance(manager: GroupedKVCacheManager, request, num_tokens: int) -> list:
    new_blocks = manager.allocate_slots(request, num_tokens)
    assert new_blocks is not None
    request.num_computed_tokens += num_tokens
    return new_blocks


def test_grouping_by_kind_in_equal_counts():
    s, f = (16, 0), (0, 0)
    gemma3 = make_kv_cache_groups([s, s, s, s, s, f, s, s, s, s, s, f])
    assert [g.layer_indices for g in gemma3] == [[0, 1], [2, 3], [4, 6], [5, 11], [7, 8], [9, 10]]
    assert [g.is_full for g in gemma3] == [False, False, False, True, False, False]
    gemma2 = make_kv_cache_groups([s, f, s, f])
    assert [g.layer_indices for g in gemma2] == [[0, 2], [1, 3]]
    # One kind: one group of every layer (Llama: full; Mistral: all sliding).
    assert make_kv_cache_groups([f, f, f]) == [KVCacheGroupSpec(layer_indices=[0, 1, 2])]
    (mistral,) = make_kv_cache_groups([s, s])
    assert mistral.sliding_window == 16 and mistral.layer_indices == [0, 1]
    # A kind whose count is no multiple ends in a shorter group.
    odd = make_kv_cache_groups([s, s, s, f, f])
    assert [g.layer_indices for g in odd] == [[0, 1], [2], [3, 4]]


def test_first_needed_token_of_windows_and_chunks():
    assert SLIDING.first_needed_token(5) == 0
    assert SLIDING.first_needed_token(20) == 13  # keys > 20 - 8
    chunked = KVCacheGroupSpec(layer_indices=[0], chunk_size=12)
    assert chunked.first_needed_token(11) == 0 and chunked.first_needed_token(30) == 24
    assert FULL.first_needed_token(1000) == 0


def test_sliding_group_gives_back_blocks_out_of_its_window():
    manager = make_manager()
    request = make_request("a", list(range(30)))
    new_blocks = advance(manager, request, 30)  # 8 blocks per group, group-major
    assert len(new_blocks) == 16
    assert manager.get_block_ids("a") == [b.block_id for b in new_blocks]
    assert manager.num_held_blocks("a") == 16
    # The next step's query at 30 reads keys 23..: blocks 0-4 of the sliding group go back.
    request.append_output_token_ids(1)
    assert advance(manager, request, 1) == []
    assert table(manager, "a", 0)[:5] == [0] * 5 and 0 not in table(manager, "a", 0)[5:]
    assert 0 not in table(manager, "a", 1)
    assert manager.num_held_blocks("a") == 8 + 3
    # Decoding on, the sliding group holds at most window / block_size + 1 blocks.
    for token in range(40):
        request.append_output_token_ids(token)
        advance(manager, request, 1)
        held = [block for block in manager.req_to_group_blocks["a"][0] if not block.is_null]
        assert len(held) <= WINDOW // BLOCK_SIZE + 1
    assert manager.num_free_blocks == manager.num_total_blocks - manager.num_held_blocks("a")
    manager.free(request)
    assert_all_blocks_free(manager)


def test_chunked_group_gives_back_blocks_before_the_chunk():
    chunked = KVCacheGroupSpec(layer_indices=[0], chunk_size=12)
    manager = make_manager(groups=(chunked, FULL))
    request = make_request("a", list(range(26)))
    advance(manager, request, 26)
    request.append_output_token_ids(1)
    advance(manager, request, 1)  # query at 26 sees its chunk 24..: blocks 0-5 go back
    assert table(manager, "a", 0)[:6] == [0] * 6
    manager.free(request)
    assert_all_blocks_free(manager)


def test_admission_counts_each_groups_real_need():
    # 14 usable blocks: a 40-token prompt needs 10 + 10 at once, more than the pool...
    manager = make_manager(num_blocks=15)
    assert manager.allocate_slots(make_request("big", list(range(40))), 40) is None
    assert_all_blocks_free(manager)
    # ...but chunk by chunk, the sliding group gives back as it goes: 8-token chunks fit.
    request = make_request("a", list(range(40)))
    for _ in range(5):
        advance(manager, request, 8)
    # Every full block; sliding, the last chunk's 2 and the 2 its first query (32) reads.
    assert manager.num_held_blocks("a") == 10 + 4
    assert manager.num_free_blocks == 0
    manager.free(request)
    assert_all_blocks_free(manager)


def test_prefix_hit_needs_every_full_block_and_only_the_last_window():
    manager = make_manager()
    prompt = list(range(41))
    first = make_request("a", prompt)
    advance(manager, first, 41)
    first.append_output_token_ids(1)
    advance(manager, first, 1)  # the sliding group's blocks 0-7 go back (still cached)
    manager.free(first)
    # A second request evicts nothing: all 10 full blocks hit, sliding ones from the window.
    second = make_request("b", prompt)
    hit_blocks, num_hit_tokens = manager.get_computed_blocks(second)
    assert num_hit_tokens == 40
    assert len(hit_blocks) == 2 * 10
    assert [b.is_null for b in hit_blocks[:10]] == [True] * 8 + [False] * 2  # 33.. needed
    assert manager.allocate_slots(second, 1, num_hit_tokens, hit_blocks) is not None
    assert table(manager, "b", 1)[:10] == table_of_hits(hit_blocks[10:])
    manager.free(second)
    assert_all_blocks_free(manager)


def table_of_hits(blocks) -> list[int]:
    return [block.block_id for block in blocks]


def test_prefix_hit_stops_where_a_window_lost_its_blocks():
    manager = make_manager()
    prompt = list(range(41))
    first = make_request("a", prompt)
    advance(manager, first, 41)
    manager.free(first)
    # Evict the sliding group's blocks 6 and 7 (tokens 24..31): a hit of 40 tokens needs
    # keys 33.. only (blocks 8, 9), one of 32 needs 25.. (blocks 6, 7): gone. 28 works.
    for index in (6, 7):
        block = manager.block_pool.get_cached_block(first.block_hashes[index])
        assert block is not None
        manager.block_pool.free_block_queue.remove(block)
        manager.block_pool._evict_cached_block(block)
        manager.block_pool.free_block_queue.append(block)
    second = make_request("b", prompt)
    assert manager.get_computed_blocks(second)[1] == 40
    shorter = make_request("c", prompt[:33])  # at most 32 tokens can hit
    hit_blocks, num_hit_tokens = manager.get_computed_blocks(shorter)
    assert num_hit_tokens == 24  # keys 17.. : blocks 4, 5 still there
    assert manager.allocate_slots(shorter, 9, num_hit_tokens, hit_blocks) is not None
    manager.free(shorter)
    assert_all_blocks_free(manager)


def test_a_groups_blocks_never_answer_another_groups_lookup():
    # Only the full group's blocks of a prefix are cached (the sliding ones were evicted):
    # the sliding group must not claim them, so the hit is the window-free prefix 0.
    manager = make_manager()
    prompt = list(range(17))
    first = make_request("a", prompt)
    advance(manager, first, 17)
    manager.free(first)
    for block in manager.block_pool.blocks:
        if block.block_hash is not None and block.block_hash in first.block_hashes:
            manager.block_pool.free_block_queue.remove(block)
            manager.block_pool._evict_cached_block(block)
            manager.block_pool.free_block_queue.append(block)
    assert manager.get_computed_blocks(make_request("b", prompt))[1] == 0
    assert_all_blocks_free(manager)


def test_max_tokens_in_cache_counts_windows_once():
    groups = [SLIDING, FULL]
    # 1 null + sliding: ceil((8 + 16) / 4) + 1 = 7, the rest full: (64 - 8) * 4 tokens.
    assert max_tokens_in_cache(groups, 64, BLOCK_SIZE, 16) == 56 * 4
    assert max_tokens_in_cache([SLIDING], 64, BLOCK_SIZE, 16) is None


def test_scheduler_keeps_one_table_for_one_full_group_and_caps_length_by_groups():
    def scheduler(groups, num_blocks: int = 64) -> Scheduler:
        return Scheduler(
            SchedulerConfig(max_num_batched_tokens=16),
            CacheConfig(block_size=BLOCK_SIZE),
            num_blocks,
            1024,
            features=SchedulerFeatures(kv_cache_groups=groups),
        )

    # Llama's one full group: today's manager, exactly.
    assert type(scheduler([FULL]).kv_cache_manager) is KVCacheManager
    assert type(scheduler(None).kv_cache_manager) is KVCacheManager
    grouped = scheduler([SLIDING, FULL])
    assert isinstance(grouped.kv_cache_manager, GroupedKVCacheManager)
    assert grouped.max_model_len == 56 * 4  # max_tokens_in_cache, above
    assert scheduler([SLIDING]).max_model_len == 1024  # windows only: no cap from the cache
