"""The api's side of the engine sockets: EngineChannel (the two bound sockets, and the READY
wait) and EngineConnection (what the api knows about one engine core behind them).

Its identity (the DEALER routing id), its READY handshake, the processes to watch when it
runs on this host, when it last spoke and advanced, whether its silence makes it suspect
(and what its engine-core process did meanwhile: SilenceWatch), its latest stats, and the
requests it holds, so that its death fails exactly those.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any

import psutil
import zmq
import zmq.asyncio

from kvserve.services.api.engine_client.client import EngineDeadError, StatsTotals
from kvserve.shared.env import ENGINE_HEARTBEAT_INTERVAL_S, ENGINE_READY_TIMEOUT_S
from kvserve.shared.logging import init_logger
from kvserve.shared.messages import SchedulerStats
from kvserve.shared.progress import ProcessProgress, SilenceWatch
from kvserve.shared.transport import (
    EngineAddresses,
    MessageDecoder,
    MessageEncoder,
    bound_address,
    make_socket,
)
from kvserve.shared.wire import EngineHeartbeat, EngineReady, MsgType, this_hostname

logger = init_logger(__name__)


class EngineChannel:
    """The api's two bound sockets, opened before the engines start so nothing they send
    (READY, or DEAD when start-up fails) can miss them.

    Args:
        addresses: where to bind (ipc:// paths, tcp://*:port, or tcp://host:* for ports the
            OS picks; `self.addresses` holds the bound ones).
    """

    def __init__(self, addresses: EngineAddresses):
        self.ctx = zmq.asyncio.Context()
        self.input_socket = make_socket(self.ctx, addresses.input_addr, zmq.ROUTER, bind=True)
        # A restarted engine core connects with its predecessor's identity: the new
        # connection takes the identity over (a frozen predecessor may still hold it).
        self.input_socket.setsockopt(zmq.ROUTER_HANDOVER, 1)
        self.output_socket = make_socket(self.ctx, addresses.output_addr, zmq.PULL, bind=True)
        self.addresses = EngineAddresses(
            bound_address(self.input_socket), bound_address(self.output_socket)
        )

    async def wait_ready(self, timeout_s: float, engine_process=None) -> tuple[bytes, EngineReady]:
        """The engine's identity and handshake; EngineDeadError if it dies first.

        Args:
            timeout_s: how long model load and KV profiling may take.
            engine_process: the engine's multiprocessing.Process, when it is our child.
        """
        processes = {0: engine_process} if engine_process is not None else {}
        ready = await self.wait_all_ready(1, timeout_s, processes)
        return next(iter(ready.values()))

    async def wait_all_ready(
        self, num_engines: int, timeout_s: float, engine_processes: dict[int, Any] | None = None
    ) -> dict[int, tuple[bytes, EngineReady]]:
        """(identity, handshake) of num_engines engines by index; EngineDeadError if one of
        them dies (or says DEAD) first.

        Args:
            num_engines: how many READY messages to wait for.
            timeout_s: how long model load and KV profiling may take.
            engine_processes: engine index -> multiprocessing.Process, for our children.
        """
        ready_decoder = MessageDecoder((MsgType.READY,))
        output_decoder = MessageDecoder((MsgType.HEARTBEAT, MsgType.DEAD))
        poller = zmq.asyncio.Poller()
        poller.register(self.input_socket, zmq.POLLIN)
        poller.register(self.output_socket, zmq.POLLIN)
        ready: dict[int, tuple[bytes, EngineReady]] = {}
        deadline = time.monotonic() + timeout_s
        # The engines that are READY hear from us while the others load (headless ones
        # stop after KVSERVE_FRONTEND_TIMEOUT_S of silence).
        heartbeat = MessageEncoder().encode(MsgType.FRONTEND_HEARTBEAT, None)
        interval_s = ENGINE_HEARTBEAT_INTERVAL_S.get()
        next_heartbeat = time.monotonic() + interval_s
        while time.monotonic() < deadline:
            if time.monotonic() >= next_heartbeat:
                next_heartbeat = time.monotonic() + interval_s
                for peer, _ in ready.values():
                    with contextlib.suppress(zmq.ZMQError):  # gone: its death shows below
                        await self.input_socket.send_multipart([peer, *heartbeat])
            events = dict(await poller.poll(timeout=200))
            if self.input_socket in events:
                identity, *frames = await self.input_socket.recv_multipart(copy=False)
                _, handshake = ready_decoder.decode(frames)
                ready[handshake.engine_index] = (identity.bytes, handshake)
                if len(ready) == num_engines:
                    return ready
            if self.output_socket in events:
                msg_type, payload = output_decoder.decode(
                    await self.output_socket.recv_multipart(copy=False)
                )
                if msg_type == MsgType.DEAD:
                    raise EngineDeadError(
                        f"engine core {payload.engine_index} failed to start: {payload.reason}"
                    )
            for process in (engine_processes or {}).values():
                if not process.is_alive():
                    raise EngineDeadError(
                        f"engine core process {process.name} (pid "
                        f"{process.pid}) exited with code "
                        f"{process.exitcode} before it was ready"
                    )
        missing = sorted(set(range(num_engines)) - set(ready))
        raise EngineDeadError(
            f"no READY from engine cores {missing} within {timeout_s:.0f} s "
            f"(raise {ENGINE_READY_TIMEOUT_S.name} for a slow model load)"
        )

    async def connect_engines(
        self, num_engines: int, timeout_s: float, engine_processes: dict[int, Any]
    ) -> list[EngineConnection]:
        """One EngineConnection per engine 0..num_engines-1, by index, once each said READY
        (see wait_all_ready)."""
        ready = await self.wait_all_ready(num_engines, timeout_s, engine_processes)
        engines = []
        for engine_index in sorted(ready):
            identity, handshake = ready[engine_index]
            logger.info(
                "engine core %d ready (pid %d on %s): %d KV blocks, max_model_len %d%s",
                engine_index,
                handshake.pid,
                handshake.hostname,
                handshake.num_blocks,
                handshake.max_model_len,
                f", {handshake.kv_role}" if handshake.kv_role else "",
            )
            process = engine_processes.get(engine_index)
            engines.append(EngineConnection(identity, handshake, process))
        return engines

    def close(self) -> None:
        self.ctx.destroy(linger=0)
        self.addresses.remove_ipc_files()


class EngineConnection:
    """
    Args:
        identity: the engine's DEALER identity.
        handshake: its READY message.
        engine_process: its multiprocessing.Process when it is our child (named in errors);
            otherwise the handshake's pids are watched when on this host.
    """

    def __init__(self, identity: bytes, handshake: EngineReady, engine_process=None):
        self.identity = identity
        self.handshake = handshake
        self.engine_index = handshake.engine_index
        self.engine_process = engine_process
        self.watched_processes = _processes_to_watch(handshake, engine_process)
        now = time.monotonic()
        self.last_message_time = now
        self.last_progress_time = now
        self.last_heartbeat: EngineHeartbeat | None = None
        # Its engine-core process on this host: a silent engine whose process uses CPU time,
        # or waits for it, is slow or starved, not hung (EngineLiveness). That process only:
        # it is the one that beats, and its workers poll their ring and beat whatever it
        # does, so their CPU time would keep a stopped engine core "slow" forever (their own
        # hangs are its executor's to find).
        self.silence = SilenceWatch(
            [ProcessProgress(p.pid) for _, p in self.watched_processes[:1] if p is not None], now
        )
        self.suspect_reason: str | None = None  # set by EngineLiveness while it is silent
        self.dead_reason: str | None = None
        self.latest_stats: SchedulerStats | None = None
        self.stats_totals = StatsTotals()
        # Tokens it sent back (moved requests' included): /health shows it, so a fault test
        # can act mid-stream from the server's own count rather than from its client's reads.
        self.num_generated_tokens = 0
        self.request_ids: set[str] = set()  # api request ids in flight here

    @property
    def is_alive(self) -> bool:
        return self.dead_reason is None

    @property
    def is_suspect(self) -> bool:
        """Silent past the heartbeat timeout, not yet declared hung: it gets no new requests
        while another engine serves, and keeps its running ones."""
        return self.suspect_reason is not None and self.dead_reason is None

    def stall_reason(self, stall_timeout_s: float) -> str | None:
        """Why the engine looks hung, or None while its loop advances (or has no work)."""
        stalled_s = time.monotonic() - self.last_progress_time
        if stalled_s <= stall_timeout_s:
            return None
        return (
            f"engine core {self.engine_index} made no progress for {stalled_s:.0f} s "
            f"with work queued (limit {stall_timeout_s:g} s)"
        )

    def state(self, stall_timeout_s: float) -> str:
        """serving, suspect, stalled or dead (for /health)."""
        if self.dead_reason is not None:
            return "dead"
        if self.suspect_reason is not None:
            return "suspect"  # silent: its loop cannot be judged
        return "serving" if self.stall_reason(stall_timeout_s) is None else "stalled"

    def on_message(
        self, now: float, progress: bool, heartbeat: EngineHeartbeat | None = None
    ) -> None:
        """It spoke: a silence is over, and a suspect engine serves again.

        Args:
            progress: its loop advanced (or has nothing to do).
            heartbeat: the message, when a heartbeat (what it did while silent, for the log).
        """
        silent_s = now - self.last_message_time
        self.last_message_time = now
        self.silence.heard(now)
        if progress:
            self.last_progress_time = now
        if self.suspect_reason is not None and self.dead_reason is None:
            self.suspect_reason = None
            logger.warning(
                "engine core %d is healthy again: it spoke after %.1f s of silence%s",
                self.engine_index,
                silent_s,
                _meanwhile(self.last_heartbeat, heartbeat),
            )

    def on_heartbeat(self, heartbeat: EngineHeartbeat, now: float) -> None:
        # An idle loop is not stuck: it has nothing to do.
        previous = self.last_heartbeat
        progress = (
            heartbeat.idle
            or previous is None
            or (heartbeat.num_iterations != previous.num_iterations)
        )
        self.on_message(now, progress, heartbeat)
        self.last_heartbeat = heartbeat

    def on_stats(self, stats: SchedulerStats) -> None:
        self.latest_stats = stats
        self.stats_totals.add(stats)

    def kill_local_processes(self) -> None:
        """SIGKILL the engine core's processes on this host (a hung engine, declared dead)."""
        for name, process in self.watched_processes:
            if process is None:
                continue
            try:
                process.kill()
                logger.warning("killed %s: its engine core was declared hung", name)
            except psutil.Error:
                pass  # gone already

    def find_dead_process(self) -> str | None:
        """The name of a watched process (the engine or one of its workers) that is gone."""
        for name, process in self.watched_processes:
            if not _is_alive(process):
                return name
        return None

    def describe(self, stall_timeout_s: float) -> dict:
        """One engine's entry in /health's body."""
        stats = self.latest_stats
        entry = {
            "engine": self.engine_index,
            "state": self.state(stall_timeout_s),
            "hostname": self.handshake.hostname,
            "pid": self.handshake.pid,
            "num_running": stats.num_running_reqs if stats else 0,
            "num_waiting": stats.num_waiting_reqs if stats else 0,
            "num_generated_tokens": self.num_generated_tokens,
        }
        reason = self.dead_reason or self.suspect_reason or self.stall_reason(stall_timeout_s)
        if reason is not None:
            entry["reason"] = reason
        return entry


