"""The front end's other children, each owned by one async context manager that starts it,
supervises it (restarts it, on the same address, when it dies) and stops it:

- `coordinator_child`: the DP coordinator (more than one engine core);
- `kv_store_child`: the P/D KV store (--prefill-size/--decode-size), on an ipc:// socket in
  a fresh temporary folder;
- `registration_server`: not a process but a task, answering headless nodes' registrations
  (multi-node) for as long as the front end runs.
"""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing
import os
import shutil
import signal
import tempfile
import threading
import time
from collections.abc import AsyncIterator
from multiprocessing.process import BaseProcess

import msgspec

from kvserve.launch.supervisor import ChildStartError, describe_exit, stop_process, supervised
from kvserve.services.coordinator.coordinator import start_coordinator_process
from kvserve.services.coordinator.handshake import RegistrationServer, rpc_address
from kvserve.shared.config import EngineConfig, KVTransferConfig
from kvserve.shared.launch_options import DPLayout, KvStoreOptions, PDConfig
from kvserve.shared.logging import init_logger
from kvserve.shared.process_exit import exit_process
from kvserve.shared.shm_segments import unlink_segments
from kvserve.shared.transport import CoordinatorAddresses
from kvserve.shared.wire import EngineAssignment

logger = init_logger(__name__)


@contextlib.asynccontextmanager
async def coordinator_child(host: str | None) -> AsyncIterator[CoordinatorAddresses]:
    """The DP coordinator, on tcp:// ports of `host` (multi-node) or ipc:// sockets; yields
    the addresses it bound."""
    process, addresses = await asyncio.to_thread(
        start_coordinator_process,
        CoordinatorAddresses.tcp(host) if host else CoordinatorAddresses.local(),
    )
    processes: dict[str, BaseProcess] = {"coordinator": process}
    try:
        async with supervised(
            processes,
            lambda _: start_coordinator_process(addresses)[0],
            lambda _: "DP coordinator",
        ):
            yield addresses
    finally:
        await asyncio.to_thread(stop_process, processes["coordinator"], "the DP coordinator")


@contextlib.asynccontextmanager
async def registration_server(
    layout: DPLayout, assignment: EngineAssignment
) -> AsyncIterator[None]:
    """Answers the registrations of headless nodes (engines size_local..size-1) with
    `assignment`, for the block's length: a node that restarts, or comes late, joins again."""
    assert layout.address is not None and layout.rpc_port is not None  # layout.validate()
    server = RegistrationServer(
        rpc_address(layout.address, layout.rpc_port),
        set(range(layout.size_local, layout.size)),
        assignment,
    )
    task = asyncio.create_task(server.serve())
    try:
        yield
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


class KvStoreProcess:
    """The P/D KV store: a spawned `kvserve kv-store` on an ipc:// socket in a folder of its own.

    Supervised like the coordinator: a store that dies is started again on the same address
    (`respawn`), empty; the engines' clients connect to it afresh and recompute meanwhile.

    A respawned store keeps its disk tier (--kv-store-disk-path): the pinned blocks there
    outlive the restart.

    Args:
        pd: the P/D options: the store's size (--kv-store-size) and disk tier.
    """

    START_TIMEOUT_S = 60.0

    def __init__(self, pd: PDConfig):
        self.folder = tempfile.mkdtemp(prefix="kvserve-pd-")
        self.socket_path = os.path.join(self.folder, "kv-store")
        self.address = f"ipc://{self.socket_path}"
        self.options = pd.store_options(self.address)
        self.process = self._spawn()

    def _spawn(self) -> BaseProcess:
        process = multiprocessing.get_context("spawn").Process(
            target=_kv_store_main,
            name="KvStore",
            args=(self.options, os.getpid()),
        )
        process.start()
        logger.info(
            "started KV store process %s (pid %d) on %s", process.name, process.pid, self.address
        )
        return process

    def respawn(self) -> BaseProcess:
        """A new store on the same address, once the old one died (whose shared-memory
        segments, named after its pid, are unlinked: a killed store cannot)."""
        unlink_segments(f"kvserve-kv-*-{self.process.pid}")
        self.process = self._spawn()
        return self.process

    def wait_listening(self) -> None:
        """Until its socket exists (it binds before it serves); ChildStartError if it exits
        first or takes longer than START_TIMEOUT_S."""
        deadline = time.monotonic() + self.START_TIMEOUT_S
        while not os.path.exists(self.socket_path):
            if not self.process.is_alive():
                raise ChildStartError(
                    f"KV store process (pid {self.process.pid}) exited with "
                    f"{describe_exit(self.process.exitcode)} before it listened"
                )
            if time.monotonic() > deadline:
                raise ChildStartError(f"KV store not listening on {self.address} in time")
            time.sleep(0.05)

    def stop(self) -> None:
        """SIGTERM (it unlinks its shared memory), SIGKILL after STOP_TIMEOUT_S."""
        stop_process(self.process, "the KV store")
        shutil.rmtree(self.folder, ignore_errors=True)
        logger.info("KV store process exited with %s", describe_exit(self.process.exitcode))


def _kv_store_main(options: KvStoreOptions, parent_pid: int) -> None:
    from kvserve.services.kv_store.server import run_kv_store

    # Ctrl-C reaches the whole process group: the launcher stops the store after the
    # engines, which may still be saving blocks.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    threading.Thread(target=_stop_when_orphaned, args=(parent_pid,), daemon=True).start()
    exit_process(run_kv_store(options))


def _stop_when_orphaned(parent_pid: int) -> None:
    """SIGTERM this process once the launcher is gone (killed), so the store still unlinks
    its shared memory."""
    while os.getppid() == parent_pid:
        time.sleep(1.0)
    os.kill(os.getpid(), signal.SIGTERM)


@contextlib.asynccontextmanager
async def kv_store_child(pd: PDConfig) -> AsyncIterator[KvStoreProcess]:
    """The P/D KV store, listening (ChildStartError if it cannot), restarted while the block
    runs, stopped (its shared memory unlinked) on the way out: enter it before the engines,
    which may still be saving blocks while they stop."""
    store = KvStoreProcess(pd)
    try:
        await asyncio.to_thread(store.wait_listening)
        async with supervised(
            {"kv_store": store.process}, lambda _: store.respawn(), lambda _: "KV store"
        ):
            yield store
    finally:
        await asyncio.to_thread(store.stop)


def pd_engine_config(
    config: EngineConfig, pd: PDConfig, engine_index: int, store_address: str
) -> EngineConfig:
    """Engine `engine_index`'s config: a KvStoreConnector to the store, in its P/D role."""
    transfer = KVTransferConfig(
        kv_connector="KvStoreConnector",
        kv_role=pd.kv_role(engine_index),
        kv_connector_extra_config={"store_address": store_address},
    )
    return msgspec.structs.replace(config, kv_transfer_config=transfer)
