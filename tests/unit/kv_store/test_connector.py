"""The KV connector's two halves over a real backend (the shared-storage folder): external
hits park a request until its blocks load, partial loads recompute the rest, producers save
each full block once, the offload tier saves evicted blocks first, and nothing leaks."""

from __future__ import annotations

import torch

from kvserve.services.kv_store.backends import SharedStorageBackend
from kvserve.services.kv_store.scheduler_connector import StoreSchedulerConnector
from kvserve.services.kv_store.transfers import (
    KVBlockTransfer,
    StoreConnectorMeta,
    StoreConnectorOutput,
    decode_meta,
    decode_output,
    encode,
)
from kvserve.services.kv_store.worker_connector import StoreWorkerConnector
from kvserve.services.scheduler.core.request import RequestStatus
from kvserve.shared.config import KVTransferConfig
from tests.support.kv import assert_no_leaked_blocks
from tests.support.kv_store import random_caches, tiny_fingerprint
from tests.support.scheduler import create_request, create_scheduler, make_runner_output

BLOCK = 4
FP = tiny_fingerprint(block_size=BLOCK)


def _config(folder, role="kv_both", connector="SharedStorageConnector") -> KVTransferConfig:
    return KVTransferConfig(
        kv_connector=connector,
        kv_role=role,
        kv_connector_extra_config={"shared_storage_path": str(folder)},
    )


def _scheduler(folder, role="kv_both", **kwargs):
    connector = StoreSchedulerConnector(_config(folder, role), FP, BLOCK)
    return create_scheduler(block_size=BLOCK, kv_connector=connector, **kwargs)


def _run_step(scheduler, kv_loaded=None):
    """One step; returns the step's decoded connector metadata in place of its output."""
    so = scheduler.schedule()
    out = make_runner_output(scheduler, so)
    out.kv_connector_output = _answer(kv_loaded)
    return so, decode_meta(so.kv_connector_metadata), scheduler.update_from_output(so, out)


def _answer(kv_loaded) -> bytes:
    """What a worker connector would answer: these blocks loaded."""
    return encode(StoreConnectorOutput(loaded=kv_loaded or {}))


def test_a_producer_saves_each_full_block_once(tmp_path):
    scheduler = _scheduler(tmp_path, "kv_producer", max_num_batched_tokens=6)
    request = create_request("a", prompt_token_ids=list(range(100, 111)), max_tokens=6)
    scheduler.add_request(request)
    saved = []
    for _ in range(8):
        _, meta, _ = _run_step(scheduler)
        saved += [h for t in meta.saves for h in t.block_hashes]
        assert not meta.loads  # a producer never loads
    # 11 prompt tokens + 6 outputs = 17 tokens: 4 full blocks, each saved once, in order.
    req = scheduler.requests.get("a")
    assert req is None  # finished
    assert len(saved) == 4 and len(set(saved)) == 4


def test_a_consumer_waits_for_its_external_blocks_then_computes_the_rest(tmp_path):
    tokens = list(range(200, 214))  # 14 tokens: 3 full blocks can hit (the last is recomputed)
    # Another engine saved the prompt's blocks.
    producer = _scheduler(tmp_path, "kv_producer")
    producer.add_request(create_request("p", prompt_token_ids=tokens, max_tokens=1))
    _, meta, _ = _run_step(producer)
    backend = SharedStorageBackend(str(tmp_path), FP)
    caches = random_caches(FP, 32, seed=1)
    (save,) = meta.saves
    assert backend.put(save.block_hashes, caches, save.block_ids) == 3

    consumer = _scheduler(tmp_path, "kv_consumer")
    consumer.add_request(create_request("c", prompt_token_ids=tokens, max_tokens=2))
    so, meta, outputs = _run_step(consumer, {"c": 3})
    assert outputs == [] and so.num_scheduled_tokens == {}
    (load,) = meta.loads
    assert load.block_hashes == save.block_hashes and len(load.block_ids) == 3
    request = consumer.requests["c"]
    assert request.status == RequestStatus.WAITING and request.num_computed_tokens == 12
    so, _, _ = _run_step(consumer)
    assert so.num_scheduled_tokens == {"c": 2}  # only the tail past the loaded blocks
    (new,) = so.scheduled_new_reqs
    assert new.num_computed_tokens == 12 and new.block_ids[:3] == load.block_ids
    stats = consumer.make_stats()
    assert stats.external_prefix_cache_hits == 12 and stats.external_prefix_cache_queries == 14
    # The loaded blocks are now local prefix hits for a second request.
    second = _hashed(consumer, create_request("d", prompt_token_ids=tokens))
    _, num_hit = consumer.kv_cache_manager.get_computed_blocks(second)
    assert num_hit == 12
    for _ in range(4):
        _run_step(consumer)
    assert_no_leaked_blocks(consumer)


