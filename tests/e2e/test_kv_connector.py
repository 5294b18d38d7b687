"""The KV connector through whole engines on the default model (float32) and a real
`kvserve kv-store` process: a prefix computed by one engine is an external hit for another
and for a restarted one, outputs stay equal, the shared-storage connector round-trips, the
offload tier brings evicted blocks back, a store killed under load only costs recompute,
aborts leave nothing pinned, and a different layout never hits."""

from __future__ import annotations

import time

import pytest

from kvserve import LLM, SamplingParams
from kvserve.services.kv_store.client import KvStoreClient
from kvserve.shared.messages import KvFingerprint
from tests.support.kv import assert_no_leaked_blocks
from tests.support.kv_store import StoreProcess
from tests.support.models import DEFAULT_MODEL_KV_CACHE_MEMORY

pytestmark = pytest.mark.slow

PROMPTS = [
    "Summarise this note for a colleague. " + "The meeting moved to Thursday at ten. " * 12,
    "Translate into French, line by line. " + "Good morning, how are you today? " * 10,
]
PARAMS = SamplingParams(temperature=0.0, max_tokens=12)


@pytest.fixture
def store():
    process = StoreProcess("--size", "512M")
    _wait_ready(process.ipc)
    yield process
    process.stop()


def _wait_ready(address: str, timeout_s: float = 30.0) -> None:
    from kvserve.shared.messages import KvFingerprint

    probe = KvFingerprint(model="probe", dtype="float32", block_size=16, num_layers=1,
                          num_kv_heads=1, head_size=8)  # fmt: skip
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with KvStoreClient(address, probe, timeout_s=0.5):
                return
        except Exception:  # noqa: BLE001 - not up yet
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def _transfer(address: str, role: str = "kv_both", connector: str = "KvStoreConnector") -> dict:
    return {"kv_connector": connector, "kv_role": role,
            "kv_connector_extra_config": {"store_address": address, "timeout_s": 1.0}}  # fmt: skip


def _generate(llm: LLM, prompts=PROMPTS) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, PARAMS, use_tqdm=False)]


def _store_stats(store: StoreProcess, llm: LLM):
    (fingerprint,) = llm.engine_core.executor.collective_rpc(
        "kv_fingerprint", ranks=[0], result_type=KvFingerprint
    )
    with KvStoreClient(store.ipc, fingerprint, timeout_s=2.0) as client:
        return client.stats()


