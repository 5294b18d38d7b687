"""Supervision under faults, with real `kvserve serve` processes: a killed engine core, or one
whose worker froze past the hung budget, is restarted and readmitted
(--restart-dead-engines), a killed DP coordinator
is restarted, a headless node rejoins a running front end, and a headless node whose front
end vanished exits by itself. Every test ends by checking that no descendant outlives its
launcher (ServeProcess.stop)."""

from __future__ import annotations

import json
import os
import re
import signal
import threading
import time

import psutil
import pytest

from tests.support.models import TINY_KV_CACHE_MEMORY
from tests.support.ports import free_port
from tests.support.processes import wait_gone
from tests.support.server import (
    DP_MODEL_NAME,
    NUM_DP_ENGINES,
    Generating,
    ServeProcess,
    start_dp_front_end,
    start_tiny_server,
    stream_completion,
)
from tests.support.waiting import wait_until

pytestmark = pytest.mark.slow

# Long enough to still be streaming when the fault hits, right after its first token.
LONG_STREAM = {
    "model": DP_MODEL_NAME,
    "prompt": "a stream that a fault cuts short",
    "max_tokens": 400,
    "temperature": 0,
    "ignore_eos": True,
}


@pytest.fixture(scope="module")
def tiny_llama_for_tp(tmp_path_factory) -> str:
    from tests.support.models import save_tiny_parallel_llama

    return save_tiny_parallel_llama(str(tmp_path_factory.mktemp("tiny-tp-llama")))


def _single_engine_server(model_dir: str, tmp_path, *extra: str) -> ServeProcess:
    return start_tiny_server(model_dir, tmp_path, *extra)


def _stream_hit_by(server: ServeProcess, fault, **body) -> tuple[list, float]:
    """Stream LONG_STREAM (| body), run fault() once the server is mid-stream by its own
    counts (Generating: the client reads behind the server, and the tiny model can finish
    400 tokens before a loaded client sees its first); (events, seconds from the fault to
    the stream's end)."""
    events: list = []
    generating = Generating(server)
    thread = threading.Thread(
        target=stream_completion, args=(server.url, LONG_STREAM | body, events)
    )
    thread.start()
    generating.busiest()
    fault()
    start = time.monotonic()
    thread.join(120)  # a stream that moves waits for its engine core's restart
    assert not thread.is_alive(), "the stream hung after the fault"
    return events, time.monotonic() - start


def _assert_stream_moved_and_finished(server: ServeProcess, events: list) -> None:
    """The stream survived the fault: it moved to the restarted engine core and ended by
    its length, with no error chunk."""
    data = [item for _, item in events if isinstance(item, str)]
    assert events[0][1] == 200 and data[-1] == "[DONE]", events[-3:]
    assert not any('"error"' in item for item in data), data[-3:]
    assert json.loads(data[-2])["choices"][0]["finish_reason"] == "length", data[-2]
    request_id = json.loads(data[0])["id"]
    assert f"request {request_id} moved to engine core 0" in server.log()


def _engine_pid(server: ServeProcess, index: int = 0) -> int:
    return server.health()[1]["engines"][index]["pid"]


def _wait_served_again(server: ServeProcess, old_pid: int, timeout_s: float = 180) -> int:
    """Wait until /health is 200 with a new engine-core process; its pid."""

    def back() -> bool:
        status, body = server.health()
        return status == 200 and body["engines"][0]["pid"] != old_pid

    assert wait_until(back, timeout_s=timeout_s, interval_s=0.5), server.log()
    return _engine_pid(server)


