"""The DP coordinator process: collects every engine core's load, publishes the load table.

    engine core 0 ─PUSH─┐                          ┌─SUB─▶ api server (DP router)
    engine core 1 ─PUSH─┼─▶ PULL stats_addr ─ table ─ PUB publish_addr
    engine core N ─PUSH─┘                          └─SUB─▶ (more api servers)

Engines report (waiting, running) when it changes (throttled) and at least every heartbeat
interval. The table goes out at most every PUBLISH_INTERVAL_S while it changes, and every
KEEPALIVE_S regardless, so a subscriber that joins late, or lost a message to PUB/SUB's
slow-joiner window, is current within a second. An engine silent for the heartbeat timeout
drops out of the table (vLLM's DPCoordinator is the model; it also runs MoE waves, we do not).
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import time
from multiprocessing.process import BaseProcess

import msgspec
import zmq

from kvserve.services.coordinator.load_table import EngineLoadTable
from kvserve.shared.env import ENGINE_HEARTBEAT_TIMEOUT_S
from kvserve.shared.logging import init_logger
from kvserve.shared.transport import CoordinatorAddresses, bound_address, make_socket
from kvserve.shared.wire import EngineLoad, LoadTable

logger = init_logger(__name__)

PUBLISH_INTERVAL_S = 0.1  # the table goes out at most this often while it changes
KEEPALIVE_S = 1.0  # ... and at least this often
_START_TIMEOUT_S = 60.0  # a spawned coordinator binds its sockets within this


class DPCoordinator:
    """The coordinator's sockets and table; `run` loops until SIGTERM.

    Args:
        addresses: where to bind (tcp://host:* picks free ports: see `addresses` after).
        stale_after_s: an engine silent this long leaves the table.
    """

    def __init__(self, addresses: CoordinatorAddresses, stale_after_s: float):
        self._ctx = zmq.Context()
        self._stats_socket = make_socket(self._ctx, addresses.stats_addr, zmq.PULL, bind=True)
        self._publish_socket = make_socket(self._ctx, addresses.publish_addr, zmq.PUB, bind=True)
        self.addresses = CoordinatorAddresses(
            bound_address(self._stats_socket), bound_address(self._publish_socket)
        )
        self.table = EngineLoadTable(stale_after_s)
        self._load_decoder = msgspec.msgpack.Decoder(EngineLoad)
        self._encoder = msgspec.msgpack.Encoder()

    def run(self, parent_pid: int | None = None) -> None:
        """Receive loads and publish the table, forever (SystemExit ends it)."""
        last_publish_time = 0.0
        while True:
            now = time.monotonic()
            wait_s = (PUBLISH_INTERVAL_S if self.table.changed else KEEPALIVE_S) - (
                now - last_publish_time
            )
            if self._stats_socket.poll(max(int(wait_s * 1000), 0) + 1):
                self._receive_loads()
            now = time.monotonic()
            for engine_index in self.table.drop_stale(now):
                logger.warning(
                    "engine core %d sent no load for %.1f s; dropped from the load table",
                    engine_index,
                    self.table.stale_after_s,
                )
            since_publish_s = now - last_publish_time
            if (
                self.table.changed
                and since_publish_s >= PUBLISH_INTERVAL_S
                or since_publish_s >= KEEPALIVE_S
            ):
                self._publish(now)
                last_publish_time = now
            if parent_pid is not None and os.getppid() != parent_pid:
                logger.error("parent process %d is gone; shutting down", parent_pid)
                return

    def _receive_loads(self) -> None:
        now = time.monotonic()
        while True:
            try:
                frame = self._stats_socket.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                load = self._load_decoder.decode(frame)
            except msgspec.DecodeError as exc:  # a stray peer must not stop the table
                logger.error("dropped a malformed load report: %s", exc)
                continue
            if load.engine_index not in self.table:
                logger.info("engine core %d joined the load table", load.engine_index)
            self.table.update(load, now)

    def _publish(self, now: float) -> None:
        self._publish_socket.send(
            self._encoder.encode(LoadTable(self.table.snapshot(), time.time()))
        )
        self.table.changed = False

    def close(self) -> None:
        self._ctx.destroy(linger=0)
        self.addresses.remove_ipc_files()


def run_coordinator(
    addresses: CoordinatorAddresses, ready_conn=None, watch_parent: bool = False
) -> int:
    """The coordinator process's body: bind, report the bound addresses, loop until SIGTERM.

    Args:
        addresses: where to bind.
        ready_conn: a multiprocessing Connection that receives the bound addresses.
        watch_parent: exit when the launching process dies (a child of `kvserve serve`).
    """

    def _exit(signum, frame):
        raise SystemExit(0)

    signal.signal(signal.SIGTERM, _exit)
    signal.signal(signal.SIGINT, signal.SIG_IGN if watch_parent else _exit)
    coordinator = DPCoordinator(addresses, ENGINE_HEARTBEAT_TIMEOUT_S.get())
    logger.info(
        "DP coordinator collects loads on %s, publishes on %s",
        coordinator.addresses.stats_addr,
        coordinator.addresses.publish_addr,
    )
    if ready_conn is not None:
        ready_conn.send(coordinator.addresses)
        ready_conn.close()
    try:
        coordinator.run(parent_pid=os.getppid() if watch_parent else None)
    except SystemExit:
        logger.info("DP coordinator shutting down")
    finally:
        coordinator.close()
    return 0


def start_coordinator_process(
    addresses: CoordinatorAddresses,
) -> tuple[BaseProcess, CoordinatorAddresses]:
    """Spawn the coordinator (no torch in it); returns it and the addresses it bound."""
    spawn = multiprocessing.get_context("spawn")
    parent_conn, child_conn = spawn.Pipe(duplex=False)
    process = spawn.Process(
        target=_coordinator_main, name="DPCoordinator", args=(addresses, child_conn), daemon=True
    )
    process.start()
    child_conn.close()
    if not parent_conn.poll(_START_TIMEOUT_S):
        process.kill()
        raise RuntimeError(
            f"the DP coordinator did not bind {addresses} within "
            f"{_START_TIMEOUT_S:.0f} s (exit code {process.exitcode})"
        )
    try:
        bound = parent_conn.recv()
    except EOFError:
        process.join(5)
        raise RuntimeError(
            f"the DP coordinator failed to bind {addresses} (exit code "
            f"{process.exitcode}); see its log above"
        ) from None
    logger.info("started DP coordinator process (pid %d)", process.pid)
    return process, bound


def _coordinator_main(addresses: CoordinatorAddresses, ready_conn) -> None:
    raise SystemExit(run_coordinator(addresses, ready_conn, watch_parent=True))
