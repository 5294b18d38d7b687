"""The store connector with KV cache groups, over a real backend (the shared-storage folder):
each group's blocks under its own keys, a windowed group's window only, hits that skip the
gaps a window leaves, and short loads that recompute; every test ends leak-free."""

from __future__ import annotations

from kvserve.services.kv_store.backends import SharedStorageBackend
from kvserve.services.kv_store.group_blocks import GroupBlocks
from kvserve.services.kv_store.scheduler_connector import StoreSchedulerConnector
from kvserve.services.kv_store.transfers import StoreConnectorOutput, decode_meta, encode
from kvserve.services.scheduler.core.features import SchedulerFeatures
from kvserve.services.scheduler.core.request import Request, RequestStatus
from kvserve.services.scheduler.core.scheduler import Scheduler
from kvserve.shared.config import CacheConfig, KVTransferConfig, SchedulerConfig
from kvserve.shared.kv_cache_groups import KVCacheGroupSpec
from tests.support.kv import assert_no_leaked_blocks
from tests.support.kv_store import chain, random_caches, tiny_fingerprint
from tests.support.scheduler import create_request, make_runner_output

BLOCK = 4
WINDOW = 8  # a query at p reads keys from p - 7: the window's block and the one before
FP = tiny_fingerprint(block_size=BLOCK, num_layers=1)
SLIDING = KVCacheGroupSpec(layer_indices=[0], sliding_window=WINDOW)
FULL = KVCacheGroupSpec(layer_indices=[1])
SUFFIXES = [b"", (1).to_bytes(2, "little")]


def _backend(folder) -> SharedStorageBackend:
    return SharedStorageBackend(str(folder), FP)


def _put(backend: SharedStorageBackend, keys: list[bytes]) -> None:
    backend.put(keys, random_caches(FP, len(keys) + 1), list(range(1, len(keys) + 1)))


def test_a_hit_needs_every_full_block_and_only_the_window_of_a_sliding_group(tmp_path):
    walk = GroupBlocks([SLIDING, FULL], SUFFIXES, BLOCK)
    hashes = chain("p", 8)
    backend = _backend(tmp_path)
    _put(backend, [h + SUFFIXES[1] for h in hashes])  # the full group: every block
    _put(backend, hashes[2:4] + hashes[5:8])  # the sliding group: a gap at block 4
    # 8 blocks: keys from 32 - 7 = 25 on, blocks 6 and 7 (held).
    assert walk.hit_end(hashes, 0, backend.lookup) == 8
    # Without block 6, no hit of 7 or 8 blocks; 6 needs block 4 (the gap), 4 needs 2 and 3.
    walk_to_7 = hashes[:6] + [b"other"] + hashes[7:]
    assert walk.hit_end(walk_to_7, 0, backend.lookup) == 4
    # Blocks the engine holds itself are not asked of the store: with 5 local, block 4
    # (the gap) is the engine's, and a hit of 6 needs only block 5 of the store.
    assert walk.hit_end(walk_to_7, 5, backend.lookup) == 6
    assert walk.load_ranges(0, 8) == [(6, 8), (0, 8)]
    assert walk.load_ranges(7, 8) == [(7, 8), (7, 8)]
    # Saves: every full block; of the sliding group, what a hit at 7 or 8 blocks reads.
    assert walk.save_ranges(0, 8) == [(5, 8), (0, 8)]
    assert walk.save_ranges(7, 8) == [(7, 8), (7, 8)]
    # A chunked-local group (Llama 4) reads its chunk: 8 tokens, blocks 2k and 2k + 1.
    chunked = GroupBlocks([KVCacheGroupSpec(layer_indices=[0], chunk_size=8), FULL], SUFFIXES, 4)
    assert chunked.load_ranges(0, 5) == [(4, 5), (0, 5)]
    assert chunked.load_ranges(0, 4) == [(4, 4), (0, 4)]  # a chunk starts: nothing to read
    assert chunked.save_ranges(0, 6) == [(4, 6), (0, 6)]


def _consumer(folder) -> Scheduler:
    config = KVTransferConfig(
        kv_connector="SharedStorageConnector",
        kv_role="kv_consumer",
        kv_connector_extra_config={"shared_storage_path": str(folder)},
    )
    return Scheduler(
        SchedulerConfig(max_num_batched_tokens=64),
        CacheConfig(block_size=BLOCK),
        num_blocks=64,
        max_model_len=256,
        features=SchedulerFeatures(
            kv_cache_groups=[SLIDING, FULL],
            kv_connector=StoreSchedulerConnector(config, FP, BLOCK),
        ),
    )


def _load_step(scheduler: Scheduler, num_loaded: int):
    so = scheduler.schedule()
    (load,) = decode_meta(so.kv_connector_metadata).loads
    out = make_runner_output(scheduler, so)
    out.kv_connector_output = encode(StoreConnectorOutput(loaded={"c": num_loaded}))
    scheduler.update_from_output(so, out)
    return load


def _stored_prompt(scheduler: Scheduler, folder) -> list[int]:
    """A 17-token prompt (4 blocks can hit) whose blocks the store holds in both groups."""
    tokens = list(range(700, 717))
    hashes = Request.from_engine_core_request(
        create_request("h", prompt_token_ids=tokens), scheduler.block_hasher
    ).block_hashes
    backend = _backend(folder)
    _put(backend, hashes[:4])
    _put(backend, [h + SUFFIXES[1] for h in hashes[:4]])
    return tokens


def test_a_load_moves_each_groups_blocks_and_holds_what_a_local_hit_would(tmp_path):
    scheduler = _consumer(tmp_path)
    tokens = _stored_prompt(scheduler, tmp_path)
    scheduler.add_request(create_request("c", prompt_token_ids=tokens, max_tokens=2))
    load = _load_step(scheduler, 6)
    request = scheduler.requests["c"]
    hashes = request.block_hashes
    # 4 blocks: the sliding group reads keys from 16 - 7 = 9 on (blocks 2, 3), the full all.
    assert load.block_hashes == hashes[2:4] + [h + SUFFIXES[1] for h in hashes[:4]]
    sliding, full = scheduler.kv_cache_manager.get_group_block_ids("c")
    assert sliding[:2] == [0, 0] and 0 not in sliding[2:] and 0 not in full
    assert load.block_ids == sliding[2:4] + full[:4]
    assert request.num_computed_tokens == 16
    so = scheduler.schedule()
    assert so.num_scheduled_tokens == {"c": 1}
    for _ in range(3):
        scheduler.update_from_output(so, make_runner_output(scheduler, so))
        so = scheduler.schedule()
    assert_no_leaked_blocks(scheduler)


def test_a_short_load_that_leaves_a_window_unfilled_recomputes_from_the_start(tmp_path):
    scheduler = _consumer(tmp_path)
    tokens = _stored_prompt(scheduler, tmp_path)
    scheduler.add_request(create_request("c", prompt_token_ids=tokens, max_tokens=1))
    # 3 of 6: the sliding group's 2, the full group's first; no hit every group serves.
    _load_step(scheduler, 3)
    request = scheduler.requests["c"]
    assert request.status == RequestStatus.WAITING and request.num_computed_tokens == 0
    assert scheduler.kv_cache_manager.num_held_blocks("c") == 0
    so = scheduler.schedule()
    assert so.num_scheduled_tokens == {"c": 17}
    assert not decode_meta(so.kv_connector_metadata).loads  # loaded once: no second try
    scheduler.update_from_output(so, make_runner_output(scheduler, so))
    assert_no_leaked_blocks(scheduler)