def test_a_prefix_computed_by_one_engine_is_an_external_hit_for_another(store):
    reference = _generate(LLM(dtype="float32", kv_cache_memory=DEFAULT_MODEL_KV_CACHE_MEMORY))
    first = LLM(
        dtype="float32",
        kv_cache_memory=DEFAULT_MODEL_KV_CACHE_MEMORY,
        kv_transfer_config=_transfer(store.ipc, "kv_producer"),
    )
    assert _generate(first) == reference
    assert first.stats_totals.kv_bytes_saved > 0
    assert first.stats_totals.external_prefix_cache_hits == 0  # a producer never loads
    del first  # what it saved is in the store; its memory goes to the next engine
    second = LLM(
        dtype="float32",
        kv_cache_memory=DEFAULT_MODEL_KV_CACHE_MEMORY,
        kv_transfer_config=_transfer(store.ipc, "kv_consumer"),
    )
    assert _generate(second) == reference
    totals = second.stats_totals
    assert totals.external_prefix_cache_hits >= 0.8 * sum(len(p) // 4 for p in PROMPTS)
    assert totals.kv_bytes_loaded > 0 and totals.kv_bytes_saved == 0
    assert_no_leaked_blocks(second.engine_core.scheduler)
    stats = _store_stats(store, second)
    assert stats.num_pinned == 0 and stats.num_reserved == 0 and stats.num_leases == 0


def test_a_restarted_engine_gets_its_prefix_back(store):
    llm = LLM(
        dtype="float32",
        kv_cache_memory=DEFAULT_MODEL_KV_CACHE_MEMORY,
        kv_transfer_config=_transfer(store.ipc),
    )
    reference = _generate(llm)
    llm.engine_core.shutdown()
    del llm
    restarted = LLM(
        dtype="float32",
        kv_cache_memory=DEFAULT_MODEL_KV_CACHE_MEMORY,
        kv_transfer_config=_transfer(store.ipc),
    )
    assert _generate(restarted) == reference
    assert restarted.stats_totals.external_prefix_cache_hits > 0
    assert_no_leaked_blocks(restarted.engine_core.scheduler)


def test_the_shared_storage_connector_round_trips(tmp_path):
    config = {"kv_connector": "SharedStorageConnector",
              "kv_connector_extra_config": {"shared_storage_path": str(tmp_path)}}  # fmt: skip
    writer = LLM(
        dtype="float32", kv_cache_memory=DEFAULT_MODEL_KV_CACHE_MEMORY, kv_transfer_config=config
    )
    reference = _generate(writer)
    assert list(tmp_path.rglob("*.kv")), "no block files written"
    del writer
    reader = LLM(
        dtype="float32", kv_cache_memory=DEFAULT_MODEL_KV_CACHE_MEMORY, kv_transfer_config=config
    )
    assert _generate(reader) == reference
    assert reader.stats_totals.external_prefix_cache_hits > 0


def test_a_different_layout_never_hits(store):
    LLM(
        dtype="float32",
        kv_cache_memory=DEFAULT_MODEL_KV_CACHE_MEMORY,
        kv_transfer_config=_transfer(store.ipc),
    ).generate(PROMPTS, PARAMS, use_tqdm=False)
    other = LLM(
        dtype="bfloat16",
        kv_cache_memory=DEFAULT_MODEL_KV_CACHE_MEMORY,
        kv_transfer_config=_transfer(store.ipc),
    )
    _generate(other)
    assert other.stats_totals.external_prefix_cache_hits == 0
    assert other.stats_totals.external_prefix_cache_queries > 0


def test_the_offload_tier_brings_evicted_blocks_back():
    # 9 blocks of 16 tokens: each prompt (~100 tokens, 7 blocks) evicts the other's.
    llm = LLM(dtype="float32", kv_offloading_size=0.25, num_gpu_blocks_override=10)
    reference = _generate(llm, PROMPTS[:1])
    _generate(llm, PROMPTS[1:])  # evicts the first prompt's blocks into the store
    assert llm.stats_totals.kv_bytes_saved > 0
    assert _generate(llm, PROMPTS[:1]) == reference
    assert llm.stats_totals.external_prefix_cache_hits > 0
    assert_no_leaked_blocks(llm.engine_core.scheduler)
    process = llm.engine_core._offload_store
    llm.engine_core.shutdown()
    assert process.poll() is not None  # the engine's store stops with it


def test_a_store_killed_under_load_only_costs_recompute(store):
    llm = LLM(
        dtype="float32",
        kv_cache_memory=DEFAULT_MODEL_KV_CACHE_MEMORY,
        kv_transfer_config=_transfer(store.ipc),
    )
    reference = _generate(llm)
    core = llm.engine_core
    many = [p + f" Request {i}." for i in range(6) for p in PROMPTS]
    for i, prompt in enumerate(many):
        llm._add_request(f"load-{i}", prompt, llm._tokenize(prompt)[1], PARAMS, 0)
    core.step()
    store.kill()
    finished = 0
    up = []
    while core.has_work():
        step = core.step()
        finished += sum(1 for out in step.outputs if out.finished)
        if step.scheduler_stats is not None:
            up.append(step.scheduler_stats.kv_store_up)
    assert finished == len(many)
    assert False in up  # the stats said so
    assert_no_leaked_blocks(core.scheduler)
    store.restart()
    _wait_ready(store.ipc)
    assert _generate(llm) == reference  # recomputed or reloaded, the same tokens


def test_an_abort_storm_leaves_nothing_pinned(store):
    warm = LLM(
        dtype="float32",
        kv_cache_memory=DEFAULT_MODEL_KV_CACHE_MEMORY,
        kv_transfer_config=_transfer(store.ipc),
    )
    _generate(warm)
    del warm
    llm = LLM(
        dtype="float32",
        kv_cache_memory=DEFAULT_MODEL_KV_CACHE_MEMORY,
        kv_transfer_config=_transfer(store.ipc),
    )
    core = llm.engine_core
    ids = []
    for i in range(20):
        prompt = PROMPTS[i % 2]
        llm._add_request(f"storm-{i}", prompt, llm._tokenize(prompt)[1], PARAMS, 0)
        ids.append(f"storm-{i}")
        if i % 3 == 0:
            core.step()  # some are loading, some computing, some queued
        if i % 4 == 1:
            core.abort_requests(list(core.scheduler.requests)[: i % 5 + 1])
    core.abort_requests(list(core.scheduler.requests))
    while core.has_work():
        core.step()
    assert_no_leaked_blocks(core.scheduler)
    stats = _store_stats(store, llm)
    assert stats.num_pinned == 0 and stats.num_leases == 0 and stats.num_reserved == 0