def test_a_partial_load_recomputes_the_missing_blocks(tmp_path):
    tokens = list(range(300, 317))  # 17 tokens: 4 full blocks can hit
    consumer = _scheduler(tmp_path, "kv_consumer")
    request = create_request("c", prompt_token_ids=tokens, max_tokens=1)
    hashes = _hashed(consumer, request).block_hashes
    backend = SharedStorageBackend(str(tmp_path), FP)
    backend.put(hashes[:4], random_caches(FP, 8), [1, 2, 3, 4])
    consumer.add_request(request)
    _, meta, _ = _run_step(consumer, {"c": 1})  # the worker found only the first block
    assert len(meta.loads[0].block_hashes) == 4
    assert consumer.requests["c"].num_computed_tokens == 4
    so, _, _ = _run_step(consumer)
    assert so.num_scheduled_tokens == {"c": 13}
    assert_no_leaked_blocks(consumer)


def _hashed(scheduler, engine_request):
    from kvserve.services.scheduler.core.request import Request

    return Request.from_engine_core_request(engine_request, scheduler.block_hasher)


def test_an_abort_while_loading_frees_everything(tmp_path):
    tokens = list(range(400, 413))
    consumer = _scheduler(tmp_path, "kv_consumer")
    request = create_request("c", prompt_token_ids=tokens, max_tokens=4)
    hashes = _hashed(consumer, request).block_hashes
    SharedStorageBackend(str(tmp_path), FP).put(hashes, random_caches(FP, 8), [1, 2, 3])
    consumer.add_request(request)
    so = consumer.schedule()
    assert decode_meta(so.kv_connector_metadata).loads
    assert consumer.requests["c"].status == RequestStatus.WAITING_FOR_REMOTE_KVS
    consumer.finish_requests("c", RequestStatus.FINISHED_ABORTED)
    out = make_runner_output(consumer, so)
    out.kv_connector_output = _answer({"c": 3})  # the load finished after the abort: ignored
    consumer.update_from_output(so, out)
    assert_no_leaked_blocks(consumer)


def test_the_offload_tier_saves_evicted_blocks_before_they_are_rewritten(tmp_path):
    config = KVTransferConfig(
        kv_connector="OffloadingConnector",
        kv_connector_extra_config={"store_address": "ipc:///nonexistent-kvserve-test"},
    )
    connector = StoreSchedulerConnector(config, FP, BLOCK)
    connector.store.backend = SharedStorageBackend(str(tmp_path), FP)
    scheduler = create_scheduler(block_size=BLOCK, num_blocks=5, kv_connector=connector)
    scheduler.add_request(create_request("a", prompt_token_ids=list(range(500, 508)), max_tokens=1))
    _run_step(scheduler)
    # "a" finished: its 2 full blocks are cached and free. "b" needs all 4 blocks.
    scheduler.add_request(create_request("b", prompt_token_ids=list(range(600, 615)), max_tokens=1))
    _, meta, _ = _run_step(scheduler)
    (evicted,) = meta.saves_before
    assert len(evicted.block_hashes) == 2 and not meta.saves
    assert_no_leaked_blocks(scheduler)


