"""Clean-up of the POSIX shared-memory segments a killed process left in /dev/shm.

A process that creates a segment registers it with multiprocessing's resource tracker, and
the launcher's children share the launcher's tracker, which unlinks what is still
registered only when the launcher exits (warning that it "leaked"). A SIGKILLed creator
never unlinks its own, so whoever restarts it does, by the creator's pid in the names: the
engine core's worker ring (shared/shm_ring.py) and the KV store's arenas
(services/kv_store/arena.py).
"""

from __future__ import annotations

import _posixshmem  # CPython's POSIX shm module, what multiprocessing.shared_memory uses
import contextlib
import glob
import os
from multiprocessing import resource_tracker


def unlink_segments(pattern: str) -> list[str]:
    """Unlink the segments whose names match `pattern` (a glob of segment names, the dead
    creator's pid in it) and drop their registrations, so the tracker neither unlinks a
    successor's segment of the same name nor reports them leaked at exit; their names.

    Args:
        pattern: e.g. "kvserve-ring-1234-*"; never one that matches a live process's.
    """
    names = [os.path.basename(path) for path in glob.glob(os.path.join("/dev/shm", pattern))]
    for name in names:
        with contextlib.suppress(FileNotFoundError):
            _posixshmem.shm_unlink("/" + name)
        resource_tracker.unregister("/" + name, "shared_memory")
    return names
