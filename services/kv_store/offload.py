"""The CPU offload tier of one engine (`--kv-offloading-size GiB`): a `kvserve kv-store`
child process the engine core starts for itself, used through the OffloadingConnector.

Prefix blocks that the engine's cache evicts go to the store first, and a later prompt
with that prefix loads them back instead of recomputing. The store dies with the engine
(PR_SET_PDEATHSIG on Linux) and removes its shared memory on the way out.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import time

from kvserve.shared.config import KVTransferConfig
from kvserve.shared.logging import init_logger
from kvserve.shared.transport import private_ipc_folder

logger = init_logger(__name__)

_START_TIMEOUT_S = 60.0
_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:  # pragma: no cover - runs in the child before exec
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:
        pass


def start_offload_store(
    size_bytes: int, disk_path: str | None = None, disk_bytes: int = 0
) -> tuple[subprocess.Popen, KVTransferConfig]:
    """Start the store on a fresh ipc:// path in a private folder (the store removes both
    when it stops); returns it and the connector config.

    Args:
        size_bytes: its memory tier (--size).
        disk_path: its disk tier's folder (--disk-path), None for none; one store at a time
            may use a folder (the store locks it).
        disk_bytes: the disk tier's budget (--disk-bytes).
    """
    path = os.path.join(private_ipc_folder(), "offload-store")
    address = f"ipc://{path}"
    command = [sys.executable, "-m", "kvserve.cli", "kv-store"]
    command += ["--address", address, "--size", str(size_bytes)]
    if disk_path is not None:
        command += ["--disk-path", disk_path, "--disk-bytes", str(disk_bytes)]
    process = subprocess.Popen(command, preexec_fn=_die_with_parent)
    deadline = time.monotonic() + _START_TIMEOUT_S
    while not os.path.exists(path):
        if process.poll() is not None:
            raise RuntimeError(f"the offload KV store exited at start-up ({process.returncode})")
        if time.monotonic() > deadline:
            process.kill()
            raise RuntimeError(f"the offload KV store did not bind {address}")
        time.sleep(0.05)
    logger.info(
        "KV offload tier: store pid %d at %s, %d bytes, disk tier %s",
        process.pid,
        address,
        size_bytes,
        disk_path or "none",
    )
    config = KVTransferConfig(
        kv_connector="OffloadingConnector",
        kv_role="kv_both",
        kv_connector_extra_config={"store_address": address},
    )
    return process, config


def stop_offload_store(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
