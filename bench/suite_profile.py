"""Run a command and report its wall time and the peak memory of everything it starts.

    python bench/suite_profile.py [--interval 0.5] [--json OUT] [--timeline OUT] -- CMD ARGS...

Memory is sampled every --interval seconds over the command's process tree together with
every process that carries this run's marker in its environment (so daemons that detach from
the tree, e.g. a Ray head or a dockerd a test started, still count). Two sums are reported:
RSS (what `ps` shows; shared library pages are counted once per process, so it overstates)
and PSS (shared pages split between the processes that map them: the closest figure to what
the run costs the machine). The load average (start, end, and the mean of 1-minute samples)
is printed alongside, since a shared machine inflates wall time; so is the CPU time of the
command and the descendants it reaped, which a busy machine inflates far less.

A third figure is the machine's used memory (total less available, as `free` counts it) over
the run, less what was used when it started: it sees what no process tree shows, such as the
containers of a `docker build` that dockerd runs for a test. It counts every other process on
the machine too, so it means something only on a quiet machine.

Args:
    --interval: seconds between samples.
    --json: also write the figures as JSON to this path.
    --timeline: write every sample as a JSON line to this path: seconds since the start, the
        RSS and PSS sums, the PSS per branch of the process tree (each process counted under
        the command's child it descends from, e.g. a pytest-xdist worker, by that child's pid;
        "root" for the command itself, "detached" for marked processes outside the tree),
        and the four largest processes, to find which tests overlap at the peak.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import asdict, dataclass, field

import psutil

MARKER_VAR = "KVSERVE_SUITE_PROFILE"
GIB = 1024**3


@dataclass
class Peaks:
    """The largest figures seen over the run (bytes)."""

    rss_sum: int = 0
    pss_sum: int = 0
    largest_rss: int = 0
    largest_name: str = ""
    machine_used: int = 0
    processes: int = 0
    samples: int = 0
    loadavg_samples: list[float] = field(default_factory=list)


def _carries_marker(proc: psutil.Process, token: str) -> bool:
    try:
        return proc.environ().get(MARKER_VAR) == token
    except (psutil.Error, OSError):
        return False


class _Marked:
    """Which processes carry the marker; each process's environment is read once."""

    def __init__(self, token: str):
        self.token = token
        self.seen: dict[tuple[int, float], bool] = {}

    def find(self) -> list[psutil.Process]:
        me = os.getuid()
        found = []
        for proc in psutil.process_iter(["uids", "create_time"]):
            uids = proc.info.get("uids")
            if uids is None or uids.real != me:
                continue
            key = (proc.pid, proc.info.get("create_time") or 0.0)
            if key not in self.seen:
                self.seen[key] = _carries_marker(proc, self.token)
            if self.seen[key]:
                found.append(proc)
        return found


def _tracked(root: psutil.Process, marked: _Marked) -> dict[int, tuple[psutil.Process, str]]:
    """The root, its descendants, and any process started with this run's marker, each with
    its branch: the pid of the root's child it descends from, "root" or "detached"."""
    procs: dict[int, tuple[psutil.Process, str]] = {root.pid: (root, "root")}
    try:
        for child in root.children():
            procs[child.pid] = (child, str(child.pid))
            for grandchild in child.children(recursive=True):
                procs[grandchild.pid] = (grandchild, str(child.pid))
    except psutil.Error:
        pass
    for proc in marked.find():
        procs.setdefault(proc.pid, (proc, "detached"))
    return procs


def _memory(proc: psutil.Process) -> tuple[int, int]:
    """(rss, pss) of one process; pss falls back to rss where smaps cannot be read."""
    try:
        full = proc.memory_full_info()
        return full.rss, getattr(full, "pss", full.rss)
    except psutil.AccessDenied:
        try:
            rss = proc.memory_info().rss
            return rss, rss
        except psutil.Error:
            return 0, 0
    except psutil.Error:
        return 0, 0


def _machine_used() -> int:
    """The machine's used memory: total less available (bytes)."""
    memory = psutil.virtual_memory()
    return memory.total - memory.available


