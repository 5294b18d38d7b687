"""Supervision of the launcher's child processes: restart on death, stop on the way out.

`ProcessSupervisor` restarts the processes of a dict that exit (engine cores by index, the DP
coordinator, the P/D KV store), backing off while one keeps dying young; `supervised` runs
one as a task for the length of a `with` block. `stop_process` is how every child stops:
SIGTERM, then SIGKILL after a grace period.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import time
from collections.abc import AsyncIterator, Callable
from multiprocessing.process import BaseProcess
from typing import Any

import psutil

from kvserve.shared.logging import init_logger

logger = init_logger(__name__)

# How long a SIGTERM'd child (an engine stopping its workers, the KV store unlinking its
# shared memory) may take before it is killed.
STOP_TIMEOUT_S = 10.0

# A process that dies sooner than this after its start is crash-looping (a bad flag, a
# missing file: it dies while starting): its next restart waits (1 s, doubling up to
# MAX_RESTART_DELAY_S); one that lived longer restarts at once. A model load that fails late
# is rate-limited by its own length.
RESTART_WINDOW_S = 10.0
MAX_RESTART_DELAY_S = 30.0


class ChildStartError(RuntimeError):
    """A child process exited (or never became ready) while the launcher started it."""


def describe_exit(exitcode: int | None) -> str:
    """'signal SIGKILL' or 'code 1', for the log."""
    if exitcode is not None and exitcode < 0:
        return f"signal {signal.Signals(-exitcode).name}"
    return f"code {exitcode}"


def stop_process(process: BaseProcess, what: str) -> bool:
    """SIGTERM, SIGKILL after STOP_TIMEOUT_S, join. True when it had to be killed.

    Args:
        what: how the log names the process when it ignores SIGTERM.
    """
    killed = False
    if process.is_alive():
        process.terminate()
        process.join(STOP_TIMEOUT_S)
        if process.is_alive():
            logger.error("%s ignored SIGTERM for %.0f s; killing it", what, STOP_TIMEOUT_S)
            process.kill()
            killed = True
    process.join()
    return killed


class ProcessSupervisor:
    """Restarts the processes of a dict (engine cores by index, the coordinator) that exit.

    `check()` runs every half second or so (it never waits on a process): a dead process's
    descendants (an engine's workers, seen while it lived) are killed, and the process
    starts again through `start(key)` once its back-off is over; the dict holds the new one.

    Args:
        processes: key -> process; entries are replaced on restart (callers share it).
        start: starts the process of one key again (may raise: retried after the back-off).
        name: how the log names the process of one key.
    """

    def __init__(
        self,
        processes: dict[Any, BaseProcess],
        start: Callable[[Any], BaseProcess],
        name: Callable[[Any], str],
    ):
        self.processes = processes
        self.start = start
        self.name = name
        self.num_restarts = 0
        now = time.monotonic()
        self._started_at = dict.fromkeys(processes, now)
        self._quick_deaths = dict.fromkeys(processes, 0)
        self._restart_at: dict = {}
        self._descendants: dict[object, list[psutil.Process]] = {}

    def check(self) -> None:
        now = time.monotonic()
        for key, process in list(self.processes.items()):
            if key in self._restart_at:
                if now >= self._restart_at[key]:
                    self._restart(key, now)
            elif process.is_alive():
                self._descendants[key] = _descendants(process)
            else:
                self._schedule_restart(key, process, now)

    def _schedule_restart(self, key, process: BaseProcess, now: float) -> None:
        process.join()
        for leftover in self._descendants.pop(key, []):
            with contextlib.suppress(psutil.NoSuchProcess):
                leftover.kill()
        lived_s = now - self._started_at[key]
        self._quick_deaths[key] = self._quick_deaths[key] + 1 if lived_s < RESTART_WINDOW_S else 0
        quick = self._quick_deaths[key]
        delay_s = 0.0 if quick == 0 else min(MAX_RESTART_DELAY_S, 2.0 ** (quick - 1))
        self._restart_at[key] = now + delay_s
        logger.error(
            "%s (pid %d) exited with %s after %.0f s; restarting it in %.0f s",
            self.name(key),
            process.pid,
            describe_exit(process.exitcode),
            lived_s,
            delay_s,
        )

    def _restart(self, key, now: float) -> None:
        del self._restart_at[key]
        self._started_at[key] = now
        try:
            self.processes[key] = self.start(key)
        except Exception as exc:  # noqa: BLE001 - a failed start is retried after a back-off
            logger.error("restarting %s failed: %s", self.name(key), exc)
            self._quick_deaths[key] += 1
            self._restart_at[key] = now + min(
                MAX_RESTART_DELAY_S, 2.0 ** (self._quick_deaths[key] - 1)
            )
            return
        self.num_restarts += 1
        logger.info(
            "restarted %s (pid %d; restart %d)",
            self.name(key),
            self.processes[key].pid,
            self.num_restarts,
        )

    async def run(self, interval_s: float = 0.5) -> None:
        """check() forever, off the event loop (a start may block for a while)."""
        while True:
            await asyncio.sleep(interval_s)
            await asyncio.to_thread(self.check)


@contextlib.asynccontextmanager
async def supervised(
    processes: dict[Any, BaseProcess],
    start: Callable[[Any], BaseProcess],
    name: Callable[[Any], str],
) -> AsyncIterator[None]:
    """A ProcessSupervisor (same arguments) running as a task for the block's length.

    It is cancelled on the way out before anything is stopped, so no child restarts while
    the launcher stops them."""
    task = asyncio.create_task(ProcessSupervisor(processes, start, name).run())
    try:
        yield
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


def _descendants(process: BaseProcess) -> list[psutil.Process]:
    if process.pid is None:  # never started (psutil would read None as this process)
        return []
    try:
        return psutil.Process(process.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []
