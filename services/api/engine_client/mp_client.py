"""MPEngineClient: the api's client of engine cores in other processes (zmq.asyncio).

    generate() ─ADD/ABORT/UTILITY─▶ ROUTER (bind) ══▶ engine DEALERs (identity = index) ─▶ loops
    _process_outputs ◀─ PULL (bind) ◀══ engine PUSHes ◀── outputs, heartbeats, DEAD, answers
    DPRouter ◀─ load-table task ◀─ SUB ◀══ DP coordinator PUB  (data parallelism only)

The client composes one part per concern, each over the same EnginePool (pool.py:
the engines, their books, `send`):

    EngineRouting   routing.py     which engine a request goes to (DPRouter)
    RequestFlow     routing.py     DirectFlow: the children go to one engine of all;
                    pd_flow.py     PDFlow: a prefill copy on a kv_producer first
                                   (picked once, at start-up, from the engines' roles)
    EngineLiveness  liveness.py    dead processes, suspect (silent) and hung engines,
                                   readmission after a restart
    UtilityCalls    utility.py     RPCs into an engine's busy loop (stats, ping, reset)
    RequestMigrator migration.py   a dead engine's requests resume on a live one

and keeps what ties them: the output loop and the handling of one engine's death. With data
parallelism (N > 1 engine cores on the same two sockets) each request goes to the engine the
router picks, and every engine is watched on its own. A dead engine's requests move to a
live engine and their streams go on (migration.py; those that cannot move fail with
EngineDeadError naming why); new requests go to the engines left; once none is left (with
P/D: once a stage has none) the client is dead (`wait_dead`), unless it waits for restarts
(`--restart-dead-engines`, headless nodes that may rejoin): then it answers 503 until an
engine is back, and the moving requests wait for it (--migration-wait-s). An engine silent
past ENGINE_HEARTBEAT_TIMEOUT_S is suspect (a busy host can delay a live engine's
heartbeats): it keeps its running requests and gets no new ones while another engine
serves; it dies as hung only after it also made no progress (on this host: no CPU time, no
wait for a CPU) for ENGINE_HUNG_TIMEOUT_S. Only a death moves its requests. A loop that is
alive but makes no progress while it has work (hung, or one step longer than
ENGINE_STALL_TIMEOUT_S) gets no new requests while it lasts; /health turns 503 only when no
engine is serving.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any

from kvserve.services.api.engine_client.client import EngineClient, EngineDeadError, StatsTotals
from kvserve.services.api.engine_client.connection import EngineChannel, EngineConnection
from kvserve.services.api.engine_client.dp_router import PREFIX_LOAD_SLACK, DPRouting
from kvserve.services.api.engine_client.liveness import EngineLiveness
from kvserve.services.api.engine_client.load_tables import LoadTableFeed
from kvserve.services.api.engine_client.migration import RequestMigrator
from kvserve.services.api.engine_client.pd_flow import PDFlow, make_flow
from kvserve.services.api.engine_client.pool import EnginePool
from kvserve.services.api.engine_client.routing import EngineRouting, make_router
from kvserve.services.api.engine_client.utility import UtilityCalls
from kvserve.services.api.observability.stats import MigrationStats
from kvserve.services.api.serving.tokenizer import TokenizerInfo
from kvserve.shared.env import (
    ENGINE_HEARTBEAT_INTERVAL_S,
    ENGINE_HEARTBEAT_TIMEOUT_S,
    ENGINE_HUNG_TIMEOUT_S,
    ENGINE_READY_TIMEOUT_S,
    ENGINE_STALL_TIMEOUT_S,
)
from kvserve.shared.logging import init_logger
from kvserve.shared.messages import EngineCoreOutputs, EngineCoreRequest, SchedulerStats
from kvserve.shared.transport import MessageDecoder
from kvserve.shared.wire import EngineHeartbeat, EngineReady, EngineStats, MsgType

logger = init_logger(__name__)

__all__ = ["EngineChannel", "EngineStalledError", "MPEngineClient"]

HELD_RETRY_INTERVAL_S = 0.25  # how often a request held for a restarted engine tries again


class EngineStalledError(EngineDeadError):
    """The engine process is alive but its loop has made no progress with work queued."""


@dataclass(frozen=True)
class ClientTopology:
    """What the client routes over, besides the engines' READY messages.

    Args:
        num_engines: engine cores 0..num_engines-1 whose READY the client waits for.
        routing: how requests pick an engine ("load" or "prefix"; see DPRouter).
        prefix_slack: prefix routing's load margin (--dp-prefix-slack).
        load_table_addr: the DP coordinator's PUB address (None: no coordinator).
        kv_store_address: the P/D KV store's address, for /health (None: not known here).
        wait_for_restarts: with no engine left, answer 503 and wait for one to say READY
            again rather than die.
        max_request_migrations: how often a request may move for deaths it may have caused
            (--max-request-migrations; 0: the requests of a dead engine fail).
        migration_wait_s: how long a moving request waits for a live engine.
    """

    num_engines: int = 1
    routing: DPRouting = "load"
    prefix_slack: int = PREFIX_LOAD_SLACK
    load_table_addr: str | None = None
    kv_store_address: str | None = None
    wait_for_restarts: bool = False
    max_request_migrations: int = 2
    migration_wait_s: float = 60.0


class MPEngineClient(EngineClient):
    """
    Args:
        tokenizer_info: the model's tokenizer and stop ids.
        model_name: the name the API serves the model under.
        channel: the bound sockets; every engine has said READY on them.
        engines: one EngineConnection per engine core.
        topology: routing, the coordinator's and the store's addresses, restarts.
        engine_processes: engine index -> process, for the engines that are our children;
            the launcher replaces an entry when it restarts that engine.
    """

    def __init__(
        self,
        tokenizer_info: TokenizerInfo,
        model_name: str,
        channel: EngineChannel,
        engines: list[EngineConnection],
        topology: ClientTopology = ClientTopology(),
        engine_processes: dict[int, Any] | None = None,
    ):
        assert engines, "a client needs at least one engine core"
        super().__init__(
            tokenizer_info,
            min(e.handshake.max_model_len for e in engines),
            model_name,
            max_logprobs=min(e.handshake.max_logprobs for e in engines),
            max_waiting_requests=min(e.handshake.max_waiting_requests for e in engines),
        )
        self.handshake = engines[0].handshake  # engine 0's, for single-engine callers
        self.kv_store_address = topology.kv_store_address
        self.wait_for_restarts = topology.wait_for_restarts
        self._dead_event = asyncio.Event()
        self.pool = EnginePool(
            channel,
            engines,
            ENGINE_STALL_TIMEOUT_S.get(),
            closed_reason=lambda: self.dead_reason,
            engine_lost=self._engine_died,
        )
        self.routing = EngineRouting(
            self.pool, make_router(engines, topology.routing, topology.prefix_slack)
        )
        self.flow = make_flow(self.pool, self.routing)
        self.liveness = EngineLiveness(
            self.pool,
            self.routing.router,
            self._engine_died,
            self.max_model_len,
            engine_processes if engine_processes is not None else {},
            ENGINE_HEARTBEAT_INTERVAL_S.get(),
            ENGINE_HEARTBEAT_TIMEOUT_S.get(),
            ENGINE_HUNG_TIMEOUT_S.get(),
        )
        self.utilities = UtilityCalls(self.pool)
        self.migrator = RequestMigrator(
            self.pool,
            self.output_processor,
            self._send_requests,
            lambda request_id, reason: self._fail_requests([request_id], reason),
            topology.max_request_migrations,
            topology.migration_wait_s,
        )
        self._tasks = self._start_tasks(topology.load_table_addr)

    def _start_tasks(self, load_table_addr: str | None) -> list[asyncio.Task]:
        """The client's loops: outputs, liveness, readmissions, and the DP load table."""
        tasks = [
            asyncio.create_task(self._process_outputs(), name="engine-outputs"),
            asyncio.create_task(self.liveness.watch(), name="engine-liveness"),
            asyncio.create_task(self.liveness.receive_readmissions(), name="engine-readmissions"),
        ]
        if load_table_addr is not None:
            feed = LoadTableFeed(
                self.pool, self.routing.router, load_table_addr, self.routing.share_tenant_service
            )
            self.routing.load_tables = feed
            tasks.append(asyncio.create_task(feed.receive(), name="dp-load-table"))
        return tasks

    @classmethod
    async def connect(
        cls,
        channel: EngineChannel,
        tokenizer_info: TokenizerInfo,
        model_name: str,
        engine_process=None,
        ready_timeout_s: float | None = None,
        *,
        topology: ClientTopology = ClientTopology(),
        engine_processes: dict[int, Any] | None = None,
    ) -> MPEngineClient:
        """Wait for READY from engines 0..num_engines-1 on `channel`; return a running client.

        Args:
            engine_process: engine 0's process (single-engine callers).
            engine_processes: engine index -> process, for the engines that are our children
                (kept, not copied: the launcher updates it when it restarts an engine).
            topology: see ClientTopology.
        """
        timeout_s = ready_timeout_s or ENGINE_READY_TIMEOUT_S.get()
        processes = engine_processes if engine_processes is not None else {}
        if engine_process is not None:
            processes[0] = engine_process
        engines = await channel.connect_engines(topology.num_engines, timeout_s, processes)
        return cls(tokenizer_info, model_name, channel, engines, topology, processes)

    # ------------------------------------------------------------------ the parts' state

    @property
    def channel(self) -> EngineChannel:
        return self.pool.channel

    @property
    def engines(self) -> dict[int, EngineConnection]:
        """Engine index -> its connection (a readmitted engine's replaces its predecessor)."""
        return self.pool.engines

    @property
    def identity(self) -> bytes:
        return self.engines[self.handshake.engine_index].identity

    @property
    def watched_processes(self) -> list:
        return [watched for engine in self.engines.values() for watched in engine.watched_processes]

    @property
    def prefill_ids(self) -> frozenset[int]:
        """The P/D prefill engines (empty without P/D)."""
        return self.flow.prefill_ids if isinstance(self.flow, PDFlow) else frozenset()

    @property
    def decode_ids(self) -> frozenset[int]:
        """The P/D decode engines (empty without P/D)."""
        return self.flow.decode_ids if isinstance(self.flow, PDFlow) else frozenset()

    @property
    def num_readmissions(self) -> int:
        return self.liveness.num_readmissions

    # ------------------------------------------------------------------ health

    def _serving_ids(self) -> set[int]:
        return {engine.engine_index for engine in self.pool.serving_engines()}

    @property
    def is_healthy(self) -> bool:
        """Some engine serves (with P/D: some prefill engine and some decode engine)."""
        return self.dead_reason is None and self.flow.serves(self._serving_ids())

    @property
    def waits_for_engine(self) -> bool:
        """No engine core (with P/D: of some stage) is alive and the client waits for
        restarts: new requests are held, up to --migration-wait-s, for the restarted one."""
        if not self.wait_for_restarts or self.dead_reason is not None:
            return False
        return not self.pool.live_ids(self.engines) or self.flow.lost_stage() is not None

    @property
    def stall_reason(self) -> str | None:
        """Why no engine takes requests while some live, or None while one serves."""
        if self.dead_reason is not None or self.pool.serving_engines():
            return None
        if not self.pool.live_ids(self.engines):
            return str(self.pool.no_engine_error())
        return "; ".join(
            reason
            for engine in self.engines.values()
            if engine.is_alive and (reason := engine.stall_reason(self.pool.stall_timeout_s))
        )

    def health_report(self) -> dict:
        engines = []
        for engine in self.pool.sorted_engines():
            entry = engine.describe(self.pool.stall_timeout_s)
            # Sent to it and not seen to end: counted here, so true however silent it is.
            entry["num_in_flight"] = self.pool.num_in_flight.get(engine.engine_index, 0)
            if engine.handshake.kv_role is not None:
                entry["kv_role"] = engine.handshake.kv_role
            engines.append(entry)
        num_serving = sum(entry["state"] == "serving" for entry in engines)
        status = self.flow.health_status(num_serving, len(engines), self.is_healthy)
        report: dict[str, Any] = {"status": status, "engines": engines}
        if self.kv_store_address is not None:
            report["kv_store"] = self.kv_store_address
        if self.routing.load_tables is not None:
            report["coordinator"] = self.routing.load_tables.describe()
        return report

    def per_engine_stats(self) -> list[tuple[int, SchedulerStats | None, StatsTotals]]:
        return [
            (engine.engine_index, engine.latest_stats, engine.stats_totals)
            for engine in self.pool.sorted_engines()
        ]

    def engine_handshakes(self) -> list[EngineReady]:
        return [engine.handshake for engine in self.pool.sorted_engines()]

    def migration_stats(self) -> dict[int, MigrationStats]:
        return self.migrator.stats

    async def check_health(self) -> None:
        """Raise EngineDeadError when dead, EngineStalledError while no engine serves."""
        if self.dead_reason is not None:
            raise EngineDeadError(self.dead_reason)
        reason = self.stall_reason
        if reason is not None:
            raise EngineStalledError(reason)

    async def wait_dead(self) -> str:
        """Return (the reason) once every engine is dead."""
        await self._dead_event.wait()
        assert self.dead_reason is not None, "the dead event is set with the reason"
        return self.dead_reason

    def check_capacity(self, num_requests: int = 1) -> None:
        self.routing.check_capacity(num_requests)

    # ------------------------------------------------------------------ utilities

    async def reset_prefix_cache(self) -> bool:
        """Reset every live engine's prefix cache; True when all of them did."""
        return await self.utilities.reset_prefix_cache()

    async def sleep(self, level: int) -> bool:
        """Refuse new requests (503), then put every engine to sleep; False, and awake again,
        when some engine had requests in flight (those that slept are woken)."""
        self.sleep_level = level
        try:
            slept = await self.utilities.sleep(level)
            if not slept:
                await self.utilities.wake_up(None)  # the engines that did sleep
        except BaseException:
            self.sleep_level = 0
            raise
        if not slept:
            self.sleep_level = 0
        return slept

    async def wake_up(self, tags: list[str] | None = None) -> None:
        """Wake every engine; requests are served again once nothing is left asleep."""
        await self.utilities.wake_up(tags)
        sleeping = tags is not None and "weights" in tags and "kv_cache" not in tags
        if not sleeping:
            self.sleep_level = 0

    async def get_stats(self, engine_index: int | None = None) -> EngineStats:
        return await self.utilities.get_stats(engine_index)

    async def ping(
        self, timeout_s: float | None = None, engine_index: int | None = None
    ) -> EngineHeartbeat:
        """Answered by the busy loop itself: proves it is not stuck."""
        return await self.utilities.ping(timeout_s, engine_index)

    # ------------------------------------------------------------------ transport

    async def _send_requests(self, requests: list[EngineCoreRequest]) -> None:
        engine = await self.flow.send(requests)
        parent = self.output_processor.child_to_parent.get(requests[0].request_id)
        if parent is not None:
            engine.request_ids.add(parent.request_id)
            if len(self.engines) > 1:
                logger.debug("request %s -> engine core %d", parent.request_id, engine.engine_index)
        self.pool.assign(requests, engine)
        self.migrator.on_sent(requests)

    async def _submit(self, requests: list[EngineCoreRequest]) -> None:
        """Send a new request; one in transit as the last engine core dies (or sent while
        it restarts) waits for the restarted one, up to --migration-wait-s.

        Raises:
            EngineDeadError: no engine core serves and none is expected, or none came
                back in time.
        """
        held_since: float | None = None
        cause = ""  # why it was first held (a death), not a later try's "none is left"
        while True:
            try:
                await self._send_requests(requests)
            except EngineDeadError as exc:
                if not self.waits_for_engine:
                    raise
                if held_since is None:
                    held_since, cause = time.monotonic(), str(exc)
                    logger.warning(
                        "request %s is held for a restarted engine core (up to %g s, "
                        "--migration-wait-s): %s",
                        self._parent_id(requests),
                        self.migrator.wait_s,
                        exc,
                    )
                elif time.monotonic() - held_since >= self.migrator.wait_s:
                    raise EngineDeadError(
                        f"no engine core came back within {self.migrator.wait_s:g} s "
                        f"(--migration-wait-s) to serve this request: {cause}"
                    ) from exc
                await asyncio.sleep(HELD_RETRY_INTERVAL_S)
                continue
            if held_since is not None:
                logger.info(
                    "request %s sent to engine core %s after %.2f s held for it",
                    self._parent_id(requests),
                    self.pool.child_engine.get(requests[0].request_id),
                    time.monotonic() - held_since,
                )
            return

    def _parent_id(self, requests: list[EngineCoreRequest]) -> str:
        parent = self.output_processor.child_to_parent.get(requests[0].request_id)
        return parent.request_id if parent is not None else requests[0].request_id

    async def _send_abort(self, engine_request_ids: list[str]) -> None:
        await self.pool.abort(engine_request_ids)

    def _engine_index_of(self, engine_request_id: str) -> int:
        return self.pool.child_engine.get(engine_request_id, 0)

    def _forget_request(self, request_id: str, child_ids: list[str]) -> None:
        self.pool.forget(request_id, child_ids)
        self.migrator.forget(request_id, child_ids)

    async def _handle_outputs(self, outputs: EngineCoreOutputs) -> None:
        engine = self.engines.get(outputs.engine_index)
        if engine is not None:
            engine.num_generated_tokens += sum(len(o.new_token_ids) for o in outputs.outputs)
            if outputs.scheduler_stats is not None:
                engine.on_stats(outputs.scheduler_stats)
        self.flow.on_outputs(outputs)
        migrator = self.migrator
        if migrator.moved_children:
            outputs.outputs = [
                output
                for output in outputs.outputs
                if not migrator.is_stale(output.request_id, outputs.engine_index)
            ]
            if migrator.resuming:
                now = time.monotonic()
                for output in outputs.outputs:
                    migrator.on_output(output.request_id, now)
        await super()._handle_outputs(outputs)

    async def _process_outputs(self) -> None:
        decoder = MessageDecoder(
            (MsgType.OUTPUTS, MsgType.UTILITY_OUTPUT, MsgType.HEARTBEAT, MsgType.DEAD)
        )
        socket = self.channel.output_socket
        try:
            while self.dead_reason is None:
                msg_type, payload = decoder.decode(await socket.recv_multipart(copy=False))
                now = time.monotonic()
                if msg_type == MsgType.UTILITY_OUTPUT:
                    self.utilities.resolve(payload, now)
                    continue
                engine = self.engines.get(payload.engine_index)
                if engine is None or not engine.is_alive:
                    continue  # not one of ours, or dropped already: what it says is moot
                if msg_type == MsgType.OUTPUTS:
                    engine.on_message(now, progress=True)
                    await self._handle_outputs(payload)
                elif msg_type == MsgType.HEARTBEAT:
                    engine.on_heartbeat(payload, now)
                else:
                    assert msg_type == MsgType.DEAD, msg_type
                    self._engine_died(
                        engine, f"engine core {payload.engine_index} died: {payload.reason}"
                    )
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - fail the requests rather than hang them
            logger.exception("processing engine outputs failed")
            self._fail_all(f"processing engine outputs failed: {exc!r}")

    # ------------------------------------------------------------------ death

    def _engine_died(self, engine: EngineConnection, reason: str, replaced: bool = False) -> None:
        """Drop one engine: its requests and utility calls fail; the others serve on.

        Args:
            replaced: a new process of the same index is being admitted in its place.
        """
        if engine.dead_reason is not None or self.dead_reason is not None:
            return  # the first cause is the one worth reporting
        self.pool.mark_dead(engine, reason)
        self.routing.router.remove_engine(engine.engine_index)
        num_alive = len(self.pool.live_ids(self.engines))
        logger.error(
            "engine core %d is gone (%s); moving its %d in-flight requests; %d of "
            "%d engine cores left",
            engine.engine_index,
            reason,
            len(engine.request_ids),
            num_alive,
            len(self.engines),
        )
        self.utilities.fail_engine(engine.engine_index, reason)
        self.flow.on_engine_died(engine.engine_index, reason)
        request_ids = list(engine.request_ids)
        self.pool.drop_books(engine.engine_index)
        self.migrator.move(request_ids, engine.engine_index, reason)
        if not replaced:
            self._after_death(num_alive, reason)

    def _after_death(self, num_alive: int, reason: str) -> None:
        """The client dies with its last engine (with P/D: a stage's last), unless it waits
        for restarts."""
        if self.wait_for_restarts:
            if num_alive == 0 or not self.is_healthy:
                logger.error(
                    "no engine core serves now (%s); answering 503 until a restarted one "
                    "says READY",
                    reason,
                )
            return
        if num_alive == 0:
            if len(self.engines) > 1:
                reason = f"all {len(self.engines)} engine cores are dead (the last: {reason})"
            self._fail_all(reason)
        elif (stage := self.flow.lost_stage()) is not None:
            self._fail_all(f"no {stage} engine core is left (the last: {reason})")

    def _fail_all(self, reason: str) -> None:
        if self.dead_reason is not None:
            return
        super()._fail_all(reason)
        self.utilities.fail_all(reason)
        self._dead_event.set()

    async def shutdown(self) -> None:
        """Stop the background tasks and close the sockets (the engine processes are the
        launcher's to stop)."""
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.migrator.shutdown()
        # Whatever still waits fails now, and nothing is sent on the closed sockets.
        reason = "the api server is shutting down"
        if self.queues or self.utilities.futures:
            self._fail_all(reason)
        elif self.dead_reason is None:
            self.dead_reason = reason
        self.channel.close()