def _sample(root: psutil.Process, marked: _Marked, peaks: Peaks) -> dict[str, object]:
    """Sample every tracked process once, fold the sums into peaks, and return the sample."""
    rss_sum = pss_sum = 0
    by_branch: dict[str, int] = {}
    largest: list[tuple[int, int, psutil.Process]] = []
    procs = _tracked(root, marked)
    for proc, branch in procs.values():
        rss, pss = _memory(proc)
        rss_sum += rss
        pss_sum += pss
        by_branch[branch] = by_branch.get(branch, 0) + pss
        largest.append((pss, proc.pid, proc))
        if rss > peaks.largest_rss:
            peaks.largest_rss = rss
            try:
                peaks.largest_name = " ".join(proc.cmdline()[:4])[:120]
            except psutil.Error:
                peaks.largest_name = "?"
    peaks.rss_sum = max(peaks.rss_sum, rss_sum)
    peaks.pss_sum = max(peaks.pss_sum, pss_sum)
    peaks.processes = max(peaks.processes, len(procs))
    machine_used = _machine_used()
    peaks.machine_used = max(peaks.machine_used, machine_used)
    peaks.samples += 1
    top = []
    for pss, pid, proc in sorted(largest, key=lambda entry: entry[0], reverse=True)[:4]:
        try:
            name = " ".join(proc.cmdline())[:100]
        except psutil.Error:
            name = "?"
        top.append([round(pss / GIB, 3), pid, name])
    return {
        "rss_gib": round(rss_sum / GIB, 3),
        "pss_gib": round(pss_sum / GIB, 3),
        "machine_used_gib": round(machine_used / GIB, 3),
        "pss_by_branch_gib": {k: round(v / GIB, 3) for k, v in sorted(by_branch.items())},
        "largest": top,
    }


def _sampler(
    root: psutil.Process,
    token: str,
    peaks: Peaks,
    interval: float,
    stop: threading.Event,
    timeline: str | None,
) -> None:
    last_load = 0.0
    marked = _Marked(token)
    start = time.monotonic()
    out = open(timeline, "w") if timeline else None
    try:
        while not stop.is_set():
            sample = _sample(root, marked, peaks)
            if out is not None:
                out.write(json.dumps({"t": round(time.monotonic() - start, 1)} | sample) + "\n")
                out.flush()
            if time.monotonic() - last_load >= 30:
                peaks.loadavg_samples.append(os.getloadavg()[0])
                last_load = time.monotonic()
            stop.wait(interval)
    finally:
        if out is not None:
            out.close()


def main() -> int:
    """Run the command, sample it, print (and optionally save) the figures."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--interval", type=float, default=0.5)
    parser.add_argument("--json", default=None)
    parser.add_argument("--timeline", default=None)
    parser.add_argument("cmd", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    if not cmd:
        parser.error("no command given")
    token = uuid.uuid4().hex
    env = dict(os.environ, **{MARKER_VAR: token})
    load_start = os.getloadavg()
    used_at_start = _machine_used()
    start = time.monotonic()
    # SIGINT as it is by default even where this was started in the background (where the
    # shell ignores it): an interrupted pytest still prints its summary and --durations.
    child = subprocess.Popen(
        cmd, env=env, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL)
    )
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda sig, _frame: child.send_signal(signal.SIGINT))
    peaks = Peaks()
    stop = threading.Event()
    thread = threading.Thread(
        target=_sampler,
        args=(psutil.Process(child.pid), token, peaks, args.interval, stop, args.timeline),
        daemon=True,
    )
    thread.start()
    # wait4: the CPU time of the command and of every descendant it (transitively) reaped.
    _, status, usage = os.wait4(child.pid, 0)
    child.returncode = rc = os.waitstatus_to_exitcode(status)
    wall = time.monotonic() - start
    stop.set()
    thread.join()
    load_end = os.getloadavg()
    mean_load = sum(peaks.loadavg_samples) / max(1, len(peaks.loadavg_samples))
    report = {
        "cmd": cmd,
        "rc": rc,
        "wall_s": round(wall, 1),
        "cpu_user_s": round(usage.ru_utime, 1),
        "cpu_sys_s": round(usage.ru_stime, 1),
        "peak_rss_sum_gib": round(peaks.rss_sum / GIB, 2),
        "peak_pss_sum_gib": round(peaks.pss_sum / GIB, 2),
        "peak_machine_used_gib": round(peaks.machine_used / GIB, 2),
        "peak_machine_used_over_start_gib": round((peaks.machine_used - used_at_start) / GIB, 2),
        "largest_process_rss_gib": round(peaks.largest_rss / GIB, 2),
        "largest_process": peaks.largest_name,
        "max_processes": peaks.processes,
        "samples": peaks.samples,
        "loadavg_start": [round(x, 2) for x in load_start],
        "loadavg_end": [round(x, 2) for x in load_end],
        "loadavg_1m_mean": round(mean_load, 2),
    }
    text = "\n".join(f"suite_profile {key}: {value}" for key, value in report.items())
    print(text, file=sys.stderr, flush=True)
    if args.json:
        with open(args.json, "w") as out:
            json.dump(report | {"peaks": asdict(peaks)}, out, indent=1)
    return rc


if __name__ == "__main__":
    sys.exit(main())
