"""DeepSeek's latent KV cache through whole engines (`kvserve.LLM`, tiny random V2/V3 models,
float32): prompts chunked beside other requests' decodes, and latent blocks that leave the
engine (evicted into the offload tier's store, written as shared-storage files) and come back
as external prefix hits; and over two pipeline stages. Every output equals HF transformers'
greedy tokens."""

from __future__ import annotations

import pytest

from kvserve import LLM, SamplingParams
from tests.support.family_llm import family_dirs
from tests.support.hf_models import NUM_TOKENS, PROMPTS, hf_greedy
from tests.support.kv import assert_no_leaked_blocks
from tests.support.kv_store import StoreProcess

PARAMS = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True)
# Two 100-token prompts (7 blocks of 16 each): in a 10-block cache each evicts the other.
LONG_PROMPTS = [[(5 * i + 1) % 128 for i in range(100)], [(11 * i + 4) % 128 for i in range(100)]]


@pytest.fixture(scope="module")
def mla_dirs(tmp_path_factory):
    return family_dirs(tmp_path_factory)


def _generate(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    requests = [{"prompt_token_ids": ids} for ids in prompts]
    return [o.outputs[0].token_ids for o in llm.generate(requests, PARAMS, use_tqdm=False)]


def _llm(model_dir: str, tokenizer: str, **kwargs) -> LLM:
    return LLM(model_dir, tokenizer=tokenizer, dtype="float32", max_model_len=256, **kwargs)


@pytest.mark.parametrize("kind", ["deepseek_v2", "deepseek_v3"])
def test_chunked_prefills_beside_decodes_equal_hf(mla_dirs, default_model_dir, kind):
    # 16 tokens a step over 3 requests of 21-46 prompt tokens: every prompt is chunked, and
    # the later chunks share steps with the earlier requests' decodes.
    model_dir, hf_model = mla_dirs(kind)
    llm = _llm(
        model_dir,
        default_model_dir,
        kv_cache_memory=32 << 20,
        max_num_batched_tokens=16,
        max_num_seqs=3,
    )
    try:
        first = _generate(llm, PROMPTS)
        requests = [{"prompt_token_ids": ids} for ids in PROMPTS]
        outputs = llm.generate(requests, PARAMS, use_tqdm=False)  # hits in the latent cache
        second = [o.outputs[0].token_ids for o in outputs]
        assert all(o.num_cached_tokens >= 16 for o in outputs)
        assert_no_leaked_blocks(llm.engine_core.scheduler)
    finally:
        llm.engine_core.shutdown()
    assert first == [hf_greedy(hf_model, prompt) for prompt in PROMPTS]
    assert second == first


def test_the_offload_tier_brings_latent_blocks_back(mla_dirs, default_model_dir):
    model_dir, hf_model = mla_dirs("deepseek_v3")
    llm = _llm(model_dir, default_model_dir, kv_offloading_size=0.25, num_gpu_blocks_override=10)
    try:
        reference = _generate(llm, LONG_PROMPTS[:1])
        _generate(llm, LONG_PROMPTS[1:])  # evicts the first prompt's blocks into the store
        assert llm.stats_totals.kv_bytes_saved > 0
        assert _generate(llm, LONG_PROMPTS[:1]) == reference
        assert llm.stats_totals.external_prefix_cache_hits > 0
        assert_no_leaked_blocks(llm.engine_core.scheduler)
    finally:
        llm.engine_core.shutdown()
    assert reference == [hf_greedy(hf_model, LONG_PROMPTS[0])]


def test_shared_storage_round_trips_latent_blocks(mla_dirs, default_model_dir, tmp_path):
    model_dir, hf_model = mla_dirs("deepseek_v2")
    config = {"kv_connector": "SharedStorageConnector",
              "kv_connector_extra_config": {"shared_storage_path": str(tmp_path)}}  # fmt: skip
    writer = _llm(model_dir, default_model_dir, kv_cache_memory=32 << 20, kv_transfer_config=config)
    reference = _generate(writer, LONG_PROMPTS)
    writer.engine_core.shutdown()
    files = list(tmp_path.rglob("*.kv"))
    assert files, "no block files written"
    # One latent plane per layer: 2 layers x 16 tokens x (32 + 8) float32 values a block.
    assert {f.stat().st_size for f in files} == {2 * 16 * 40 * 4}
    reader = _llm(model_dir, default_model_dir, kv_cache_memory=32 << 20, kv_transfer_config=config)
    try:
        assert _generate(reader, LONG_PROMPTS) == reference
        assert reader.stats_totals.external_prefix_cache_hits > 0
    finally:
        reader.engine_core.shutdown()
    assert reference == [hf_greedy(hf_model, prompt) for prompt in LONG_PROMPTS]


def test_pipeline_parallel_2_equals_hf(mla_dirs, default_model_dir):
    # V3's dense first layer on one stage, its MoE layers on the other.
    model_dir, hf_model = mla_dirs("deepseek_v3")
    llm = _llm(model_dir, default_model_dir, kv_cache_memory=32 << 20, pipeline_parallel_size=2)
    try:
        assert _generate(llm, PROMPTS) == [hf_greedy(hf_model, prompt) for prompt in PROMPTS]
    finally:
        llm.engine_core.shutdown()


@pytest.mark.slow  # a store process and two engines
def test_a_producers_latent_blocks_are_a_consumers_prefix(mla_dirs, default_model_dir):
    # P/D's path: a producer engine saves the prompts' latent blocks to a `kvserve kv-store`
    # process, a consumer engine loads them as external prefix hits and only decodes.
    import time

    from kvserve.services.kv_store.client import KvStoreClient
    from kvserve.shared.messages import KvFingerprint

    model_dir, hf_model = mla_dirs("deepseek_v2")
    store = StoreProcess("--size", "64M")
    probe = KvFingerprint(model="probe", dtype="float32", block_size=16, num_layers=1,
                          num_kv_heads=1, head_size=8, num_planes=1)  # fmt: skip
    deadline = time.monotonic() + 30
    while True:
        try:
            with KvStoreClient(store.ipc, probe, timeout_s=0.5):
                break
        except Exception:  # noqa: BLE001 - not up yet
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)

    def engine(role: str) -> LLM:
        extra = {"store_address": store.ipc, "timeout_s": 1.0}
        transfer = {"kv_connector": "KvStoreConnector", "kv_role": role,
                    "kv_connector_extra_config": extra}  # fmt: skip
        return _llm(
            model_dir, default_model_dir, kv_cache_memory=32 << 20, kv_transfer_config=transfer
        )

    try:
        producer = engine("kv_producer")
        produced = _generate(producer, LONG_PROMPTS)
        assert producer.stats_totals.kv_bytes_saved > 0
        producer.engine_core.shutdown()
        consumer = engine("kv_consumer")
        try:
            assert _generate(consumer, LONG_PROMPTS) == produced
            assert consumer.stats_totals.external_prefix_cache_hits > 0
            assert_no_leaked_blocks(consumer.engine_core.scheduler)
        finally:
            consumer.engine_core.shutdown()
    finally:
        store.stop()
    assert produced == [hf_greedy(hf_model, prompt) for prompt in LONG_PROMPTS]
