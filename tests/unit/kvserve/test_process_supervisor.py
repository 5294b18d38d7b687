"""ProcessSupervisor (kvserve/launch/supervisor.py) with real child processes: a dead process's
descendants are killed, it restarts at once after a long life, and backs off (1 s, 2 s, ...)
while it keeps dying young."""

from __future__ import annotations

import multiprocessing
import os
import time

import psutil

from kvserve.launch import supervisor as supervisor_module
from kvserve.launch.supervisor import ProcessSupervisor
from tests.support.processes import wait_gone
from tests.support.waiting import wait_until

_fork = multiprocessing.get_context("fork")


def _sleep_with_a_child() -> None:
    _fork.Process(target=time.sleep, args=(60,)).start()
    time.sleep(60)


def _start(target, *args) -> multiprocessing.Process:
    process = _fork.Process(target=target, args=args)
    process.start()
    return process


def test_restarts_and_kills_the_dead_ones_descendants(monkeypatch):
    monkeypatch.setattr(supervisor_module, "RESTART_WINDOW_S", 0.5)
    processes = {0: _start(_sleep_with_a_child)}
    starts = []

    def start(key):
        starts.append(key)
        return _start(time.sleep, 60)

    supervisor = ProcessSupervisor(processes, start, lambda key: f"process {key}")
    try:
        first = processes[0]
        assert wait_until(lambda: psutil.Process(first.pid).children(), timeout_s=10)
        time.sleep(0.6)  # a long life: no back-off
        supervisor.check()  # sees the child
        (child,) = psutil.Process(first.pid).children()
        first.kill()
        first.join()
        supervisor.check()  # the death: restart due at once
        supervisor.check()  # the restart
        assert starts == [0] and processes[0] is not first and processes[0].is_alive()
        assert supervisor.num_restarts == 1
        assert wait_gone([child], timeout_s=5) == [], "the dead process's child was left"
    finally:
        for process in processes.values():
            process.kill()


def test_backs_off_while_it_keeps_dying_young(monkeypatch):
    monkeypatch.setattr(supervisor_module, "RESTART_WINDOW_S", 30.0)
    processes = {"p": _start(os._exit, 3)}
    supervisor = ProcessSupervisor(processes, lambda key: _start(os._exit, 3), str)
    delays = []
    for _ in range(4):
        processes["p"].join()
        supervisor.check()  # schedules the restart
        delays.append(round(supervisor._restart_at["p"] - time.monotonic()))
        supervisor._restart_at["p"] = time.monotonic()  # skip the wait
        supervisor.check()  # restarts
    assert delays == [1, 2, 4, 8]
    assert supervisor.num_restarts == 4
