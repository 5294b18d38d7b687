"""A slow engine is never taken for a dead one: a real `kvserve serve` of the tiny model, one
engine core, no --restart-dead-engines, whose engine core is frozen (SIGSTOP) or held to a
share of a CPU (a cgroup quota) for a spell well past its heartbeat timeout while requests
stream.

Frozen, its heartbeats stop: it turns suspect (/health, /metrics), but the hung budget
(KVSERVE_ENGINE_HUNG_TIMEOUT_S, 30 s by default) is far off. Held to 5% of a CPU it only
slows down (it still beats in time). Held to 0.1%, it falls silent again and again, and is
suspect but never hung, even with a hung budget as short as the heartbeat timeout: its
threads wait for a CPU all along. Each time the server keeps running, the streams in flight
finish late, a request sent meanwhile waits for the engine rather than fail (a suspect engine
is passed over only while another serves), and the engine serves again afterwards.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import psutil
import pytest

from tests.support.cgroups import cpu_quota, quota_unavailable
from tests.support.server import DP_MODEL_NAME, ServeProcess, start_tiny_server, stream_completion
from tests.support.waiting import wait_until

pytestmark = pytest.mark.slow

HEARTBEAT_TIMEOUT_S = 2.0
# Heartbeat timeout and hung budget of the starved engine: 0.1% of a CPU silences the tiny
# model's engine for over 1 s often, for over 2 s seldom (measured).
STARVED_TIMEOUT_S = 1.0
# How long the engine is frozen or held to 5% of a CPU: past the heartbeat timeout (suspect
# for most of it), far short of the 30 s hung budget.
SLOW_S = 5.0
# How long it is starved (0.1%): long enough for silences of over STARVED_TIMEOUT_S to recur.
STARVED_S = 10.0
NUM_STREAMS = 2
STREAM = {
    "model": DP_MODEL_NAME,
    "prompt": "a stream that outlives a slow engine",
    "max_tokens": 400,
    "temperature": 0,
    "ignore_eos": True,
}


def _serve(
    model_dir: str, log_dir, heartbeat_timeout_s: float, hung_timeout_s: float | None = None
) -> ServeProcess:
    """`kvserve serve` of the tiny model, one engine core, not waited for.

    Args:
        hung_timeout_s: KVSERVE_ENGINE_HUNG_TIMEOUT_S (None: its default, 30 s).
    """
    env = {"KVSERVE_ENGINE_HEARTBEAT_TIMEOUT_S": str(heartbeat_timeout_s)}
    if hung_timeout_s is not None:
        env["KVSERVE_ENGINE_HUNG_TIMEOUT_S"] = str(hung_timeout_s)
    return start_tiny_server(model_dir, log_dir, env=env)


@pytest.fixture
def server(tiny_llama_dir, tmp_path, monkeypatch) -> Iterator[ServeProcess]:
    """A server with the heartbeat timeout HEARTBEAT_TIMEOUT_S and the default hung budget."""
    monkeypatch.delenv("KVSERVE_ENGINE_HUNG_TIMEOUT_S", raising=False)
    server = _serve(tiny_llama_dir, tmp_path, HEARTBEAT_TIMEOUT_S)
    try:
        server.wait_healthy()
        yield server
    finally:
        server.stop()


class Stream:
    """One streamed completion in a thread of its own."""

    def __init__(self, url: str, body: dict):
        self.events: list = []
        self.first_data = threading.Event()
        self.thread = threading.Thread(
            target=stream_completion, args=(url, body, self.events, self.first_data)
        )
        self.thread.start()

    def data(self) -> list[tuple[float, str]]:
        """(time, data line) of what came after the status."""
        return [(t, item) for t, item in self.events[1:] if isinstance(item, str)]

    def assert_finished(self, timeout_s: float) -> None:
        """It ends well: status 200, no error event, finish_reason "length", [DONE]."""
        self.thread.join(timeout_s)
        assert not self.thread.is_alive(), "the stream hung"
        assert self.events and self.events[0][1] == 200, self.events[:3]
        lines = [item for _, item in self.data()]
        assert not [item for item in lines if '"error"' in item], lines[-3:]
        assert lines[-1] == "[DONE]", lines[-3:]
        assert json.loads(lines[-2])["choices"][0]["finish_reason"] == "length", lines[-3:]


@dataclass
class SlowSpell:
    """What a scenario saw while the engine was slowed down."""

    entries: list[dict]  # /health's engine entry every ~0.2 s, with "at": seconds into it
    suspect_metric: float | None  # kvserve:engine_suspect at the first suspect entry
    late: Stream  # the request sent while it lasted (once suspect, if ever)
    streams: list[Stream]  # those started before it
    slowed_at: float  # time.monotonic() when it began
    released_at: float  # time.monotonic() when it ended
    num_in_flight: int  # of the streams started before it, those still running at its end

    @property
    def suspect(self) -> list[dict]:
        return [entry for entry in self.entries if entry["state"] == "suspect"]


def _slow_engine_scenario(
    server: ServeProcess,
    slow_down: Callable[[list[int]], contextlib.AbstractContextManager],
    slow_s: float = SLOW_S,
) -> SlowSpell:
    """Streams in flight, then `slow_down(engine pids)` for slow_s seconds, a request sent
    while it lasts. Checks what must hold however slow the engine: /health always answers
    200, the engine is never dead, the server never exits, every request finishes well, and
    the engine serves again afterwards."""
    engine_pid = server.health()[1]["engines"][0]["pid"]
    workers = [child.pid for child in psutil.Process(engine_pid).children()]  # none with uni
    streams = [Stream(server.url, STREAM) for _ in range(NUM_STREAMS)]
    for stream in streams:
        assert stream.first_data.wait(60), stream.events
    entries: list[dict] = []
    suspect_metric, late = None, None
    with slow_down([engine_pid, *workers]):
        slowed_at = time.monotonic()
        while (at := time.monotonic() - slowed_at) < slow_s:
            status, body = server.health()
            (entry,) = body["engines"]
            # Suspect or not, the engine is alive and the server takes requests.
            assert status == 200 and entry["state"] in ("serving", "suspect"), body
            entries.append(entry | {"at": at, "status": body["status"]})
            if entry["state"] == "suspect" and suspect_metric is None:
                suspect_metric = server.metric("kvserve:engine_suspect", 0)
                assert server.metric("kvserve:engine_up", 0) == 1
            if late is None and (entry["state"] == "suspect" or at > slow_s / 2):
                late = Stream(server.url, STREAM | {"max_tokens": 8})
            time.sleep(0.2)
        assert late is not None
        assert late.thread.is_alive() or late.events[0][1] == 200, late.events
        num_in_flight = sum(stream.thread.is_alive() for stream in streams)
        released_at = time.monotonic()
    for stream in [*streams, late]:
        stream.assert_finished(60)

    assert wait_until(lambda: _state(server) == "serving", timeout_s=10), server.health()
    status, body = server.health()
    assert status == 200 and body["status"] == "healthy" and "reason" not in body["engines"][0]
    assert server.metric("kvserve:engine_suspect", 0) == 0
    assert server.complete("after the engine came back")
    assert server.process.poll() is None, server.log()
    log = server.log()
    assert "it is hung" not in log and "engine core 0 is gone" not in log, log
    return SlowSpell(entries, suspect_metric, late, streams, slowed_at, released_at, num_in_flight)


def _state(server: ServeProcess) -> str:
    return server.health()[1]["engines"][0]["state"]


def _assert_suspect_then_healthy(server: ServeProcess, spell: SlowSpell) -> None:
    """It turned suspect after the heartbeat timeout, as /health, /metrics and the log say,
    and healthy again after."""
    assert spell.suspect, spell.entries
    first = spell.suspect[0]
    assert first["at"] >= HEARTBEAT_TIMEOUT_S - 0.5, first
    assert all(entry["status"] == "degraded" for entry in spell.suspect), spell.suspect
    assert all("sent nothing for" in entry["reason"] for entry in spell.suspect), spell.suspect
    assert spell.suspect_metric == 1
    log = server.log()
    assert "engine core 0 sent nothing for" in log and "engine core 0 is healthy again" in log


@contextlib.contextmanager
def _stopped(pids: list[int]) -> Iterator[None]:
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        for pid in pids:
            os.kill(pid, signal.SIGCONT)


def test_an_engine_frozen_past_its_heartbeat_timeout_is_suspect_then_serves_again(server):
    assert HEARTBEAT_TIMEOUT_S + 2 <= SLOW_S
    spell = _slow_engine_scenario(server, _stopped)
    _assert_suspect_then_healthy(server, spell)
    # Streams were in flight as it froze (on a loaded machine one of them can get all its
    # tokens before the other gets its first), they waited out the freeze, then finished:
    # nothing came while it lasted, past what was on its way as it began.
    assert spell.num_in_flight >= 1
    during = [
        t
        for stream in spell.streams
        for t, _ in stream.data()
        if spell.slowed_at + 1.0 < t < spell.released_at
    ]
    assert not during, (during, spell.slowed_at, spell.released_at)
    # Stopped: no CPU time, no wait for one; hung once that lasts the budget, not before.
    reasons = [entry["reason"] for entry in spell.suspect]
    assert "it used no CPU time and waited for none" in reasons[-1], reasons
    # The late request queued for the frozen engine: its first token came once it ran again.
    tokens = [t for t, item in spell.late.data() if item != "[DONE]"]
    assert tokens[0] > spell.released_at - 1.0, (tokens[0], spell.released_at)
    assert server.stop() == 0, server.log()


@pytest.mark.skipif(quota_unavailable() is not None, reason=str(quota_unavailable()))
def test_an_engine_held_to_5_percent_of_a_cpu_only_slows_down(server):
    # Measured: 5 ms of CPU every 100 ms keeps the tiny model's heartbeats within the limit
    # (so do 1%, and 5% or 1% of 1 s periods): the engine is slow, never even suspect.
    spell = _slow_engine_scenario(server, lambda pids: cpu_quota(pids, fraction=0.05))
    assert {entry["state"] for entry in spell.entries} == {"serving"}, spell.entries
    assert server.stop() == 0, server.log()


@pytest.mark.skipif(quota_unavailable() is not None, reason=str(quota_unavailable()))
def test_an_engine_starved_of_cpu_is_suspect_but_never_hung(tiny_llama_dir, tmp_path):
    # 1 ms of CPU a second: its heartbeats stop for a second and more, again and again. The
    # hung budget is as short as the heartbeat timeout: taking its silence, or its CPU time
    # that does not grow while it is throttled, for a hang would kill it. Its threads wait
    # for a CPU all along (state R): starved, not hung.
    server = _serve(
        tiny_llama_dir,
        tmp_path,
        heartbeat_timeout_s=STARVED_TIMEOUT_S,
        hung_timeout_s=STARVED_TIMEOUT_S,
    )
    try:
        server.wait_healthy()
        spell = _slow_engine_scenario(
            server,
            lambda pids: cpu_quota(pids, fraction=0.001, period_us=1_000_000),
            slow_s=STARVED_S,
        )
        assert spell.suspect, spell.entries
        assert spell.suspect_metric == 1
        reasons = [entry["reason"] for entry in spell.suspect]
        assert any("it is starved of CPU" in reason for reason in reasons), reasons
        assert server.stop() == 0, server.log()
    finally:
        server.stop()
