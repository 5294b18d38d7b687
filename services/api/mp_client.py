"""MPEngineClient: the api's client of an engine core in another process (zmq.asyncio).

    generate() ─ADD/ABORT/UTILITY─▶ ROUTER (bind) ══▶ engine DEALER ─▶ busy loop
    _handle_outputs ◀─ output task ◀─ PULL (bind) ◀══ engine PUSH ◀── outputs, heartbeats

Liveness, each of which fails every in-flight request with EngineDeadError:
  - a watched process (the engine core, its workers, when on this host) is gone;
  - the engine sent its DEAD sentinel;
  - nothing arrived for ENGINE_HEARTBEAT_TIMEOUT_S (the output thread beats every interval,
    whatever the busy loop does, so silence means the process is gone or frozen).
A loop that is alive but makes no progress while it has work (hung, or one step longer than
ENGINE_STALL_TIMEOUT_S) only turns /health to 503 while it lasts.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from typing import Any

import psutil
import zmq
import zmq.asyncio

from shared.env import ENGINE_HEARTBEAT_INTERVAL_S, ENGINE_HEARTBEAT_TIMEOUT_S, \
    ENGINE_READY_TIMEOUT_S, ENGINE_STALL_TIMEOUT_S
from shared.logging import init_logger
from shared.messages import EngineCoreRequest
from shared.transport import EngineAddresses, MessageDecoder, MessageEncoder, make_socket
from shared.wire import EngineHandshake, EngineHeartbeat, EngineStats, GetStats, MsgType, \
    Ping, ResetPrefixCache, UtilityCall, UtilityMethod, UtilityOutput, UtilityResult, \
    this_hostname
from services.api.engine_client import EngineClient, EngineDeadError
from services.api.tokenizer import TokenizerInfo

logger = init_logger(__name__)


class EngineStalledError(EngineDeadError):
    """The engine process is alive but its loop has made no progress with work queued."""


class EngineChannel:
    """The api's two bound sockets, opened before the engine starts so nothing it sends
    (READY, or DEAD when its start-up fails) can miss them.

    Args:
        addresses: where to bind (ipc:// paths, or tcp://*:port).
    """

    def __init__(self, addresses: EngineAddresses):
        self.addresses = addresses
        self.ctx = zmq.asyncio.Context()
        self.input_socket = make_socket(self.ctx, addresses.input_addr, zmq.ROUTER, bind=True)
        self.output_socket = make_socket(self.ctx, addresses.output_addr, zmq.PULL, bind=True)

    async def wait_ready(self, timeout_s: float, engine_process=None
                         ) -> tuple[bytes, EngineHandshake]:
        """The engine's identity and handshake; EngineDeadError if it dies first.

        Args:
            timeout_s: how long model load and KV profiling may take.
            engine_process: the engine's multiprocessing.Process, when it is our child.
        """
        ready_decoder = MessageDecoder((MsgType.READY,))
        output_decoder = MessageDecoder((MsgType.HEARTBEAT, MsgType.DEAD))
        poller = zmq.asyncio.Poller()
        poller.register(self.input_socket, zmq.POLLIN)
        poller.register(self.output_socket, zmq.POLLIN)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            events = dict(await poller.poll(timeout=200))
            if self.input_socket in events:
                identity, *frames = await self.input_socket.recv_multipart(copy=False)
                _, handshake = ready_decoder.decode(frames)
                return identity.bytes, handshake
            if self.output_socket in events:
                msg_type, payload = output_decoder.decode(
                    await self.output_socket.recv_multipart(copy=False))
                if msg_type == MsgType.DEAD:
                    raise EngineDeadError(f"engine core {payload.engine_index} failed to "
                                          f"start: {payload.reason}")
            if engine_process is not None and not engine_process.is_alive():
                raise EngineDeadError(f"engine core process {engine_process.name} (pid "
                                      f"{engine_process.pid}) exited with code "
                                      f"{engine_process.exitcode} before it was ready")
        raise EngineDeadError(f"no READY from the engine core within {timeout_s:.0f} s (raise "
                              f"{ENGINE_READY_TIMEOUT_S.name} for a slow model load)")

    def close(self) -> None:
        self.ctx.destroy(linger=0)
        self.addresses.remove_ipc_files()


class MPEngineClient(EngineClient):
    """Args:
        tokenizer_info: the model's tokenizer and stop ids.
        model_name: the name the API serves the model under.
        channel: the bound sockets; the engine has said READY on them.
        identity: the engine's DEALER identity (from `EngineChannel.wait_ready`).
        handshake: the engine's READY message.
        engine_process: the engine's multiprocessing.Process when it is our child (named in
            errors); otherwise the handshake's pids are watched when on this host.
    """

    def __init__(self, tokenizer_info: TokenizerInfo, model_name: str, channel: EngineChannel,
                 identity: bytes, handshake: EngineHandshake, engine_process=None):
        super().__init__(tokenizer_info, handshake.max_model_len, model_name)
        self.channel = channel
        self.identity = identity
        self.handshake = handshake
        self.heartbeat_interval_s = ENGINE_HEARTBEAT_INTERVAL_S.get()
        self.heartbeat_timeout_s = ENGINE_HEARTBEAT_TIMEOUT_S.get()
        self.stall_timeout_s = ENGINE_STALL_TIMEOUT_S.get()
        self.watched_processes = _processes_to_watch(handshake, engine_process)
        self._encoder = MessageEncoder()
        self._call_ids = itertools.count()
        self._utility_futures: dict[int, asyncio.Future] = {}
        self._dead_event = asyncio.Event()
        now = time.monotonic()
        self._last_message_time = now
        self._last_progress_time = now
        self._last_heartbeat: EngineHeartbeat | None = None
        self._tasks = [asyncio.create_task(self._process_outputs(), name="engine-outputs"),
                       asyncio.create_task(self._watch_liveness(), name="engine-liveness")]

    @classmethod
    async def connect(cls, channel: EngineChannel, tokenizer_info: TokenizerInfo,
                      model_name: str, engine_process=None,
                      ready_timeout_s: float | None = None) -> MPEngineClient:
        """Wait for the engine's READY on `channel`, then return a running client."""
        timeout_s = ready_timeout_s or ENGINE_READY_TIMEOUT_S.get()
        identity, handshake = await channel.wait_ready(timeout_s, engine_process)
        logger.info("engine core %d ready (pid %d on %s): %d KV blocks, max_model_len %d",
                    handshake.engine_index, handshake.pid, handshake.hostname,
                    handshake.num_blocks, handshake.max_model_len)
        return cls(tokenizer_info, model_name, channel, identity, handshake, engine_process)

    # ------------------------------------------------------------------ health

    @property
    def is_healthy(self) -> bool:
        return self.dead_reason is None and self.stall_reason is None

    @property
    def stall_reason(self) -> str | None:
        """Why the engine looks hung, or None while its loop advances (or has no work)."""
        stalled_s = time.monotonic() - self._last_progress_time
        if stalled_s <= self.stall_timeout_s:
            return None
        return (f"engine core {self.handshake.engine_index} made no progress for "
                f"{stalled_s:.0f} s with work queued (limit {self.stall_timeout_s:g} s)")

    async def check_health(self) -> None:
        """Raise EngineDeadError when dead, EngineStalledError while stalled."""
        if self.dead_reason is not None:
            raise EngineDeadError(self.dead_reason)
        reason = self.stall_reason
        if reason is not None:
            raise EngineStalledError(reason)

    async def wait_dead(self) -> str:
        """Return (the reason) once the engine is dead."""
        await self._dead_event.wait()
        return self.dead_reason

    def _fail_all(self, reason: str) -> None:
        if self.dead_reason is not None:
            return  # the first cause is the one worth reporting
        super()._fail_all(reason)
        for future in self._utility_futures.values():
            if not future.done():
                future.set_exception(EngineDeadError(reason))
        self._utility_futures.clear()
        self._dead_event.set()

    # ------------------------------------------------------------------ utilities

    async def call_utility(self, method: UtilityMethod, timeout_s: float | None = None
                           ) -> UtilityResult:
        """Run a utility in the engine's busy loop (between two steps) and return its result.

        Raises:
            RuntimeError: the utility failed in the engine (the engine lives on).
            EngineDeadError: the engine died before answering.
            TimeoutError: no answer within timeout_s.
        """
        call_id = next(self._call_ids)
        future = asyncio.get_running_loop().create_future()
        self._utility_futures[call_id] = future
        try:
            await self._send(MsgType.UTILITY, UtilityCall(call_id, method))
            return await asyncio.wait_for(future, timeout_s)
        finally:
            self._utility_futures.pop(call_id, None)

    async def reset_prefix_cache(self) -> bool:
        return await self.call_utility(ResetPrefixCache())

    async def get_stats(self) -> EngineStats:
        return await self.call_utility(GetStats())

    async def ping(self, timeout_s: float | None = None) -> EngineHeartbeat:
        """Answered by the busy loop itself: proves it is not stuck."""
        return await self.call_utility(Ping(), timeout_s)

    # ------------------------------------------------------------------ transport

    async def _send_requests(self, requests: list[EngineCoreRequest]) -> None:
        for request in requests:
            await self._send(MsgType.ADD, request)

    async def _send_abort(self, engine_request_ids: list[str]) -> None:
        if self.dead_reason is None:  # a dead engine holds nothing to abort
            await self._send(MsgType.ABORT, list(engine_request_ids))

    async def _send(self, msg_type: MsgType, payload: Any) -> None:
        if self.dead_reason is not None:
            raise EngineDeadError(self.dead_reason)
        frames = [self.identity, *self._encoder.encode(msg_type, payload)]
        try:
            await self.channel.input_socket.send_multipart(frames, copy=False)
        except zmq.ZMQError as exc:  # EHOSTUNREACH: the engine's DEALER is gone
            self._fail_all(f"engine core {self.handshake.engine_index} is unreachable: {exc}")
            raise EngineDeadError(self.dead_reason) from exc

    async def _process_outputs(self) -> None:
        decoder = MessageDecoder((MsgType.OUTPUTS, MsgType.UTILITY_OUTPUT, MsgType.HEARTBEAT,
                                  MsgType.DEAD))
        socket = self.channel.output_socket
        try:
            while self.dead_reason is None:
                msg_type, payload = decoder.decode(await socket.recv_multipart(copy=False))
                now = self._last_message_time = time.monotonic()
                if msg_type == MsgType.OUTPUTS:
                    self._last_progress_time = now
                    await self._handle_outputs(payload)
                elif msg_type == MsgType.UTILITY_OUTPUT:
                    self._last_progress_time = now
                    self._resolve_utility(payload)
                elif msg_type == MsgType.HEARTBEAT:
                    self._on_heartbeat(payload, now)
                else:
                    assert msg_type == MsgType.DEAD, msg_type
                    self._fail_all(f"engine core {payload.engine_index} died: "
                                   f"{payload.reason}")
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - fail the requests rather than hang them
            logger.exception("processing engine outputs failed")
            self._fail_all(f"processing engine outputs failed: {exc!r}")

    def _on_heartbeat(self, heartbeat: EngineHeartbeat, now: float) -> None:
        # An idle loop is not stuck: it has nothing to do.
        previous = self._last_heartbeat
        if heartbeat.idle or previous is None or (
                heartbeat.num_iterations != previous.num_iterations):
            self._last_progress_time = now
        self._last_heartbeat = heartbeat

    def _resolve_utility(self, output: UtilityOutput) -> None:
        future = self._utility_futures.pop(output.call_id, None)
        if future is None or future.done():
            return  # the caller timed out or went away
        if output.failure_message is not None:
            future.set_exception(RuntimeError(f"engine utility failed: "
                                              f"{output.failure_message}"))
        else:
            future.set_result(output.result)

    async def _watch_liveness(self) -> None:
        while self.dead_reason is None:
            await asyncio.sleep(self.heartbeat_interval_s)
            for name, process in self.watched_processes:
                if not _is_alive(process):
                    self._fail_all(f"{name} died")
                    return
            silence_s = time.monotonic() - self._last_message_time
            # Messages already waiting mean the engine spoke and this loop was busy.
            waiting = self.channel.output_socket.get(zmq.EVENTS) & zmq.POLLIN
            if silence_s > self.heartbeat_timeout_s and not waiting:
                self._fail_all(f"engine core {self.handshake.engine_index} sent nothing for "
                               f"{silence_s:.1f} s: its process is gone or frozen")

    async def shutdown(self) -> None:
        """Stop the background tasks and close the sockets (the engine process is the
        launcher's to stop)."""
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        # Whatever still waits fails now, and nothing is sent on the closed sockets.
        reason = "the api server is shutting down"
        if self.queues or self._utility_futures:
            self._fail_all(reason)
        elif self.dead_reason is None:
            self.dead_reason = reason
        self.channel.close()


def _processes_to_watch(handshake: EngineHandshake, engine_process
                        ) -> list[tuple[str, psutil.Process | None]]:
    """(name, process) of the engine core and its workers, when they run on this host."""
    if handshake.hostname != this_hostname():
        return []  # remote engine: heartbeats are all we have
    name = (f"engine core process {engine_process.name}" if engine_process is not None
            else f"engine core {handshake.engine_index} process")
    named_pids = [(f"{name} (pid {handshake.pid})", handshake.pid)]
    named_pids += [(f"worker process (pid {pid}) of engine core {handshake.engine_index}", pid)
                   for pid in handshake.worker_pids]
    watched = []
    for process_name, pid in named_pids:
        try:
            watched.append((process_name, psutil.Process(pid)))
        except psutil.NoSuchProcess:
            watched.append((process_name, None))  # died between READY and now
    return watched


def _is_alive(process: psutil.Process | None) -> bool:
    # is_running() also guards against pid reuse; a zombie has exited but is not reaped yet.
    try:
        return (process is not None and process.is_running()
                and process.status() != psutil.STATUS_ZOMBIE)
    except psutil.NoSuchProcess:
        return False
