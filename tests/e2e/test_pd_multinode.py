"""P/D across nodes: a front end whose engine is a kv_producer, a headless node whose engine is
a kv_consumer, and a `kvserve kv-store` on tcp:// between them (CURVE, the session's keys).
The api finds the roles in the READY messages, prefills on the front end's engine, decodes on
the headless one, and the greedy output equals a colocated server's."""

from __future__ import annotations

import json

import pytest

from tests.support.models import TINY_KV_CACHE_MEMORY
from tests.support.ports import free_port
from tests.support.server import DP_MODEL_NAME, ServeProcess, start_kvserve
from tests.support.waiting import wait_until

pytestmark = pytest.mark.slow

PROMPTS = [
    "a prompt long enough for two full blocks of sixteen tokens, one two three four five six",
    "another prompt, also longer than a block, seven eight nine ten eleven twelve thirteen",
]


def _transfer_config(role: str, store_address: str) -> str:
    return json.dumps(
        {
            "kv_connector": "KvStoreConnector",
            "kv_role": role,
            "kv_connector_extra_config": {"store_address": store_address},
        }
    )


def _greedy(server: ServeProcess, prompt: str) -> str:
    return server.complete(prompt, max_tokens=8)


def test_a_headless_decode_node_serves_prefills_of_the_front_end(tiny_llama_dir, tmp_path):
    store_address = f"tcp://127.0.0.1:{free_port()}"
    store = start_kvserve(
        ["kv-store", "--address", store_address, "--size", "64M"], str(tmp_path / "store.log")
    )
    rpc_port = free_port()
    dp_flags = [
        "--kv-cache-memory",
        str(TINY_KV_CACHE_MEMORY),
        "--data-parallel-size",
        "2",
        "--data-parallel-size-local",
        "1",
        "--data-parallel-address",
        "127.0.0.1",
        "--data-parallel-rpc-port",
        str(rpc_port),
    ]
    node = ServeProcess(
        [
            tiny_llama_dir,
            "--headless",
            *dp_flags,
            "--data-parallel-start-rank",
            "1",
            "--kv-transfer-config",
            _transfer_config("kv_consumer", store_address),
        ],
        str(tmp_path / "node.log"),
        port=None,
    )
    port = free_port()
    front = ServeProcess(
        [
            tiny_llama_dir,
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--served-model-name",
            DP_MODEL_NAME,
            *dp_flags,
            "--kv-transfer-config",
            _transfer_config("kv_producer", store_address),
        ],
        str(tmp_path / "front.log"),
        port,
    )
    colocated_port = free_port()
    colocated = ServeProcess(
        [
            tiny_llama_dir,
            "--host",
            "127.0.0.1",
            "--port",
            str(colocated_port),
            "--served-model-name",
            DP_MODEL_NAME,
            "--kv-cache-memory",
            str(TINY_KV_CACHE_MEMORY),
        ],
        str(tmp_path / "colocated.log"),
        colocated_port,
    )
    try:
        front.wait_healthy()
        colocated.wait_healthy()
        _, body = front.health()
        assert [(e["engine"], e["kv_role"]) for e in body["engines"]] == [
            (0, "kv_producer"),
            (1, "kv_consumer"),
        ]
        assert "P/D disaggregation: prefill engine cores [0], decode engine cores [1]" in (
            front.log()
        )
        for prompt in PROMPTS:
            assert _greedy(front, prompt) == _greedy(colocated, prompt)
        # The prompts' blocks went to the store from engine 0 and came back on engine 1
        # (the counters travel with the engines' next stats).
        for name, engine in (
            ("kvserve:kv_transfer_bytes_saved_total", 0),
            ("kvserve:kv_transfer_bytes_loaded_total", 1),
            ("kvserve:external_prefix_cache_hits_total", 1),
        ):
            assert wait_until(
                lambda name=name, engine=engine: front.metric(name, engine) > 0, timeout_s=10
            ), name
        assert wait_until(
            lambda: front.metric("kvserve:num_requests_running", 1) == 0, timeout_s=10
        )
        assert front.stop() == 0, front.log()
    finally:
        front.stop()
        node.stop()
        colocated.stop()
        store.terminate()
        store.wait(timeout=30)