def _processes_to_watch(
    handshake: EngineReady, engine_process
) -> list[tuple[str, psutil.Process | None]]:
    """(name, process) of the engine core, then its workers, when they run on this host."""
    if handshake.hostname != this_hostname():
        return []  # remote engine: heartbeats are all we have
    name = (
        f"engine core process {engine_process.name}"
        if engine_process is not None
        else f"engine core {handshake.engine_index} process"
    )
    named_pids = [(f"{name} (pid {handshake.pid})", handshake.pid)]
    named_pids += [
        (f"worker process (pid {pid}) of engine core {handshake.engine_index}", pid)
        for pid in handshake.worker_pids
    ]
    watched = []
    for process_name, pid in named_pids:
        try:
            watched.append((process_name, psutil.Process(pid)))
        except psutil.NoSuchProcess:
            watched.append((process_name, None))  # died between READY and now
    return watched


def _meanwhile(before: EngineHeartbeat | None, after: EngineHeartbeat | None) -> str:
    """What the engine process did between two of its heartbeats, as its host measured it."""
    if before is None or after is None or not after.cpu_ns or after.cpu_ns < before.cpu_ns:
        return ""  # no heartbeat to compare, or a peer that does not measure
    cpu_s = (after.cpu_ns - before.cpu_ns) / 1e9
    wait_s = (after.wait_ns - before.wait_ns) / 1e9
    return f" (meanwhile it used {cpu_s:.2f} s of CPU and waited {wait_s:.2f} s for one)"


def _is_alive(process: psutil.Process | None) -> bool:
    # is_running() also guards against pid reuse; a zombie has exited but is not reaped yet.
    try:
        return (
            process is not None
            and process.is_running()
            and process.status() != psutil.STATUS_ZOMBIE
        )
    except psutil.NoSuchProcess:
        return False
