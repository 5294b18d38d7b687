"""Processes a test started, or that its servers started: are they gone, and which is which."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Iterable

import psutil


def _is_alive(process: psutil.Process) -> bool:
    # is_running() also guards against pid reuse; a zombie has exited but is not reaped yet.
    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def wait_gone(processes: Iterable[psutil.Process | int], timeout_s: float) -> list[psutil.Process]:
    """The processes still alive after up to timeout_s (zombies count as gone).

    Args:
        processes: psutil handles or pids; a pid that no longer exists is gone already.
        timeout_s: how long to wait for the last of them.
    """
    watched = []
    for process in processes:
        try:
            watched.append(
                process if isinstance(process, psutil.Process) else psutil.Process(process)
            )
        except psutil.NoSuchProcess:
            pass
    deadline = time.monotonic() + timeout_s
    while True:
        alive = [process for process in watched if _is_alive(process)]
        if not alive or time.monotonic() >= deadline:
            return alive
        time.sleep(0.05)


def engine_child(launcher: subprocess.Popen) -> psutil.Process:
    """The launcher's one engine-core child (spawned: its command line runs spawn_main)."""
    (engine,) = [
        child
        for child in psutil.Process(launcher.pid).children()
        if "spawn_main" in " ".join(child.cmdline())
    ]
    return engine
