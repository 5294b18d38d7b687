"""EngineLiveness: which engine cores are gone, which are only slow, and which come back.

Liveness (`watch`, a task, every heartbeat interval). Each of these drops one engine and
fails the requests it holds with EngineDeadError naming it:
  - a watched process (the engine core, its workers, when on this host) is gone: known at
    once, from the process itself;
  - the engine sent its DEAD sentinel (seen by the client's output loop);
  - it is hung: silent, and no progress for ENGINE_HUNG_TIMEOUT_S (below).
Silence alone is not death. The output thread beats every interval whatever the busy loop does,
but a busy host (load above the cores, a cgroup CPU quota, memory reclaim) can keep a live
engine from beating for seconds. So an engine that sent nothing for ENGINE_HEARTBEAT_TIMEOUT_S
is only *suspect*: it gets no new requests while another engine serves (while none does, it
still queues them, logged), keeps its running ones, and /health shows it "suspect" with the
reason; its next message clears that. It is hung once it made no progress for
ENGINE_HUNG_TIMEOUT_S: for an engine on this host, neither its engine-core process's CPU time
nor its run-queue wait grew (shared/progress.py: a stopped or blocked process shows neither; a
slow one shows CPU time, a starved one waits for a CPU). Its workers' CPU time does not count:
they poll and beat whatever the engine core does (a stopped engine core with mp workers would
never be hung), and a stopped or blocked worker is its executor's to find (MpExecutor fails the
engine core, which then dies as any does). For an engine on another host, nothing but its
silence can be known, so silence for the whole budget is hung. A hung engine on this host is
then killed (SIGKILL, the engine core and its workers): it cannot wake up and act on requests
that moved meanwhile, and --restart-dead-engines starts it again.
Engines that are not the api's children watch it in turn: it sends every engine a
FRONTEND_HEARTBEAT every interval, and they shut down after KVSERVE_FRONTEND_TIMEOUT_S
without a word from it.

Readmission (`receive_readmissions`, a task): an engine core that says READY after start-up
(restarted by the launcher or by compose, or a headless node that rejoined) takes its index
back: the ROUTER hands its identity over to the new connection, a live predecessor is
dropped first (its requests fail), and the new one gets requests as soon as it is admitted.
A READY that does not fit (an index outside the deployment, another block size or hash, a
shorter max_model_len, another KV role) is refused and logged.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any, cast

import msgspec
import zmq

from kvserve.services.api.engine_client.client import EngineDeadError
from kvserve.services.api.engine_client.connection import EngineConnection
from kvserve.services.api.engine_client.dp_router import DPRouter
from kvserve.services.api.engine_client.pool import EnginePool
from kvserve.shared.env import ENGINE_HEARTBEAT_TIMEOUT_S, ENGINE_HUNG_TIMEOUT_S
from kvserve.shared.logging import init_logger
from kvserve.shared.transport import MessageDecoder
from kvserve.shared.wire import EngineReady, MsgType

logger = init_logger(__name__)

# engine_died(engine, reason, replaced): drop one engine (the client's death handling).
EngineDied = Callable[..., None]


class EngineLiveness:
    """
    Args:
        pool: the engines.
        router: the DP router, which takes a readmitted engine back.
        engine_died: drops one engine: `engine_died(engine, reason, replaced=False)`.
        max_model_len: the context the api admits requests for (a newcomer must fit it).
        engine_processes: engine index -> process, for the engines that are our children
            (the launcher replaces an entry when it restarts that engine).
        heartbeat_interval_s: how often to look, and to send FRONTEND_HEARTBEATs.
        heartbeat_timeout_s: the silence after which an engine is suspect.
        hung_timeout_s: how long a silent engine may make no progress before it is hung
            (at least heartbeat_timeout_s; None: KVSERVE_ENGINE_HUNG_TIMEOUT_S).
    """

    def __init__(
        self,
        pool: EnginePool,
        router: DPRouter,
        engine_died: EngineDied,
        max_model_len: int,
        engine_processes: dict[int, Any],
        heartbeat_interval_s: float,
        heartbeat_timeout_s: float,
        hung_timeout_s: float | None = None,
    ):
        hung_timeout_s = ENGINE_HUNG_TIMEOUT_S.get() if hung_timeout_s is None else hung_timeout_s
        if hung_timeout_s < heartbeat_timeout_s:
            raise ValueError(
                f"{ENGINE_HUNG_TIMEOUT_S.name}={hung_timeout_s:g} is shorter than "
                f"{ENGINE_HEARTBEAT_TIMEOUT_S.name}={heartbeat_timeout_s:g}: an engine is "
                f"declared hung only after its silence made it suspect; raise the first"
            )
        self.pool = pool
        self.router = router
        self.engine_died = engine_died
        self.max_model_len = max_model_len
        self.engine_processes = engine_processes
        self.heartbeat_interval_s = heartbeat_interval_s
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.hung_timeout_s = hung_timeout_s
        self.num_readmissions = 0

    # ------------------------------------------------------------------ liveness

    async def watch(self) -> None:
        """Every interval: drop the engines whose processes are gone or that hung; mark
        the silent ones suspect."""
        while self.pool.closed_reason() is None:
            await asyncio.sleep(self.heartbeat_interval_s)
            # Messages already waiting mean the engines spoke and this loop was busy.
            events = cast(int, self.pool.channel.output_socket.get(zmq.EVENTS))
            waiting = bool(events & zmq.POLLIN)
            now = time.monotonic()
            for engine in list(self.pool.engines.values()):
                if engine.is_alive:
                    await self._check(engine, now, waiting)

    async def _check(self, engine: EngineConnection, now: float, messages_waiting: bool) -> None:
        dead_process = engine.find_dead_process()
        if dead_process is not None:
            self.engine_died(engine, f"{dead_process} died")
            return
        try:  # engines that are not our children watch for these
            await self.pool.send(engine, MsgType.FRONTEND_HEARTBEAT, None)
        except EngineDeadError:
            return
        if messages_waiting:
            return
        silence = engine.silence
        silent_s = silence.silent_s(now)
        if silent_s > self.heartbeat_interval_s:
            # A heartbeat is late: a look every check from now on, so that the window
            # without progress opens with the silence (and costs nothing while it beats).
            silence.look(now)
        if silent_s <= self.heartbeat_timeout_s:
            return
        if silence.is_hung(now, self.hung_timeout_s):
            self.engine_died(engine, self._hung_reason(engine, now))
            engine.kill_local_processes()
            return
        reason = (
            f"engine core {engine.engine_index} sent nothing for {silent_s:.1f} s (limit "
            f"{self.heartbeat_timeout_s:g} s, {ENGINE_HEARTBEAT_TIMEOUT_S.name}): suspect, "
            f"no new requests while another engine serves"
        )
        if silence.finding:
            reason += f"; {silence.finding}"
        if engine.suspect_reason is None:
            logger.warning(
                "%s; declared hung after %g s without progress (%s)",
                reason,
                self.hung_timeout_s,
                ENGINE_HUNG_TIMEOUT_S.name,
            )
        engine.suspect_reason = reason

    def _hung_reason(self, engine: EngineConnection, now: float) -> str:
        silence = engine.silence
        budget = f"{self.hung_timeout_s:g} s, {ENGINE_HUNG_TIMEOUT_S.name}"
        if not silence.processes:
            return (
                f"engine core {engine.engine_index} on {engine.handshake.hostname} sent "
                f"nothing for {silence.silent_s(now):.1f} s (hung budget {budget}): it is "
                f"gone or hung"
            )
        return (
            f"engine core {engine.engine_index} sent nothing for {silence.silent_s(now):.1f} s "
            f"and its process used no CPU time and waited for none for "
            f"{silence.quiet_s(now):.1f} s (hung budget {budget}): it is hung (stopped or "
            f"blocked)"
        )

    # ------------------------------------------------------------------ readmission

    async def receive_readmissions(self) -> None:
        """Admit every engine core that says READY on the input socket after start-up."""
        decoder = MessageDecoder((MsgType.READY,))
        socket = self.pool.channel.input_socket
        while True:
            identity, *frames = await socket.recv_multipart(copy=False)
            try:
                _, handshake = decoder.decode(frames)
            except (ValueError, msgspec.ValidationError) as exc:
                logger.error("dropped a malformed message on the engine input socket: %s", exc)
                continue
            self.admit(identity.bytes, handshake)

    def admit(self, identity: bytes, handshake: EngineReady) -> None:
        """Let the process that said READY take its engine index, unless it does not fit."""
        index = handshake.engine_index
        refusal = self._admission_refusal(handshake)
        if refusal is not None:
            self._refuse(handshake, refusal)
            return
        previous = self.pool.engines[index]
        if previous.is_alive:
            self.engine_died(
                previous,
                f"engine core {index} was replaced by a new process (pid {handshake.pid} "
                f"on {handshake.hostname})",
                replaced=True,
            )
        self.pool.replace(EngineConnection(identity, handshake, self.engine_processes.get(index)))
        self.router.add_engine(index, handshake.num_blocks, handshake.kv_role)
        self.num_readmissions += 1
        logger.info(
            "engine core %d readmitted (pid %d on %s): %d KV blocks; %d of %d engine cores serve",
            index,
            handshake.pid,
            handshake.hostname,
            handshake.num_blocks,
            len(self.pool.live_ids(self.pool.engines)),
            len(self.pool.engines),
        )

    def _refuse(self, handshake: EngineReady, refusal: str) -> None:
        index = handshake.engine_index
        logger.error(
            "refused engine core %d (pid %d on %s): %s",
            index,
            handshake.pid,
            handshake.hostname,
            refusal,
        )
        previous = self.pool.engines.get(index)
        if previous is not None and previous.is_alive:
            # Its identity is the newcomer's now (ROUTER_HANDOVER): it is unreachable.
            self.engine_died(
                previous,
                f"engine core {index} lost its connection to a process that was refused "
                f"(pid {handshake.pid} on {handshake.hostname}: {refusal})",
            )

    def _admission_refusal(self, handshake: EngineReady) -> str | None:
        """Why a late READY cannot take its index back, or None."""
        closed_reason = self.pool.closed_reason()
        if closed_reason is not None:
            return f"the api is shutting down ({closed_reason})"
        previous = self.pool.engines.get(handshake.engine_index)
        if previous is None:
            return f"this deployment has engine cores {sorted(self.pool.engines)} only"
        first = previous.handshake
        if (
            handshake.block_size,
            handshake.enable_prefix_caching,
            handshake.prefix_caching_hash_algo,
        ) != (
            first.block_size,
            first.enable_prefix_caching,
            first.prefix_caching_hash_algo,
        ):
            return (
                f"it hashes blocks as (block size {handshake.block_size}, prefix caching "
                f"{handshake.enable_prefix_caching}, {handshake.prefix_caching_hash_algo}); "
                f"the deployment as ({first.block_size}, {first.enable_prefix_caching}, "
                f"{first.prefix_caching_hash_algo})"
            )
        if handshake.max_model_len < self.max_model_len:
            return (
                f"its max_model_len {handshake.max_model_len} is below the "
                f"{self.max_model_len} the api admits requests for"
            )
        if handshake.kv_role != first.kv_role:
            return f"its KV role is {handshake.kv_role}, engine core's was {first.kv_role}"
        return None
