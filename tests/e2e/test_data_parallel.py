"""Data parallelism end to end: `kvserve serve --data-parallel-size 2` as a user runs it.

Real processes (api, DP coordinator, two engine cores), real HTTP, the official openai
client. Engine placement is read from the per-engine series of /metrics (`engine="0"`), and
from /health's JSON body.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import threading
import time

import psutil
import pytest

from tests.support.metrics import metrics_text, read_metric
from tests.support.server import (
    DP_MODEL_NAME,
    NUM_DP_ENGINES,
    start_dp_front_end,
    stream_completion,
)
from tests.support.waiting import wait_until

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def load_server(tiny_llama_dir, tmp_path_factory):
    # The launcher splits the cores itself (asserted below).
    server = start_dp_front_end(
        tiny_llama_dir, tmp_path_factory.mktemp("dp-load"), split_cores=True
    )
    try:
        server.wait_healthy()
        yield server
    finally:
        server.stop()


def test_concurrent_requests_are_served_by_both_engines(load_server):
    status, body = load_server.health()
    assert status == 200 and body["status"] == "healthy", body
    assert [e["engine"] for e in body["engines"]] == list(range(NUM_DP_ENGINES))
    assert all(e["state"] == "serving" for e in body["engines"]), body
    # The engines are the launcher's children (so are the coordinator and multiprocessing's
    # resource tracker).
    children = psutil.Process(load_server.process.pid).children()
    assert {e["pid"] for e in body["engines"]} <= {child.pid for child in children}
    assert "engine core uses 1 torch threads" in load_server.log()  # 2 cores, 2 engines

    prompts = [f"request {i}: tell me a story about the number {i}" for i in range(40)]
    with concurrent.futures.ThreadPoolExecutor(40) as pool:
        texts = list(pool.map(load_server.complete, prompts))
    assert len(texts) == 40 and all(texts)
    queried = [
        load_server.metric("kvserve:prefix_cache_queries_total", i) for i in range(NUM_DP_ENGINES)
    ]
    assert all(q > 0 for q in queried), queried
    # Both took a real share: neither got fewer than a quarter of the prompt tokens.
    assert min(queried) > sum(queried) / 4, queried
    assert all(load_server.metric("kvserve:engine_up", i) == 1 for i in range(NUM_DP_ENGINES))
    # The request series carry the engine that served each request, as the engine's own do.
    text = metrics_text(load_server.url)
    served = [
        read_metric(text, "kvserve:request_success_total", engine=str(i), finished_reason="length")
        for i in range(NUM_DP_ENGINES)
    ]
    assert sum(served) == 40 and min(served) > 0, served


def test_a_killed_engine_is_dropped_its_stream_moves_and_the_other_serves_on(load_server):
    _, body = load_server.health()
    victim = body["engines"][1]
    # The earlier tests' requests are over on both engines, and the coordinator has had time
    # to publish that (PUBLISH_INTERVAL_S is 0.1 s): a load table still showing the victim
    # busy would send every stream below to engine 0.
    assert wait_until(
        lambda: all(
            load_server.metric("kvserve:num_requests_running", i) == 0
            for i in range(NUM_DP_ENGINES)
        ),
        timeout_s=30,
    ), "the earlier requests never finished"
    time.sleep(1.0)
    # Frozen first, so its request is surely in flight there when it dies (the tiny model
    # would finish a whole stream in well under a second).
    os.kill(victim["pid"], signal.SIGSTOP)
    # Streams until one sits on the frozen engine (ties between idle engines go
    # round-robin, so the second one at the latest); the others run on engine 0.
    body = {
        "model": DP_MODEL_NAME,
        "prompt": "Hello",
        "max_tokens": 100,
        "temperature": 0,
        "ignore_eos": True,
    }
    streams = []
    for _ in range(6):
        events = []
        thread = threading.Thread(target=stream_completion, args=(load_server.url, body, events))
        thread.start()
        streams.append((thread, events))
        thread.join(timeout=2)
        if thread.is_alive():
            break
    assert len(streams) <= 2, "no request went to the frozen engine"
    # Silent past the heartbeat timeout (3 s here), the frozen engine is only suspect: it
    # keeps the stream it holds, and new requests go to engine 0 alone.
    assert wait_until(
        lambda: load_server.health()[1]["engines"][1]["state"] == "suspect",
        timeout_s=10,
        interval_s=0.2,
    ), load_server.health()
    status, body = load_server.health()
    assert status == 200 and body["status"] == "degraded", body
    assert body["engines"][0]["state"] == "serving", body
    assert "sent nothing for" in body["engines"][1]["reason"], body
    assert load_server.metric("kvserve:engine_suspect", 1) == 1
    assert load_server.metric("kvserve:engine_up", 1) == 1
    before = load_server.metric("kvserve:prefix_cache_queries_total", 0)
    for i in range(4):  # one sent to the frozen engine would time out here
        assert load_server.complete(f"while engine 1 is suspect {i}")
    assert load_server.metric("kvserve:prefix_cache_queries_total", 0) > before
    assert streams[-1][0].is_alive(), "the suspect engine's stream ended"
    os.kill(victim["pid"], signal.SIGKILL)
    killed_at = time.monotonic()
    for thread, _ in streams:
        thread.join(timeout=30)
        assert not thread.is_alive(), "a stream hung after the engine was killed"

    # No stream failed: the killed engine's one moved to engine 0 and went on from the tokens
    # it had sent (services/api/engine_client/migration.py).
    for _, events in streams:
        assert not [e for _, e in events if '"error"' in str(e)], events[-3:]
        assert events[0][1] == 200 and events[-1][1] == "[DONE]", events[-3:]
        assert json.loads(events[-2][1])["choices"][0]["finish_reason"] == "length"
    moved_events = streams[-1][1]
    moved_id = json.loads(moved_events[1][1])["id"]
    log = load_server.log()
    assert f"request {moved_id} moved to engine core 0" in log, log
    assert f"EngineCore_1 (pid {victim['pid']}) died" in log
    resumed_at = moved_events[-1][0]
    assert resumed_at - killed_at < 10, "the moved stream took too long to finish"
    text = metrics_text(load_server.url)
    assert (
        read_metric(text, "kvserve:request_migrations_total", engine="1", reason="engine_died") == 1
    )
    assert read_metric(text, "kvserve:request_migration_resume_seconds_count", engine="1") == 1

    status, body = load_server.health()
    assert status == 200 and body["status"] == "degraded", body
    assert [e["state"] for e in body["engines"]] == ["serving", "dead"], body
    assert "EngineCore_1" in body["engines"][1]["reason"]
    assert load_server.metric("kvserve:engine_up", 1) == 0
    before = load_server.metric("kvserve:prefix_cache_queries_total", 0)
    for i in range(4):
        assert load_server.complete(f"after the kill {i}")
    assert load_server.metric("kvserve:prefix_cache_queries_total", 0) > before
    assert load_server.process.poll() is None
    assert load_server.stop() == 0, load_server.log()


PREFIX_LEN = 256  # tokens: the tiny model's tokenizer is one token per byte
NUM_GROUPS = 3


def _group_prefix(group: int) -> str:
    text = f"group {group} shared system prompt. " * 20
    return text[:PREFIX_LEN]


def test_prefix_routing_sends_a_prefix_to_the_engine_that_cached_it(tiny_llama_dir, tmp_path):
    server = start_dp_front_end(tiny_llama_dir, tmp_path, "--dp-routing", "prefix")
    try:
        server.wait_healthy()

        def totals() -> list[tuple[float, float]]:
            return [
                (
                    server.metric("kvserve:prefix_cache_queries_total", i),
                    server.metric("kvserve:prefix_cache_hits_total", i),
                )
                for i in range(NUM_DP_ENGINES)
            ]

        def send(group: int, index: int) -> tuple[int, float]:
            """(the engine that served it, its prefix-cache hit tokens)."""
            before = totals()
            server.complete(_group_prefix(group) + f" question {index} of {group}?", 4)
            after = totals()
            (engine,) = [i for i in range(NUM_DP_ENGINES) if after[i][0] > before[i][0]]
            return engine, after[engine][1] - before[engine][1]

        homes = {}
        for group in range(NUM_GROUPS):  # the first of each group computes its prefix
            homes[group], hits = send(group, 0)
            assert hits == 0
        assert len(set(homes.values())) == NUM_DP_ENGINES  # spread by load
        for index in range(1, 4):
            for group in range(NUM_GROUPS):
                engine, hits = send(group, index)
                assert engine == homes[group], (group, index, homes)
                assert hits >= PREFIX_LEN - 16, hits  # every full block of the prefix
    finally:
        server.stop()
