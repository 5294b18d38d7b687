"""Engine cores and workers of a real DP=2 deployment (the mp executor: one worker process
per engine core) stopped (SIGSTOP) mid-stream, then continued or not. Nothing is lost:

- an engine core stopped past the heartbeat timeout, short of the hung budget, is suspect
  (its stream waits there, new requests go to the other engine), serves again within a few
  heartbeats of SIGCONT and gets new requests again;
- an engine core stopped past the hung budget is declared hung although its workers run on
  (their ring polls and heartbeats are theirs, not the engine core's progress), killed with
  them, its stream moves to the other engine, and it is restarted;
- a worker stopped short of its hung budget leaves its engine slow, not dead: the stream
  finishes on the same engine after SIGCONT;
- a worker stopped past it fails its engine core, whose stream moves, and which is restarted.

The stream is sent while every engine core is stopped, so it surely waits on the engine the
api sent it to (its own count: /health's num_in_flight), which is the one stopped on; each
resume point comes from the server's own verdict where it gives one (the suspect reason's
time without progress, the executor's log), and the timeouts are shortened by environment
variables. One server serves every test (a test that restarts an engine waits for it).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import threading
import time
from collections.abc import Iterator

import psutil
import pytest

from tests.support.metrics import metrics_text
from tests.support.processes import wait_gone
from tests.support.server import (
    DP_MODEL_NAME,
    NUM_DP_ENGINES,
    ServeProcess,
    start_tiny_server,
    stream_completion,
)
from tests.support.waiting import wait_until

pytestmark = pytest.mark.slow

HEARTBEAT_INTERVAL_S = 0.5  # KVSERVE_ENGINE_HEARTBEAT_INTERVAL_S's default
HEARTBEAT_TIMEOUT_S = 1.5
HUNG_TIMEOUT_S = 6.0
WORKER_HEARTBEAT_TIMEOUT_S = 1.0
WORKER_HUNG_TIMEOUT_S = 5.0
# A worker beats every second and is looked at once silent for two (mp_executor.py): stopped
# this long it is suspect, and far from hung.
WORKER_STOP_S = 3.5
ENV = {
    "KVSERVE_ENGINE_HEARTBEAT_TIMEOUT_S": str(HEARTBEAT_TIMEOUT_S),
    "KVSERVE_ENGINE_HUNG_TIMEOUT_S": str(HUNG_TIMEOUT_S),
    "KVSERVE_WORKER_HEARTBEAT_TIMEOUT_S": str(WORKER_HEARTBEAT_TIMEOUT_S),
    "KVSERVE_WORKER_HUNG_TIMEOUT_S": str(WORKER_HUNG_TIMEOUT_S),
}
# Held from its first step (sent while the engine cores are stopped): it need not be long.
STREAM = {
    "model": DP_MODEL_NAME,
    "prompt": "a stream that outlives a stopped process",
    "max_tokens": 64,
    "temperature": 0,
    "ignore_eos": True,
}


@pytest.fixture(scope="module")
def dp_server(tiny_llama_dir, tmp_path_factory) -> Iterator[ServeProcess]:
    server = start_tiny_server(
        tiny_llama_dir,
        tmp_path_factory.mktemp("engine-stopped"),
        "--data-parallel-size",
        str(NUM_DP_ENGINES),
        "--distributed-executor-backend",
        "mp",
        "--restart-dead-engines",
        env=ENV,
    )
    try:
        server.wait_healthy()
        yield server
        assert server.stop() == 0, server.log()
    finally:
        server.stop()


@pytest.fixture
def server(dp_server) -> ServeProcess:
    """The module's server once both engine cores serve (a restart may be under way)."""
    assert wait_until(
        lambda: {e["state"] for e in _engines(dp_server).values()} == {"serving"}, timeout_s=60
    ), dp_server.health()
    return dp_server


def _engines(server: ServeProcess) -> dict[int, dict]:
    return {entry["engine"]: entry for entry in server.health()[1]["engines"]}


def _worker_pid(engine_pid: int) -> int:
    """The engine core's one worker process (a multiprocessing spawn child)."""
    (worker,) = [
        child
        for child in psutil.Process(engine_pid).children()
        if "spawn_main" in " ".join(child.cmdline())
    ]
    return worker.pid


