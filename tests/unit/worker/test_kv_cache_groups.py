"""KV cache groups through a real in-process engine: tiny Gemma 2, Gemma 3 and Mistral models
with a 16-token window and prompts many windows long, against HF transformers (float32).

The sliding groups give back what leaves their window, so the blocks in use while decoding
stay within the full groups' share plus a window per sliding group; tokens and logprobs stay
HF's, from the prefix cache too, and under preemption; every block comes back.
"""

from __future__ import annotations

import pathlib

import msgspec
import pytest
import torch

from kvserve.services.scheduler.core.request import Request
from kvserve.services.scheduler.engine.engine_core import EngineCore
from kvserve.services.worker.kv_cache_groups import plan_kv_cache_groups
from kvserve.services.worker.layers.attention import Attention
from kvserve.shared.config import (
    CacheConfig,
    EngineConfig,
    KVEventsConfig,
    KVTransferConfig,
    ModelConfig,
    SchedulerConfig,
    SpeculativeConfig,
)
from kvserve.shared.kv_cache_groups import KVCacheGroupSpec
from kvserve.shared.messages import EngineCoreRequest
from kvserve.shared.sampling_params import SamplingParams
from tests.support.hf_models import VOCAB_SIZE, make_tiny_family_model
from tests.support.kv import assert_no_leaked_blocks
from tests.support.model_steps import random_tokens

WINDOW = 16
BLOCK_SIZE = 16
PROMPT_LEN = 150  # over 9 windows
NUM_NEW = 12
CHUNK = 64  # max_num_batched_tokens: the prompt runs in 3 chunks
_S, _F = "sliding_attention", "full_attention"
# Gemma 2: 2 groups of 2 layers (2 cache tensors); Gemma 3: 5 sliding layers in 6, so 6
# groups of 1; Mistral: one group, all sliding.
MODELS = {
    "gemma2": dict(num_hidden_layers=4, layer_types=[_S, _F, _S, _F]),
    "gemma3": dict(num_hidden_layers=6, layer_types=[_S] * 5 + [_F]),
    "mistral": {},
}


# Room for one request's prefill at a time (a chunk holds a sliding group's window and 64
# new tokens), so three requests at once preempt.
NUM_BLOCKS = {"gemma2": 30, "gemma3": 60, "mistral": 8}


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    """kind -> (an in-process EngineCore over its tiny checkpoint, the HF model), built once."""
    cache: dict[str, tuple[EngineCore, object]] = {}

    def get(kind: str):
        if kind not in cache:
            model = make_tiny_family_model(
                kind, sliding_window=WINDOW, max_position_embeddings=256, **MODELS[kind]
            )
            model_dir = str(tmp_path_factory.mktemp(f"kvgroups-{kind}"))
            model.save_pretrained(model_dir)
            config = EngineConfig(
                model=ModelConfig(model=model_dir, dtype="float32"),
                cache=CacheConfig(block_size=BLOCK_SIZE, num_gpu_blocks_override=NUM_BLOCKS[kind]),
                scheduler=SchedulerConfig(max_num_batched_tokens=CHUNK, max_num_seqs=4),
            )
            cache[kind] = (EngineCore(config, model_dir), model)
        return cache[kind]

    yield get
    for core, _ in cache.values():
        core.shutdown()


def _run(core: EngineCore, prompts: dict[str, list[int]], on_step=None) -> dict:
    """Greedy NUM_NEW tokens of each prompt, all at once: req_id -> (tokens, logprobs,
    cached prompt tokens)."""
    params = SamplingParams(temperature=0.0, max_tokens=NUM_NEW, ignore_eos=True, logprobs=1)
    for req_id, prompt in prompts.items():
        core.add_request(EngineCoreRequest(req_id, prompt, params))
    results = {req_id: ([], [], 0) for req_id in prompts}
    while core.scheduler.has_requests():
        for out in core.step().outputs:
            assert out.error is None, out.error
            tokens, logprobs, cached = results[out.request_id]
            tokens += out.new_token_ids
            assert out.new_logprobs is not None
            logprobs += [row[0] for row in out.new_logprobs.logprobs]
            results[out.request_id] = (tokens, logprobs, cached or out.num_cached_tokens)
        if on_step is not None:
            on_step()
    return results


