"""What a server's process tree holds: memory, file descriptors, sockets, /dev/shm segments;
and `release_freed_memory`, which hands what this process freed back to the OS.

A leak check takes a `TreeSnapshot` when the server is idle and warm, loads it, lets it settle
and takes another: file descriptors and sockets must come back, and no shared-memory segment
the tree created may outlive it (`new_shm_segments`).
"""

from __future__ import annotations

import os
import re

import msgspec
import psutil

SHM_DIR = "/dev/shm"
# Segments that name their creator's pid, as Intel OpenMP's `__KMP_REGISTERED_LIB_<pid>_<uid>`.
_PID_IN_NAME = re.compile(r"_(\d+)(?:_\d+)?$")


class ProcessResources(msgspec.Struct, frozen=True):
    pid: int
    name: str
    rss_bytes: int
    num_fds: int
    num_threads: int
    num_tcp: int  # TCP sockets other than listening ones
    num_tcp_listen: int
    num_unix: int  # Unix-domain sockets (ZeroMQ ipc:// among them)


class TreeSnapshot(msgspec.Struct, frozen=True):
    processes: list[ProcessResources]
    shm_mapped: list[str]  # /dev/shm entries the tree has open or mapped

    @property
    def pids(self) -> set[int]:
        return {p.pid for p in self.processes}

    @property
    def rss_bytes(self) -> int:
        return sum(p.rss_bytes for p in self.processes)

    @property
    def num_fds(self) -> int:
        return sum(p.num_fds for p in self.processes)

    @property
    def num_tcp(self) -> int:
        return sum(p.num_tcp for p in self.processes)

    @property
    def num_unix(self) -> int:
        return sum(p.num_unix for p in self.processes)


def tree_processes(root_pid: int) -> list[psutil.Process]:
    """The root and all its descendants alive now."""
    root = psutil.Process(root_pid)
    return [root, *root.children(recursive=True)]


def tree_rss_and_fds(root_pid: int) -> tuple[int, int]:
    """(RSS bytes, open fds) summed over the tree: cheap enough to sample every second."""
    rss = fds = 0
    for process in tree_processes(root_pid):
        try:
            rss += process.memory_info().rss
            fds += process.num_fds()
        except psutil.NoSuchProcess:
            pass
    return rss, fds


def snapshot_tree(root_pid: int) -> TreeSnapshot:
    """Each live process of the tree's memory, fds, threads and sockets, and its shm entries."""
    processes, shm_mapped = [], set()
    for process in tree_processes(root_pid):
        try:
            with process.oneshot():
                inet = process.net_connections("inet")
                processes.append(
                    ProcessResources(
                        pid=process.pid,
                        name=_short_name(process, root_pid),
                        rss_bytes=process.memory_info().rss,
                        num_fds=process.num_fds(),
                        num_threads=process.num_threads(),
                        num_tcp=sum(c.status != psutil.CONN_LISTEN for c in inet),
                        num_tcp_listen=sum(c.status == psutil.CONN_LISTEN for c in inet),
                        num_unix=len(process.net_connections("unix")),
                    )
                )
            shm_mapped |= _shm_entries_of(process.pid)
        except psutil.NoSuchProcess:
            pass
    return TreeSnapshot(processes, sorted(shm_mapped))


def shm_entries() -> set[str]:
    """The names in /dev/shm now."""
    return set(os.listdir(SHM_DIR))


def new_shm_segments(before: set[str], after: set[str], tree: list[TreeSnapshot]) -> list[str]:
    """Entries in `after` but not `before` that the tree made: ones it had mapped or open at a
    snapshot, or whose name ends in one of its pids. Other processes on the machine come and
    go in /dev/shm too; their entries are not counted."""
    mapped = {name for snapshot in tree for name in snapshot.shm_mapped}
    pids = {pid for snapshot in tree for pid in snapshot.pids}
    leaked = []
    for name in sorted(after - before):
        match = _PID_IN_NAME.search(name)
        if name in mapped or (match is not None and int(match.group(1)) in pids):
            leaked.append(name)
    return leaked


def _shm_entries_of(pid: int) -> set[str]:
    # Open fds and mapped files both: a segment may be mapped with its fd already closed.
    names = set()
    prefix = SHM_DIR + "/"
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith(prefix):
                names.add(target[len(prefix) :].removesuffix(" (deleted)"))
        with open(f"/proc/{pid}/maps") as maps:
            for line in maps:
                path = line.split(None, 5)[-1].strip() if line.count(" ") >= 5 else ""
                if path.startswith(prefix):
                    names.add(path[len(prefix) :].removesuffix(" (deleted)"))
    except OSError:
        pass
    return names


def _short_name(process: psutil.Process, root_pid: int) -> str:
    """`api` (the root), `resource_tracker`, `engine core` (another child of the root) or
    `worker` (deeper): spawned children all run `python -c ...spawn_main...`."""
    if process.pid == root_pid:
        return "api"
    if "resource_tracker" in " ".join(process.cmdline()):
        return "resource_tracker"
    return "engine core" if process.ppid() == root_pid else "worker"


def release_freed_memory() -> int:
    """Collect reference cycles (an engine is a web of them) and hand glibc's free heap back to
    the OS (`malloc_trim(0)`); a freed engine otherwise stays resident (~1 GiB each). Returns
    this process's RSS after."""
    import ctypes
    import gc

    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to trim
        pass
    return psutil.Process().memory_info().rss