def test_a_killed_engine_core_is_restarted_and_readmitted(tiny_llama_dir, tmp_path):
    server = _single_engine_server(tiny_llama_dir, tmp_path, "--restart-dead-engines")
    try:
        server.wait_healthy()
        old_pid = _engine_pid(server)
        statuses: list[int] = []

        def kill_and_watch_health() -> None:
            os.kill(old_pid, signal.SIGKILL)
            # While it restarts, nothing serves: /health says 503.
            assert wait_until(
                lambda: statuses.append(server.health()[0]) or statuses[-1] == 503,
                timeout_s=10,
                interval_s=0.1,
            )

        events, _ = _stream_hit_by(server, kill_and_watch_health)
        # The stream waited for the restart and went on there
        # (services/api/engine_client/migration.py).
        _assert_stream_moved_and_finished(server, events)
        assert f"(pid {old_pid}) died" in server.log()
        new_pid = _wait_served_again(server, old_pid)
        assert psutil.pid_exists(new_pid)
        assert server.complete("after the restart")
        log = server.log()
        assert "restarting it in" in log and "engine core 0 readmitted" in log, log
        assert server.stop() == 0, server.log()
    finally:
        server.stop()


WORKER_HUNG_TIMEOUT_S = 6.0


def test_a_frozen_worker_fails_its_engine_core_which_is_restarted_then_the_api_is_killed(
    tiny_llama_for_tp, default_model_dir, tmp_path, monkeypatch
):
    monkeypatch.setenv("KVSERVE_WORKER_HEARTBEAT_TIMEOUT_S", "3")
    monkeypatch.setenv("KVSERVE_WORKER_HUNG_TIMEOUT_S", str(WORKER_HUNG_TIMEOUT_S))
    server = _single_engine_server(
        tiny_llama_for_tp,
        tmp_path,
        "--tokenizer",
        default_model_dir,  # the TP model's 128 ids are the first of this vocabulary
        "--tensor-parallel-size",
        "2",
        "--restart-dead-engines",
    )
    prompt = [1, 2, 3, 4, 5]
    try:
        server.wait_healthy()
        old_pid = _engine_pid(server)
        workers = psutil.Process(old_pid).children()
        assert len(workers) == 2, workers
        frozen = workers[-1]
        events, seconds = _stream_hit_by(
            server, lambda: frozen.send_signal(signal.SIGSTOP), prompt=prompt, max_tokens=240
        )
        # Suspect after the heartbeat limit, hung only after the budget without CPU time or a
        # wait for one (counted from the first look, once a beat is missing).
        assert seconds >= WORKER_HUNG_TIMEOUT_S, (
            f"the stream ended {seconds:.1f} s after the freeze"
        )
        log = server.log()
        worker = rf"worker rank \d \(pid {frozen.pid}\)"
        assert re.search(rf"{worker} has not beaten for \d+ s .*: suspect", log), log
        hung = re.search(
            rf"{worker} has not beaten for (\d+) s and used no CPU time and waited for none "
            rf"for (\d+) s \(limit 6 s, KVSERVE_WORKER_HUNG_TIMEOUT_S\): it is hung",
            log,
        )
        assert hung is not None, log
        silent_s, quiet_s = int(hung[1]), int(hung[2])
        assert quiet_s >= WORKER_HUNG_TIMEOUT_S and silent_s <= WORKER_HUNG_TIMEOUT_S + 4, hung[0]
        # The engine core failed for it and was restarted; the stream moved there.
        _assert_stream_moved_and_finished(server, events)
        _wait_served_again(server, old_pid)
        assert wait_gone([frozen], timeout_s=15) == [], "the frozen worker outlived its engine"
        events = []
        stream_completion(server.url, LONG_STREAM | {"prompt": prompt, "max_tokens": 8}, events)
        assert events[0][1] == 200 and '"finish_reason":"length"' in events[-2][1], events

        # Then the api itself is killed mid-stream: the client's connection breaks at once,
        # and the engine core (watching its parent) and its workers (theirs) go in seconds.
        descendants = psutil.Process(server.process.pid).children(recursive=True)
        assert _engine_pid(server) in [p.pid for p in descendants] and len(descendants) >= 3
        events, seconds = _stream_hit_by(
            server,
            lambda: os.kill(server.process.pid, signal.SIGKILL),
            prompt=prompt,
            max_tokens=240,
        )
        assert seconds < 5, f"the client noticed after {seconds:.1f} s"
        assert "Error" in str(events[-1][1]), events[-3:]
        assert wait_gone(descendants, timeout_s=10) == [], descendants
    finally:
        server.stop()


