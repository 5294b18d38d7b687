"""A CPU quota on running processes, through a cgroup of their own (v1 `cpu` or v2 `cpu.max`).

Needs a writable cgroup hierarchy (root on most machines); `quota_unavailable` says why not,
for a skip.
"""

from __future__ import annotations

import contextlib
import os
import uuid
from collections.abc import Iterable, Iterator

V1_CPU_ROOT = "/sys/fs/cgroup/cpu"
V2_ROOT = "/sys/fs/cgroup"


def _hierarchy() -> tuple[str, str] | None:
    """(root folder, "v1" or "v2") of a cgroup CPU controller, or None."""
    if os.path.exists(os.path.join(V1_CPU_ROOT, "cpu.cfs_period_us")) or os.path.exists(
        os.path.join(V1_CPU_ROOT, "cgroup.procs")
    ):
        return V1_CPU_ROOT, "v1"
    controllers = os.path.join(V2_ROOT, "cgroup.subtree_control")
    if os.path.exists(controllers):
        with open(controllers) as f:
            if "cpu" in f.read().split():
                return V2_ROOT, "v2"
    return None


def quota_unavailable() -> str | None:
    """Why no CPU quota can be put on a process here, or None when it can."""
    hierarchy = _hierarchy()
    if hierarchy is None:
        return f"no cgroup CPU controller ({V1_CPU_ROOT} for v1, cpu in {V2_ROOT} for v2)"
    root, version = hierarchy
    probe = os.path.join(root, f"kvserve-probe-{uuid.uuid4().hex[:8]}")
    try:
        os.mkdir(probe)
    except OSError as exc:
        return f"the cgroup {version} hierarchy at {root} is not writable: {exc}"
    try:
        quota_file = "cpu.cfs_quota_us" if version == "v1" else "cpu.max"
        if not os.path.exists(os.path.join(probe, quota_file)):
            return f"cgroup {version} at {root} has no {quota_file}"
    finally:
        os.rmdir(probe)
    return None


def _own_cgroup(pid: int, version: str) -> str:
    """The path of pid's cgroup in the hierarchy, relative to its root."""
    with open(f"/proc/{pid}/cgroup") as f:
        for line in f:
            _, controllers, path = line.rstrip("\n").split(":", 2)
            if (version == "v2" and controllers == "") or (
                version == "v1" and "cpu" in controllers.split(",")
            ):
                return path
    return "/"


@contextlib.contextmanager
def cpu_quota(pids: Iterable[int], fraction: float, period_us: int = 100_000) -> Iterator[str]:
    """Hold these processes (every thread) to `fraction` of one CPU; yields the group's
    folder. On exit they go back to the cgroups they came from and the group is removed.

    Args:
        pids: whole processes: writing one to cgroup.procs moves all its threads.
        fraction: of one CPU, e.g. 0.05 for 5%.
        period_us: the CFS period the quota is a part of.
    """
    hierarchy = _hierarchy()
    assert hierarchy is not None, quota_unavailable()
    root, version = hierarchy
    group = os.path.join(root, f"kvserve-test-{uuid.uuid4().hex[:8]}")
    os.mkdir(group)
    quota_us = max(1000, int(fraction * period_us))
    if version == "v1":
        _write(os.path.join(group, "cpu.cfs_period_us"), str(period_us))
        _write(os.path.join(group, "cpu.cfs_quota_us"), str(quota_us))
    else:
        _write(os.path.join(group, "cpu.max"), f"{quota_us} {period_us}")
    homes = {pid: _own_cgroup(pid, version) for pid in pids}
    try:
        for pid in homes:
            _write(os.path.join(group, "cgroup.procs"), str(pid))
        yield group
    finally:
        for pid, home in homes.items():
            with contextlib.suppress(OSError):  # gone meanwhile
                _write(os.path.join(root + home.rstrip("/"), "cgroup.procs"), str(pid))
        # Threads created inside the group went home with their process.
        os.rmdir(group)


def _write(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
