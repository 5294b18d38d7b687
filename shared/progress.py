"""Whether a silent process is hung, or only slow or starved of CPU.

A process that stops talking (no heartbeat) is not yet known to be hung: on a busy host
(load above the cores, a cgroup CPU quota, memory reclaim) it may run slowly, or wait on a
run queue for a CPU. The kernel tells these apart. /proc/<pid>/task/<tid>/schedstat holds,
per thread, the ns spent on a CPU, the ns spent runnable but waiting on a run queue, and the
number of timeslices; /proc/<pid>/task/<tid>/stat the thread's state (R: running or
runnable). The wait is added when a wait ends, so a thread that waits for seconds (throttled
by a cgroup quota with a long period) shows it only then; meanwhile its state says R:

    its cgroup's CPU quota throttled it  held back by a quota: starved, not hung
    CPU time grew, under 1% of a CPU     it runs a sliver while a thread waits: starved
      with a thread in R
    CPU time grew                        it ran: slow, not hung
    the wait grew, or a thread is in R   it wants a CPU and gets none: starved, not hung
    neither                              stopped (SIGSTOP, state T) or blocked (a deadlock,
                                         a stuck syscall: S or D): hung

A quota (a container's CPU limit) comes first: a throttled process still runs a little each
period, and that bit of CPU time would read as merely slow. The cgroup's cpu.stat (v2
`throttled_usec`, v1 `throttled_time`, summed over the process's group and its ancestors,
where limits set higher up apply) grows when a throttled spell ends.

ProcessProgress samples one process; SilenceWatch keeps the verdict on one silent peer (its
processes on this host, or none for a remote peer, whose silence is all there is to know).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import NamedTuple

import psutil


class Progress(NamedTuple):
    """What a process has done since it started, summed over its live threads, and how
    many of them want a CPU now."""

    cpu_ns: int  # on a CPU
    wait_ns: int  # runnable, waiting on a run queue (0 where the kernel does not say)
    num_runnable: int = 0  # threads running or waiting for a CPU at the sample
    throttled_ns: int = 0  # its cgroups held back by their CPU quota (0 where unknown)


class ProcessProgress:
    """CPU time and run-queue wait of one process, from /proc/<pid>/task/*/schedstat.

    Where schedstat cannot be read, psutil's CPU times stand in and the wait reads 0: then
    only "no CPU time" and "CPU time" can be told apart.

    Args:
        pid: the process.
    """

    def __init__(self, pid: int):
        self.pid = pid
        try:
            self.has_wait = _read_schedstat(pid) is not None
        except psutil.NoSuchProcess:
            self.has_wait = False  # gone already: sample() says so

    def sample(self) -> Progress:
        """(ns on a CPU, ns waiting for one) since the process started, and its runnable
        threads.

        Raises:
            psutil.NoSuchProcess: the process is gone.
            psutil.AccessDenied: neither /proc nor psutil may read it.
        """
        throttled_ns = _read_throttled_ns(self.pid)
        if self.has_wait:
            progress = _read_schedstat(self.pid)
            if progress is not None:
                return progress._replace(throttled_ns=throttled_ns)
            self.has_wait = False  # unreadable now: psutil from here on
        process = psutil.Process(self.pid)
        times = process.cpu_times()
        num_runnable = int(process.status() == psutil.STATUS_RUNNING)
        return Progress(int((times.user + times.system) * 1e9), 0, num_runnable, throttled_ns)


# The throttled-time line of cpu.stat and its unit in ns: cgroup v2, then v1.
_THROTTLED_FIELDS = {"throttled_usec": 1000, "throttled_time": 1}


def _read_throttled_ns(pid: int) -> int:
    """How long the CPU quotas of the process's cgroup and its ancestors have held them back
    (ns, summed); 0 where /proc or /sys/fs/cgroup do not say."""
    try:
        with open(f"/proc/{pid}/cgroup") as f:
            lines = f.read().splitlines()
    except OSError:
        return 0
    unified = None
    for line in lines:  # "N:cpu,cpuacct:/path" (v1), "0::/path" (v2)
        _, controllers, path = line.split(":", 2)
        if "cpu" in controllers.split(","):
            return _throttled_along(f"/sys/fs/cgroup/{controllers}", path)
        if controllers == "":
            unified = path
    if unified is None:
        return 0
    # v2 alone is mounted at /sys/fs/cgroup; beside v1 (hybrid), at /sys/fs/cgroup/unified.
    root = "/sys/fs/cgroup"
    if not os.path.exists(os.path.join(root, "cgroup.controllers")):
        root = os.path.join(root, "unified")
    return _throttled_along(root, unified)


def _throttled_along(root: str, path: str) -> int:
    """The throttled time in the cpu.stat of `path` and of each folder above it under root."""
    total = 0
    parts = [part for part in path.split("/") if part]
    for depth in range(len(parts), -1, -1):
        try:
            with open(os.path.join(root, *parts[:depth], "cpu.stat")) as f:
                for line in f:
                    name, _, value = line.partition(" ")
                    if name in _THROTTLED_FIELDS:
                        total += int(value) * _THROTTLED_FIELDS[name]
        except (OSError, ValueError):
            continue  # no cpu controller there, or not ours to read
    return total


def _read_schedstat(pid: int) -> Progress | None:
    """The sums over the process's threads; None when /proc does not say."""
    task_dir = f"/proc/{pid}/task"
    try:
        thread_ids = os.listdir(task_dir)
    except FileNotFoundError:
        if not psutil.pid_exists(pid):
            raise psutil.NoSuchProcess(pid) from None
        return None  # no /proc here
    except OSError:
        return None  # not ours to read
    cpu_ns = wait_ns = num_runnable = 0
    for thread_id in thread_ids:
        try:
            with open(f"{task_dir}/{thread_id}/schedstat") as f:
                fields = f.read().split()
            with open(f"{task_dir}/{thread_id}/stat") as f:
                # The state follows the command name, which may hold spaces and parentheses.
                state = f.read().rpartition(")")[2].split()[0]
        except FileNotFoundError:
            continue  # the thread exited since the listing
        except OSError:
            return None
        cpu_ns += int(fields[0])
        wait_ns += int(fields[1])
        num_runnable += state == "R"
    return Progress(cpu_ns, wait_ns, num_runnable)


# Runnable threads that got less than this share of one CPU between two looks are starved,
# though their CPU time grew: a cgroup quota of 1 ms a second let an engine core run 2 ms in
# half a second (0.4%, seen under CI's load), which is not the pace of a slow engine; a busy
# process on a loaded two-core machine got 2% in a tenth of a second (measured).
STARVED_CPU_SHARE = 0.01


def _sign_of_life(
    cpu_ms: float, wait_ms: float, throttled_ms: float, num_runnable: int, interval_s: float
) -> str | None:
    """What one look's growth says of a silent process (see the module docstring): slow or
    starved; None for no sign of life."""
    if throttled_ms > 0:
        return (
            f"it is starved of CPU (its cgroup's CPU quota held it back for "
            f"{throttled_ms:.0f} ms; it ran {max(cpu_ms, 0):.0f} ms in {interval_s:.1f} s)"
        )
    if cpu_ms > 0 and num_runnable and cpu_ms < STARVED_CPU_SHARE * interval_s * 1000:
        return (
            f"it is starved of CPU ({num_runnable} runnable threads got {cpu_ms:.0f} ms of "
            f"CPU in {interval_s:.1f} s)"
        )
    if cpu_ms > 0:
        return f"it runs, slowly ({cpu_ms:.0f} ms of CPU in {interval_s:.1f} s)"
    if wait_ms > 0 or num_runnable:
        return (
            f"it is starved of CPU ({num_runnable} runnable threads; "
            f"{wait_ms:.0f} ms of run-queue waits ended in {interval_s:.1f} s)"
        )
    return None


class SilenceWatch:
    """While a peer says nothing: is it slow, starved or hung?

    `heard` ends a silence. During one, each `look` samples the peer's processes and compares
    with the look before: CPU time consumed, or time spent waiting for a CPU (a wait that
    grew, or a thread runnable now), is a sign of life. A peer on this host is hung once the
    looks have found no sign for `hung_timeout_s`; that window opens at the first look of the
    silence, so look from its start (every check). A remote peer (no processes) is hung
    after `hung_timeout_s` of silence: nothing else can be known about it.

    Args:
        processes: the peer's processes on this host (empty: a remote peer).
        now: when it was last heard from (time.monotonic()).
    """

    def __init__(self, processes: Sequence[ProcessProgress], now: float):
        self.processes = list(processes)
        self.last_heard_time = now
        self.finding = ""  # what the looks of this silence saw, for reasons and /health
        self._last_look: tuple[float, Progress] | None = None  # of this silence
        self._quiet_since: float | None = None  # looks since then saw no sign of life

    def heard(self, when: float) -> None:
        """The peer spoke at `when`: a silence before it is over."""
        if when > self.last_heard_time:
            self.last_heard_time = when
            self.finding = ""
            self._last_look = self._quiet_since = None

    def silent_s(self, now: float) -> float:
        return now - self.last_heard_time

    def quiet_s(self, now: float) -> float:
        """How long the looks have seen no sign of life (0 before two looks, and remote)."""
        return 0.0 if self._quiet_since is None else now - self._quiet_since

    def look(self, now: float) -> None:
        """Sample the processes once more."""
        if not self.processes:
            self.finding = "its CPU use cannot be read from this host: only its silence is known"
            return
        progress = self._sample()
        if progress is None:
            return  # a process is gone: that death is noticed on its own
        previous, self._last_look = self._last_look, (now, progress)
        if previous is None:
            return
        since_time, since = previous
        # A thread that exits takes its counts out of the sums: only growth is a sign.
        cpu_ms = (progress.cpu_ns - since.cpu_ns) / 1e6
        wait_ms = (progress.wait_ns - since.wait_ns) / 1e6
        interval_s = now - since_time
        throttled_ms = (progress.throttled_ns - since.throttled_ns) / 1e6
        finding = _sign_of_life(cpu_ms, wait_ms, throttled_ms, progress.num_runnable, interval_s)
        if finding is not None:
            self._quiet_since = None
            self.finding = finding
        else:
            if self._quiet_since is None:
                self._quiet_since = since_time
            self.finding = (
                f"it used no CPU time and waited for none for {self.quiet_s(now):.1f} s "
                f"(stopped or blocked?)"
            )

    def is_hung(self, now: float, hung_timeout_s: float) -> bool:
        """No sign of life for hung_timeout_s (see the class docstring)."""
        if not self.processes:
            return self.silent_s(now) > hung_timeout_s
        return self.quiet_s(now) > hung_timeout_s

    def _sample(self) -> Progress | None:
        """The sums over the processes; None when one is gone. A process that may not be
        read (another user's) leaves the watch to silence alone."""
        samples = []
        for process in self.processes:
            try:
                samples.append(process.sample())
            except psutil.NoSuchProcess:
                return None
            except psutil.AccessDenied:
                self.processes = []
                return None
        # Processes in one cgroup share its throttled time: the largest counts it once.
        return Progress(
            cpu_ns=sum(sample.cpu_ns for sample in samples),
            wait_ns=sum(sample.wait_ns for sample in samples),
            num_runnable=sum(sample.num_runnable for sample in samples),
            throttled_ns=max((sample.throttled_ns for sample in samples), default=0),
        )
