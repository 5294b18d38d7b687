"""The memory allocator of the computing processes (engine cores, their workers) on a CPU host.

A CPU step allocates its activations fresh: a [2048, 3072] float32 GEMM output is 25 MB, and a
2,048-token step of the default model asks for ~1.5 GB over its 30 layers. torch takes them
64-byte aligned (posix_memalign), and glibc's memalign cannot reuse a freed chunk of the same
size (it asks for size + alignment + a minimum), so the heap grows and every step touches
fresh pages: measured with bench/mixed_step_profile.py (float32, a Sapphire Rapids VM), up to
160k page faults and 1.9 -> 3.2 s per mixed step. tcmalloc keeps freed spans per size and
serves them again; vLLM-CPU's docs have its users preload it. Here the launcher does it for
the processes it spawns, where the system has the library (Debian: libtcmalloc-minimal4).
"""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import MutableMapping, Sequence

from kvserve.shared.env import PRELOAD_ALLOCATOR
from kvserve.shared.logging import init_logger

logger = init_logger(__name__)

# In the order tried: tcmalloc (what vLLM-CPU uses), then jemalloc.
LIBRARIES = ("libtcmalloc_minimal.so.4", "libtcmalloc.so.4", "libjemalloc.so.2")
SEARCH_DIRS = (
    "/usr/lib/x86_64-linux-gnu",
    "/usr/lib/aarch64-linux-gnu",
    "/usr/lib64",
    "/usr/lib",
    "/usr/local/lib",
)
# Where a GPU serves, its processes keep glibc's malloc (the measurement above is the CPU's).
NVIDIA_DEVICE = "/dev/nvidiactl"


def find_allocator(search_dirs: Sequence[str] | None = None) -> str | None:
    """The first of LIBRARIES found in search_dirs (default SEARCH_DIRS): a path, or None."""
    for name in LIBRARIES:
        for folder in SEARCH_DIRS if search_dirs is None else search_dirs:
            path = os.path.join(folder, name)
            if os.path.isfile(path):
                return path
    return None


def preload_allocator(
    environ: MutableMapping[str, str] = os.environ,
    search_dirs: Sequence[str] | None = None,
    nvidia_device: str = NVIDIA_DEVICE,
) -> str:
    """Put tcmalloc (or jemalloc) first in environ's LD_PRELOAD, which the processes spawned
    after it inherit, and say what the computing processes will allocate with. Idempotent."""
    preload = environ.get("LD_PRELOAD", "")
    named = [p for p in preload.replace(":", " ").split() if "malloc" in os.path.basename(p)]
    if named:
        return f"{named[0]} (LD_PRELOAD already names it)"
    if not PRELOAD_ALLOCATOR.get():
        return "glibc malloc (KVSERVE_PRELOAD_ALLOCATOR=0)"
    if os.path.exists(nvidia_device):
        return f"glibc malloc (a GPU host: {nvidia_device} exists)"
    path = find_allocator(search_dirs)
    if path is None:
        return (
            "glibc malloc: no tcmalloc or jemalloc on this system; with it (Debian: apt-get "
            "install libtcmalloc-minimal4) CPU steps that allocate large activations fault "
            "fewer fresh pages in"
        )
    environ["LD_PRELOAD"] = f"{path}:{preload}" if preload else path
    return f"{path} (LD_PRELOAD of the engine and worker processes)"


@functools.cache
def log_allocator() -> str:
    """preload_allocator on this process's environment, once per process, logged."""
    choice = preload_allocator()
    logger.info("memory allocator of the engine processes: %s", choice)
    return choice


def reexec_with_allocator() -> None:
    """For a command that runs its engine in its own process (`kvserve bench throughput`):
    where preload_allocator adds a library, replace this process with itself under it (the
    same interpreter and arguments, `sys.orig_argv`); else return. The re-executed process
    finds the library named in LD_PRELOAD and goes on."""
    before = os.environ.get("LD_PRELOAD")
    choice = preload_allocator()
    if os.environ.get("LD_PRELOAD") == before:
        logger.info("memory allocator: %s", choice)
        return
    logger.info("memory allocator: %s; restarting this command under it", choice)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(sys.executable, sys.orig_argv)