class Stream:
    """One streamed completion in a thread of its own."""

    def __init__(self, url: str, body: dict):
        self.events: list = []
        self.thread = threading.Thread(target=stream_completion, args=(url, body, self.events))
        self.thread.start()

    def assert_finished(self, timeout_s: float = 60) -> None:
        """It ends well: status 200, no error event, finish_reason "length", [DONE]."""
        self.thread.join(timeout_s)
        assert not self.thread.is_alive(), "the stream hung"
        assert self.events and self.events[0][1] == 200, self.events[:3]
        lines = [item for _, item in self.events[1:]]
        assert not [item for item in lines if '"error"' in item], lines[-3:]
        assert lines[-1] == "[DONE]", lines[-3:]
        assert json.loads(lines[-2])["choices"][0]["finish_reason"] == "length", lines[-3:]


def _held_stream(server: ServeProcess) -> tuple[Stream, dict]:
    """A greedy stream sent while every engine core is stopped, so that it surely waits
    on the one the api sent it to (the api's own count, /health's num_in_flight); the stream
    and that engine's /health entry, every engine core still stopped (the caller continues
    them). A stop timed from a stream's tokens could come after the tiny model ended it."""
    pids = [entry["pid"] for entry in _engines(server).values()]
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    try:
        stream = Stream(server.url, STREAM)
        held: dict = {}

        def sent() -> bool:
            entries = [entry for entry in _engines(server).values() if entry["num_in_flight"]]
            held.update(entries[0] if entries else {})
            return bool(entries)

        assert wait_until(sent, timeout_s=30), server.health()
    except BaseException:
        _continue(*pids)
        raise
    return stream, held


def _continue(*pids: int) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)


def _quiet_s(reason: str) -> float:
    """The time without progress a suspect engine's /health reason reports (0: none)."""
    match = re.search(r"used no CPU time and waited for none for ([\d.]+) s", reason)
    return float(match[1]) if match else 0.0


def _serves_new_requests(server: ServeProcess, index: int) -> None:
    """Requests sent one after the other reach engine `index` too (ties go round-robin)."""
    before = _engines(server)[index]["num_generated_tokens"]
    for n in range(4):
        assert server.complete(f"request {n} after the fault")
    assert _engines(server)[index]["num_generated_tokens"] > before, server.health()


def _migrations(server: ServeProcess) -> float:
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in metrics_text(server.url).splitlines()
        if line.startswith("kvserve:request_migrations_total{")
    )


@contextlib.contextmanager
def _stopped(pid: int) -> Iterator[None]:
    """The process stopped (again: it may be already), continued on exit."""
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        _continue(pid)


def _restarting(server: ServeProcess, old_pids: list[int]) -> None:
    """The dead engine's processes (engine core first) are gone, and the launcher is starting
    it again (--restart-dead-engines)."""
    assert wait_gone(old_pids, timeout_s=15) == [], "a stopped process outlived its engine"
    restarting = rf"engine core \d \(pid {old_pids[0]}\) exited .*; restarting it in"
    assert wait_until(lambda: re.search(restarting, server.log()), timeout_s=10), server.log()


def _restarted(server: ServeProcess, index: int, old_pids: list[int]) -> None:
    """_restarting, then a new engine core serves in its place, and gets requests."""
    _restarting(server, old_pids)

    def successor_serves() -> bool:
        entry = _engines(server)[index]
        return entry["state"] == "serving" and entry["pid"] != old_pids[0]

    assert wait_until(successor_serves, timeout_s=60), server.health()
    _serves_new_requests(server, index)


def test_an_engine_core_stopped_short_of_the_hung_budget_is_suspect_then_serves_again(server):
    log_start = len(server.log())
    stream, victim = _held_stream(server)
    index, pid = victim["engine"], victim["pid"]
    other = 1 - index
    with _stopped(pid):
        _continue(_engines(server)[other]["pid"])
        assert wait_until(lambda: _engines(server)[other]["state"] == "serving", timeout_s=10)
        assert wait_until(lambda: _engines(server)[index]["state"] == "suspect", timeout_s=10)
        # New requests go to the other engine and finish; the stream waits on this one.
        before = _engines(server)[other]["num_generated_tokens"]
        for n in range(3):
            assert server.complete(f"request {n} while engine core {index} is stopped")
        engines = _engines(server)
        assert engines[index]["state"] == "suspect" and engines[index]["num_in_flight"] == 1
        assert engines[other]["num_generated_tokens"] >= before + 3 * 6, engines
        assert stream.thread.is_alive()
        # Resumed once it went half the hung budget without progress, as the api saw it
        # (not its workers' progress: they run on).
        assert wait_until(
            lambda: _quiet_s(_engines(server)[index].get("reason", "")) >= HUNG_TIMEOUT_S / 2,
            timeout_s=HUNG_TIMEOUT_S,
        ), server.health()
    resumed_at = time.monotonic()
    assert wait_until(lambda: _engines(server)[index]["state"] == "serving", timeout_s=10)
    back_s = time.monotonic() - resumed_at
    assert back_s < 4 * HEARTBEAT_INTERVAL_S, f"serving again {back_s:.1f} s after SIGCONT"
    stream.assert_finished()
    _serves_new_requests(server, index)
    assert _engines(server)[index]["pid"] == pid
    log = server.log()[log_start:]
    assert f"engine core {index} is healthy again" in log, log
    assert "it is hung" not in log, log