def test_a_killed_coordinator_is_restarted_and_requests_go_on(tiny_llama_dir, tmp_path):
    server = start_dp_front_end(tiny_llama_dir, tmp_path)
    try:
        server.wait_healthy()
        (pid,) = map(int, re.findall(r"started DP coordinator process \(pid (\d+)\)", server.log()))
        os.kill(pid, signal.SIGKILL)
        for i in range(4):  # routing runs on the api's own estimates meanwhile
            assert server.complete(f"request {i} while the coordinator restarts")
        assert wait_until(
            lambda: "restarted DP coordinator (pid" in server.log(), timeout_s=20, interval_s=0.2
        ), server.log()
        (new_pid,) = map(int, re.findall(r"restarted DP coordinator \(pid (\d+)", server.log()))
        assert new_pid != pid and psutil.pid_exists(new_pid)
        status, body = server.health()
        assert status == 200 and body["status"] == "healthy", body
        for i in range(4):
            assert server.complete(f"request {i} after the restart")
        assert server.stop() == 0, server.log()
    finally:
        server.stop()


def test_a_headless_node_rejoins_and_exits_once_the_front_end_is_gone(
    tiny_llama_dir, tmp_path, monkeypatch
):
    monkeypatch.setenv("KVSERVE_FRONTEND_TIMEOUT_S", "3")
    rpc_port = free_port()
    dp_flags = [
        "--data-parallel-size-local",
        "1",
        "--data-parallel-address",
        "127.0.0.1",
        "--data-parallel-rpc-port",
        str(rpc_port),
    ]
    node_args = [
        tiny_llama_dir,
        "--headless",
        "--kv-cache-memory",
        str(TINY_KV_CACHE_MEMORY),
        "--data-parallel-size",
        str(NUM_DP_ENGINES),
        *dp_flags,
        "--data-parallel-start-rank",
        "1",
    ]
    node_b = ServeProcess(node_args, str(tmp_path / "node-b.log"), port=None)
    front = start_dp_front_end(tiny_llama_dir, tmp_path, *dp_flags)
    rejoined = None
    try:
        front.wait_healthy()
        os.killpg(node_b.process.pid, signal.SIGKILL)
        assert wait_until(
            lambda: front.health()[1]["status"] == "degraded", timeout_s=10, interval_s=0.2
        ), front.health()
        # The node comes back: it registers again, and its engine takes index 1 back.
        rejoined = ServeProcess(node_args, str(tmp_path / "node-b-again.log"), port=None)
        assert wait_until(
            lambda: front.health()[1]["status"] == "healthy", timeout_s=180, interval_s=0.5
        ), front.log()
        assert "registered engines [1] again" in front.log(), front.log()
        assert "engine core 1 readmitted" in front.log(), front.log()
        for i in range(8):
            assert front.complete(f"request {i} after the node rejoined")
        assert front.metric("kvserve:prefix_cache_queries_total", 1) > 0  # it serves
        # The front end vanishes: the node hears nothing from it, and stops cleanly.
        descendants = psutil.Process(rejoined.process.pid).children(recursive=True)
        os.killpg(front.process.pid, signal.SIGKILL)
        assert rejoined.process.wait(timeout=30) == 0, rejoined.log()
        assert "the front end at" in rejoined.log() and "is gone" in rejoined.log()
        assert wait_gone(descendants, timeout_s=10) == []
    finally:
        front.stop()
        node_b.stop()
        if rejoined is not None:
            rejoined.stop()