def test_worker_connector_round_trips_blocks_bit_equal(tmp_path):
    caches = random_caches(FP, 8, seed=3)
    worker = StoreWorkerConnector(_config(tmp_path), FP, caches)
    hashes = [bytes([i]) * 16 for i in range(3)]
    worker.save([KVBlockTransfer("a", hashes, [5, 6, 7])])
    others = [torch.zeros_like(c) for c in caches]
    loader = StoreWorkerConnector(_config(tmp_path), FP, others)
    assert loader.load([KVBlockTransfer("a", hashes + [b"\xff" * 16], [1, 2, 3, 4])]) == {"a": 3}
    for src, dst in zip(caches, others):
        assert torch.equal(dst[:, 1:4], src[:, 5:8])
        assert not dst[:, 4].any()
    seconds, bytes_loaded, bytes_saved = loader.take_stats()
    assert bytes_loaded == 3 * FP.block_bytes and len(seconds) == 1


def test_a_store_that_is_down_means_no_hits_and_nothing_loaded():
    config = KVTransferConfig(
        kv_connector="KvStoreConnector",
        kv_connector_extra_config={"store_address": "ipc:///nonexistent-kvserve", "timeout_s": 0.2},
    )
    connector = StoreSchedulerConnector(config, FP, BLOCK)
    request = _hashed(create_scheduler(block_size=BLOCK), create_request("a", num_tokens=13))
    assert connector.num_external_blocks(request, 0) == 0
    assert not connector.store_up
    worker = StoreWorkerConnector(config, FP, random_caches(FP, 4))
    assert worker.load([KVBlockTransfer("a", [b"x" * 16], [1])]) == {"a": 0}
    assert not worker.store_up


def test_worker_connector_answers_the_metadata_around_the_forward(tmp_path):
    caches = random_caches(FP, 8, seed=4)
    hashes = [bytes([i]) * 16 for i in range(10, 12)]
    saver = StoreWorkerConnector(_config(tmp_path), FP, caches)
    meta = encode(StoreConnectorMeta(saves=[KVBlockTransfer("a", hashes, [2, 3])]))
    saver.before_forward(meta)
    answer = decode_output(saver.after_forward(meta))
    assert answer.bytes_saved == 2 * FP.block_bytes and answer.loaded == {}
    others = [torch.zeros_like(c) for c in caches]
    loader = StoreWorkerConnector(_config(tmp_path), FP, others)
    meta = encode(StoreConnectorMeta(loads=[KVBlockTransfer("b", hashes, [5, 6])]))
    loader.before_forward(meta)
    answer = decode_output(loader.after_forward(meta))
    assert answer.loaded == {"b": 2} and answer.store_ok
    for src, dst in zip(caches, others):
        assert torch.equal(dst[:, 5:7], src[:, 2:4])


class _PinningStorage(SharedStorageBackend):
    """The shared-storage folder with a store's pin call, which it records."""

    def __init__(self, folder, fingerprint):
        super().__init__(folder, fingerprint)
        self.pins: list[tuple[list[bytes], float]] = []

    def pin(self, block_hashes, ttl_s=None):
        self.pins.append((list(block_hashes), ttl_s))


def test_a_prompt_pin_is_written_through_then_pinned_in_the_store(tmp_path):
    import msgspec

    from kvserve.shared.messages import PromptPin

    scheduler = _scheduler(tmp_path, "kv_consumer")
    backend = _PinningStorage(str(tmp_path), FP)
    scheduler.kv_connector.store.backend = backend
    request = create_request("a", prompt_token_ids=list(range(100, 111)), max_tokens=1)
    scheduler.add_request(msgspec.structs.replace(request, pins=[PromptPin(8, 60.0, "5m")]))
    _run_step(scheduler)  # computes the prompt and finishes: the pin is taken
    assert scheduler.pins.num_pinned_blocks == 2
    _, meta, _ = _run_step(scheduler)
    (save,) = meta.saves_before
    assert save.req_id == "pin-1" and len(save.block_hashes) == len(save.block_ids) == 2
    assert backend.pins == [(save.block_hashes, 60.0)]
    scheduler.pins.release_all()
    assert_no_leaked_blocks(scheduler)
