"""A KV connector added in this file only, through the registry: a real EngineCore (Scheduler +
ModelRunner on the tiny model) saves each full block it computes into a dict, and a request
whose prefix the engine itself forgot loads those blocks back and produces the same tokens.

The seam under test: the core never reads the connector's bytes, and the connector needs no
edit of the scheduler, the runner or the messages.
"""

from __future__ import annotations

import msgspec
import pytest
import torch

from kvserve.services.kv_store.connector import SchedulerConnector, WorkerConnector
from kvserve.services.kv_store.registry import register_kv_connector
from kvserve.services.scheduler.engine.engine_core import EngineCore
from kvserve.shared.config import (
    CacheConfig,
    EngineConfig,
    KVTransferConfig,
    ModelConfig,
)
from kvserve.shared.messages import EngineCoreRequest
from kvserve.shared.sampling_params import SamplingParams
from tests.support.kv import assert_no_leaked_blocks
from tests.support.models import TINY_KV_CACHE_MEMORY

BLOCK = 16
# The toy's "store": block hash -> that block's K/V of every layer (both halves share the
# process under the uni executor).
STORE: dict[bytes, list[torch.Tensor]] = {}


class _Meta(msgspec.Struct):
    loads: list[tuple[str, list[bytes], list[int]]] = []
    saves: list[tuple[list[bytes], list[int]]] = []


class ToySchedulerConnector(SchedulerConnector):
    """Loads every full prompt block STORE holds; saves every full block computed."""

    def __init__(self, config, fingerprint, block_size):
        self.block_size = block_size
        self.loads: list[tuple[str, list[bytes], list[int]]] = []
        self.saved: dict[str, int] = {}
        self.asked: list[tuple[str, int]] = []  # (request, external blocks found)

    def num_external_blocks(self, request, num_local_blocks):
        hashes = request.block_hashes[: (request.num_tokens - 1) // self.block_size]
        n = 0
        while num_local_blocks + n < len(hashes) and hashes[num_local_blocks + n] in STORE:
            n += 1
        self.asked.append((request.req_id, n))
        return n

    def start_load(self, request, first_block, num_blocks):
        end = first_block + num_blocks
        block_ids = self.kv_cache_manager.get_block_ids(request.req_id)[first_block:end]
        self.loads.append((request.req_id, request.block_hashes[first_block:end], block_ids))

    def build_connector_meta(self, plan):
        meta = _Meta(loads=self.loads)
        self.loads = []
        for request in (*plan.scheduled_running, *plan.scheduled_new):
            end = (request.num_computed_tokens + plan.num_scheduled_tokens[request.req_id]) // (
                self.block_size
            )
            end = min(end, len(request.block_hashes))
            first = self.saved.get(request.req_id, 0)
            if end > first:
                block_ids = self.kv_cache_manager.get_block_ids(request.req_id)[first:end]
                meta.saves.append((request.block_hashes[first:end], block_ids))
                self.saved[request.req_id] = end
        return msgspec.msgpack.encode(meta) if meta.loads or meta.saves else b""

    def update_from_output(self, metadata, output):
        return msgspec.msgpack.decode(output, type=dict[str, int]) if output else {}

    def request_finished(self, request):
        self.saved.pop(request.req_id, None)


class ToyWorkerConnector(WorkerConnector):
    def __init__(self, config, fingerprint, kv_caches):
        self.kv_caches = kv_caches
        self.loaded: dict[str, int] = {}

    def before_forward(self, metadata):
        meta = msgspec.msgpack.decode(metadata, type=_Meta) if metadata else _Meta()
        self.loaded = {}
        for req_id, hashes, block_ids in meta.loads:
            for block_hash, block_id in zip(hashes, block_ids):
                for cache, saved in zip(self.kv_caches, STORE[block_hash]):
                    cache[:, block_id].copy_(saved)
            self.loaded[req_id] = len(hashes)

    def after_forward(self, metadata):
        meta = msgspec.msgpack.decode(metadata, type=_Meta) if metadata else _Meta()
        for hashes, block_ids in meta.saves:
            for block_hash, block_id in zip(hashes, block_ids):
                STORE[block_hash] = [cache[:, block_id].clone() for cache in self.kv_caches]
        return msgspec.msgpack.encode(self.loaded)


@pytest.fixture
def engine(tiny_llama_dir):
    register_kv_connector("ToyConnector", ToySchedulerConnector, ToyWorkerConnector)
    STORE.clear()
    config = EngineConfig(
        model=ModelConfig(model=tiny_llama_dir),
        cache=CacheConfig(block_size=BLOCK, kv_cache_memory_bytes=TINY_KV_CACHE_MEMORY),
        # Built directly: the CLI's kv_connector choices list the built-in connectors only.
        kv_transfer_config=KVTransferConfig(
            kv_connector="ToyConnector", kv_connector_extra_config={"store_address": "toy"}
        ),
    )
    core = EngineCore(config, tiny_llama_dir)
    yield core
    core.shutdown()


def _generate(engine: EngineCore, req_id: str, prompt: list[int]) -> list[int]:
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    engine.add_request(EngineCoreRequest(req_id, prompt, params))
    tokens: list[int] = []
    while engine.has_work():
        for out in engine.step().outputs:
            assert out.error is None, out.error
            tokens += out.new_token_ids
    return tokens


def test_a_registered_connector_saves_then_loads_through_a_real_engine(engine):
    connector = engine.scheduler.kv_connector
    assert isinstance(connector, ToySchedulerConnector)
    prompt = [(7 * i) % 250 + 1 for i in range(45)]  # 2 full blocks can hit (44 // 16)
    first = _generate(engine, "a", prompt)
    assert len(STORE) >= 2  # the prompt's full blocks (and the outputs' full block)
    assert connector.asked == [("a", 0)]
    # The engine forgets its own prefix cache: the blocks can only come from the toy.
    assert engine.reset_prefix_cache()
    second = _generate(engine, "b", prompt)
    assert connector.asked[-1] == ("b", 2)
    assert second == first  # the loaded K/V is the computed K/V
    stats = engine.scheduler.make_stats()
    assert stats is not None and stats.kv_store_up is None  # the toy reports no store figures
    assert_no_leaked_blocks(engine.scheduler)


def test_a_traced_request_that_loads_its_prefix_has_a_kv_load_span(engine):
    # --otlp-traces-endpoint: the engine times a request's parked KV load as its own phase.
    prompt = [(7 * i) % 250 + 1 for i in range(45)]
    _generate(engine, "a", prompt)
    assert engine.reset_prefix_cache()
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    context = {"traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"}
    engine.add_request(EngineCoreRequest("b", prompt, params, trace_context=context))
    spans = None
    while engine.has_work():
        for out in engine.step().outputs:
            if out.finished:
                spans = out.trace_spans
    assert spans is not None
    by_name = {span.name: span for span in spans}
    assert sorted(by_name) == [
        "engine.decode",
        "engine.kv_load",
        "engine.prefill",
        "engine.waiting",
    ]
    waiting, load, prefill = (
        by_name["engine.waiting"],
        by_name["engine.kv_load"],
        by_name["engine.prefill"],
    )
    assert load.attributes == {"num_blocks": 2, "num_loaded_blocks": 2}
    # The load is part of the wait for a first step, which the prefill follows.
    assert waiting.start_ns <= load.start_ns <= load.end_ns <= waiting.end_ns <= prefill.start_ns
    assert prefill.attributes["position"] == 2 * BLOCK  # the loaded blocks are not recomputed
    assert_no_leaked_blocks(engine.scheduler)
