"""Two-node data parallelism on loopback: a front end with one engine, a headless node with
the other, registering over the front end's rpc port (real processes, real sockets), every
tcp:// socket between them CURVE-encrypted with keys from `kvserve keys generate`."""

from __future__ import annotations

import os
import signal

import pytest

from kvserve.cli import main as kvserve_main
from kvserve.shared.env import TRANSPORT_KEYS
from tests.support.models import TINY_KV_CACHE_MEMORY
from tests.support.ports import free_port
from tests.support.server import NUM_DP_ENGINES, ServeProcess, start_dp_front_end
from tests.support.waiting import wait_until

pytestmark = pytest.mark.slow


def test_two_nodes_serve_together_and_the_front_end_outlives_the_other(
    tiny_llama_dir, tmp_path, monkeypatch
):
    keys_dir = str(tmp_path / "keys")
    assert kvserve_main(["keys", "generate", keys_dir]) == 0
    # Only the flag carries the keys: the engines each node spawns must inherit them from it.
    monkeypatch.delenv(TRANSPORT_KEYS.name, raising=False)
    rpc_port = free_port()
    dp_flags = [
        "--data-parallel-size",
        str(NUM_DP_ENGINES),
        "--data-parallel-size-local",
        "1",
        "--data-parallel-address",
        "127.0.0.1",
        "--data-parallel-rpc-port",
        str(rpc_port),
        "--transport-keys",
        keys_dir,
    ]
    # The headless node first: it waits for the front end to answer its registration.
    node_b = ServeProcess(
        [
            tiny_llama_dir,
            "--headless",
            "--kv-cache-memory",
            str(TINY_KV_CACHE_MEMORY),
            *dp_flags,
            "--data-parallel-start-rank",
            "1",
        ],
        str(tmp_path / "node-b.log"),
        port=None,
    )
    node_a = start_dp_front_end(tiny_llama_dir, tmp_path, *dp_flags[2:])
    try:
        node_a.wait_healthy()
        status, body = node_a.health()
        assert status == 200 and body["status"] == "healthy", body
        engine_b = body["engines"][1]
        assert engine_b["state"] == "serving"
        assert node_b.process.poll() is None
        assert "registered engines [1]" in node_a.log(), node_a.log()

        for i in range(8):
            assert node_a.complete(f"request {i} through the front end")
        queried = [
            node_a.metric("kvserve:prefix_cache_queries_total", i) for i in range(NUM_DP_ENGINES)
        ]
        assert all(q > 0 for q in queried), queried  # both nodes' engines served

        os.killpg(node_b.process.pid, signal.SIGKILL)  # the node vanishes, engines and all
        assert wait_until(
            lambda: node_a.health()[1]["engines"][1]["state"] == "dead",
            timeout_s=10,
            interval_s=0.2,
        ), "node B was never dropped"
        status, body = node_a.health()
        assert status == 200 and body["status"] == "degraded", body
        for i in range(4):
            assert node_a.complete(f"request {i} after node B died")
        assert node_a.process.poll() is None
        assert node_a.stop() == 0, node_a.log()
    finally:
        node_a.stop()
        node_b.stop()