@torch.no_grad()
def _assert_equals_hf(hf_model, prompt: list[int], tokens: list[int], logprobs: list[float]):
    """Our greedy tokens are HF's argmax, and their logprobs HF's, teacher-forced."""
    logits = hf_model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1]
    hf_logprobs = torch.log_softmax(logits.float(), dim=-1)
    assert tokens == hf_logprobs.argmax(dim=-1).tolist()
    expected = hf_logprobs.gather(1, torch.tensor(tokens)[:, None])[:, 0]
    torch.testing.assert_close(torch.tensor(logprobs), expected, atol=2e-4, rtol=0)


def _blocks_in_use(core: EngineCore) -> int:
    manager = core.scheduler.kv_cache_manager
    return manager.num_total_blocks - manager.num_free_blocks


@pytest.mark.parametrize("kind", list(MODELS))
def test_window_bounded_blocks_equal_hf_and_prefix_hits(engines, kind):
    core, hf_model = engines(kind)
    groups = core.scheduler.kv_cache_manager.groups
    num_full = sum(group.is_full for group in groups)
    assert len(groups) == {"gemma2": 2, "gemma3": 6, "mistral": 1}[kind]
    assert num_full == (0 if kind == "mistral" else 1)
    prompt = random_tokens(PROMPT_LEN, VOCAB_SIZE, seed=11)
    # Decoding: a full group holds every block, a sliding one its window's and the next.
    num_total = -(-(PROMPT_LEN + NUM_NEW) // BLOCK_SIZE)
    bound = num_full * num_total + (len(groups) - num_full) * (WINDOW // BLOCK_SIZE + 1)
    peak: list[int] = []

    def check_bound():
        request = core.scheduler.requests.get("a")
        if request is not None and request.num_computed_tokens > PROMPT_LEN:  # decoding
            peak.append(_blocks_in_use(core))
            assert peak[-1] <= bound, f"{peak[-1]} blocks in use, window bound {bound}"

    first = _run(core, {"a": prompt}, check_bound)["a"]
    assert peak and max(peak) < len(groups) * num_total  # less than one table for all
    _assert_equals_hf(hf_model, prompt, first[0], first[1])
    # Round 2 from the prefix cache: all but the last block's tokens hit.
    second = _run(core, {"b": prompt})["b"]
    assert second[2] == (PROMPT_LEN - 1) // BLOCK_SIZE * BLOCK_SIZE
    assert second[0] == first[0]
    _assert_equals_hf(hf_model, prompt, second[0], second[1])
    assert_no_leaked_blocks(core.scheduler)


@pytest.mark.parametrize("kind", list(MODELS))
def test_preemption_with_groups_equals_hf(engines, kind):
    core, hf_model = engines(kind)
    num_preemptions = core.scheduler.num_preemptions_total
    prompts = {
        f"r{i}": random_tokens(PROMPT_LEN - 10 * i, VOCAB_SIZE, seed=20 + i) for i in range(3)
    }
    results = _run(core, prompts)
    assert core.scheduler.num_preemptions_total > num_preemptions
    for req_id, prompt in prompts.items():
        _assert_equals_hf(hf_model, prompt, *results[req_id][:2])
    assert_no_leaked_blocks(core.scheduler)


def _layers(windows: list[int | None]) -> list[Attention]:
    return [Attention(4, 16, 0.25, 2, sliding_window=window) for window in windows]


def test_parts_that_move_one_table_keep_one_group_of_every_layer():
    layers = _layers([WINDOW, None, WINDOW, None])
    groups = plan_kv_cache_groups(EngineConfig(), layers, single_stage=True)
    assert [group.layer_indices for group in groups] == [[0, 2], [1, 3]]
    one_table = [KVCacheGroupSpec(layer_indices=[0, 1, 2, 3])]
    speculative = EngineConfig(
        speculative_config=SpeculativeConfig(method="ngram", num_speculative_tokens=2)
    )
    transfer = EngineConfig(
        kv_transfer_config=KVTransferConfig(
            kv_connector="KvStoreConnector",
            kv_role="kv_both",
            kv_connector_extra_config={"store_address": "ipc:///tmp/kv"},
        )
    )
    # The store's connectors move each group's blocks, KV events name each group; a
    # connector of one's own may walk one table.
    events = EngineConfig(
        kv_events_config=KVEventsConfig(enable_kv_cache_events=True, publisher="zmq")
    )
    for config in (transfer, events):
        assert plan_kv_cache_groups(config, layers, single_stage=True) == groups
    toy = EngineConfig(
        kv_transfer_config=KVTransferConfig(
            kv_connector="ToyOneTableConnector",
            kv_connector_extra_config={"store_address": "ipc:///tmp/kv"},
        )
    )
    for config in (speculative, toy):
        assert plan_kv_cache_groups(config, layers, single_stage=True) == one_table
    assert plan_kv_cache_groups(EngineConfig(), layers, single_stage=False) == one_table
    # One kind of layer: one group, whatever runs beside it.
    llama = plan_kv_cache_groups(speculative, _layers([None, None]), single_stage=True)
    assert llama == [KVCacheGroupSpec(layer_indices=[0, 1])]


# ---------------------------------------------------------------- the KV store, per group


@pytest.fixture(scope="module")
def store_engines(engines, tmp_path_factory):
    """kind -> (a kv_both engine, a kv_consumer engine (P/D's decode side), the HF model,
    the store's folder): both over one real store (the shared-storage backend), built once."""
    cache: dict[str, tuple] = {}

    def get(kind: str):
        if kind not in cache:
            local, hf_model = engines(kind)
            model_dir = local.config.model.model
            folder = str(tmp_path_factory.mktemp(f"kvstore-{kind}"))
            cores = []
            for role in ("kv_both", "kv_consumer"):
                transfer = KVTransferConfig(
                    kv_connector="SharedStorageConnector",
                    kv_role=role,
                    kv_connector_extra_config={"shared_storage_path": folder},
                )
                config = msgspec.structs.replace(local.config, kv_transfer_config=transfer)
                cores.append(EngineCore(config, model_dir))
            cache[kind] = (*cores, hf_model, folder)
        return cache[kind]

    yield get
    for both, consumer, _, _ in cache.values():
        both.shutdown()
        consumer.shutdown()


def _null_pattern(group_block_ids: list[list[int]], num_blocks: int) -> list[list[bool]]:
    return [[block_id == 0 for block_id in ids[:num_blocks]] for ids in group_block_ids]


@pytest.mark.parametrize("kind", list(MODELS))
def test_kv_store_moves_each_groups_blocks_and_loads_what_a_local_hit_gives(store_engines, kind):
    producer, consumer, hf_model, folder = store_engines(kind)
    num_groups = {"gemma2": 2, "gemma3": 6, "mistral": 1}[kind]
    assert len(consumer.scheduler.kv_cache_manager.groups) == num_groups
    prompt = random_tokens(PROMPT_LEN, VOCAB_SIZE, seed=31)
    first = _run(producer, {"a": prompt})["a"]
    _assert_equals_hf(hf_model, prompt, first[0], first[1])
    # What the producer's own cache would give a second request: each group's blocks.
    manager = producer.scheduler.kv_cache_manager
    probe = Request.from_engine_core_request(
        EngineCoreRequest("probe", prompt, SamplingParams()), producer.scheduler.block_hasher
    )
    hit_blocks, num_hit_tokens = manager.get_computed_blocks(probe)
    num_hit_blocks = num_hit_tokens // BLOCK_SIZE
    assert num_hit_blocks == (PROMPT_LEN - 1) // BLOCK_SIZE
    local_hit = [
        [block.is_null for block in hit_blocks[g * num_hit_blocks : (g + 1) * num_hit_blocks]]
        for g in range(len(manager.groups))
    ]
    # A windowed group saved only what a hit reads: fewer blocks than one table each.
    num_full_blocks = (PROMPT_LEN + NUM_NEW - 1) // BLOCK_SIZE
    num_saved = len(list(pathlib.Path(folder).rglob("*.kv")))
    assert num_saved < len(manager.groups) * num_full_blocks

    # P/D's decode side: an empty cache loads every group's blocks from the store.
    loaded: list[list[list[bool]]] = []

    def record_load():
        request = consumer.scheduler.requests.get("b")
        if request is not None and request.kv_loaded and not loaded:
            ids = consumer.scheduler.kv_cache_manager.get_group_block_ids("b")
            loaded.append(_null_pattern(ids, num_hit_blocks))
            assert request.num_computed_tokens == num_hit_tokens

    second = _run(consumer, {"b": prompt}, record_load)["b"]
    assert loaded == [local_hit]
    assert second[2] == num_hit_tokens and second[0] == first[0]
    _assert_equals_hf(hf_model, prompt, second[0], second[1])
    assert_no_leaked_blocks(producer.scheduler)
    assert_no_leaked_blocks(consumer.scheduler)


@pytest.mark.parametrize("kind", list(MODELS))
def test_preemption_with_the_kv_store_equals_hf(store_engines, kind):
    # A preempted request's saved blocks come back from the store when it is readmitted.
    core, _, hf_model, _ = store_engines(kind)
    num_preemptions = core.scheduler.num_preemptions_total
    prompts = {
        f"s{i}": random_tokens(PROMPT_LEN - 10 * i, VOCAB_SIZE, seed=40 + i) for i in range(3)
    }
    loaded: set[str] = set()

    def record_loads():
        loaded.update(r.req_id for r in core.scheduler.requests.values() if r.kv_loaded)

    results = _run(core, prompts, record_loads)
    assert core.scheduler.num_preemptions_total > num_preemptions
    assert loaded, "no preempted request came back from the store"
    for req_id, prompt in prompts.items():
        _assert_equals_hf(hf_model, prompt, *results[req_id][:2])
    assert_no_leaked_blocks(core.scheduler)


def test_the_offload_tier_keeps_evicted_blocks_per_group_and_loads_them_back(engines):
    """--kv-offloading-size (its own `kvserve kv-store` child): the blocks other prompts
    evict go to the tier under their group's keys, and the prompt's second round loads them."""
    local, hf_model = engines("gemma3")
    config = msgspec.structs.replace(
        local.config, cache=msgspec.structs.replace(local.config.cache, kv_offloading_size=0.01)
    )
    core = EngineCore(config, local.config.model.model)
    try:
        assert len(core.scheduler.kv_cache_manager.groups) == 6  # groups beside the tier
        prompt = random_tokens(PROMPT_LEN, VOCAB_SIZE, seed=51)
        first = _run(core, {"a": prompt})["a"]
        evictions = core.scheduler.kv_cache_manager.block_pool.num_cached_block_evictions
        others = {f"o{i}": random_tokens(PROMPT_LEN, VOCAB_SIZE, seed=52 + i) for i in range(2)}
        _run(core, others)
        assert core.scheduler.kv_cache_manager.block_pool.num_cached_block_evictions > evictions
        hits: list[int] = []
        core.add_request(
            EngineCoreRequest(
                "a2",
                prompt,
                SamplingParams(temperature=0.0, max_tokens=NUM_NEW, ignore_eos=True, logprobs=1),
            )
        )
        tokens: list[int] = []
        logprobs: list[float] = []
        while core.scheduler.has_requests():
            outputs = core.step()
            hits.append(outputs.scheduler_stats.external_prefix_cache_hits)
            for out in outputs.outputs:
                tokens += out.new_token_ids
                logprobs += [row[0] for row in out.new_logprobs.logprobs]
        assert sum(hits) > 0  # loaded from the tier
        assert tokens == first[0]
        _assert_equals_hf(hf_model, prompt, tokens, logprobs)
        assert_no_leaked_blocks(core.scheduler)
    finally:
        core.shutdown()