def test_an_engine_core_stopped_past_the_hung_budget_is_restarted_and_its_stream_moves(server):
    log_start = len(server.log())
    migrations = _migrations(server)
    stream, victim = _held_stream(server)
    index, pid = victim["engine"], victim["pid"]
    worker_pid = _worker_pid(pid)
    stopped_at = time.monotonic()
    with _stopped(pid):
        _continue(_engines(server)[1 - index]["pid"])
        assert wait_until(lambda: "it is hung" in server.log()[log_start:], timeout_s=20), (
            server.log()[log_start:]
        )
        hung_after_s = time.monotonic() - stopped_at
        stream.assert_finished()  # moved to the other engine, and finished there
    # Stopped a moment before stopped_at (while the stream was sent).
    assert HUNG_TIMEOUT_S - 1 <= hung_after_s < HUNG_TIMEOUT_S + 6, hung_after_s
    log = server.log()[log_start:]
    assert re.search(
        rf"engine core {index} sent nothing for [\d.]+ s and its process used no CPU time "
        rf"and waited for none for [\d.]+ s .*: it is hung \(stopped or blocked\)",
        log,
    ), log
    assert _migrations(server) >= migrations + 1
    _restarted(server, index, [pid, worker_pid])


def test_a_worker_stopped_short_of_its_hung_budget_leaves_its_engine_slow(server):
    log_start = len(server.log())
    stream, victim = _held_stream(server)
    index, pid = victim["engine"], victim["pid"]
    worker_pid = _worker_pid(pid)
    suspect = rf"worker rank 0 \(pid {worker_pid}\) has not beaten for \d+ s .*: suspect"
    with _stopped(worker_pid):
        stopped_at = time.monotonic()
        _continue(*(entry["pid"] for entry in _engines(server).values()))
        assert wait_until(lambda: re.search(suspect, server.log()[log_start:]), timeout_s=10)
        # The engine core beats on: the api sees a live engine whose step takes long.
        assert _engines(server)[index]["state"] == "serving", server.health()
        time.sleep(max(0.0, stopped_at + WORKER_STOP_S - time.monotonic()))
        assert stream.thread.is_alive()
    stream.assert_finished()
    assert wait_until(lambda: "worker rank 0 beats again" in server.log()[log_start:])
    assert _engines(server)[index]["pid"] == pid and psutil.pid_exists(worker_pid)
    log = server.log()[log_start:]
    assert "it is hung" not in log and "died" not in log, log
    _serves_new_requests(server, index)


def test_a_worker_stopped_past_its_hung_budget_fails_its_engine_which_is_restarted(server):
    log_start = len(server.log())
    migrations = _migrations(server)
    stream, victim = _held_stream(server)
    index, pid = victim["engine"], victim["pid"]
    worker_pid = _worker_pid(pid)
    hung = (
        rf"worker rank 0 \(pid {worker_pid}\) has not beaten for \d+ s and used no CPU time "
        rf"and waited for none for \d+ s .*: it is hung"
    )
    with _stopped(worker_pid):
        _continue(*(entry["pid"] for entry in _engines(server).values()))
        assert wait_until(lambda: re.search(hung, server.log()[log_start:]), timeout_s=20), (
            server.log()[log_start:]
        )
        stream.assert_finished()  # moved to the other engine, and finished there
    # The executor failed its engine core, which said so (DEAD) before it exited.
    gone = rf"engine core {index} is gone \(engine core {index} died: RuntimeError: worker rank 0"
    assert re.search(gone, server.log()[log_start:]), server.log()[log_start:]
    assert _migrations(server) >= migrations + 1
    # Its readmission is test_an_engine_core_stopped_past_the_hung_budget_...'s (the same
    # restart path): a restart takes 10-30 s on a loaded 2-core host.
    _restarting(server, [pid, worker_pid])
