"""MPEngineClient: the api's client of engine cores in other processes (zmq.asyncio).

    generate() ─ADD/ABORT/UTILITY─▶ ROUTER (bind) ══▶ engine DEALERs (identity = index) ─▶ loops
    _handle_outputs ◀─ output task ◀─ PULL (bind) ◀══ engine PUSHes ◀── outputs, heartbeats
    DPRouter ◀─ load-table task ◀─ SUB ◀══ DP coordinator PUB  (data parallelism only)

With data parallelism (N > 1 engine cores on the same two sockets) each request goes to the
engine the DPRouter picks, and every engine is watched on its own.

P/D disaggregation, on when the engines' READY report both kv_producer and other roles:

    generate ─▶ prefill copy ("{child id}-prefill", max_tokens 1) ─▶ a kv_producer engine
             ◀─ its finish (output dropped; its KV blocks are in the store now)
             ─▶ the request itself ─▶ a consumer (kv_consumer, kv_both or no role) ─▶ stream

Each stage picks the least loaded engine of its pool (the DPRouter, restricted to the pool).
A client that goes away during the prefill aborts it on the prefill engine (the decode is
never sent); during the decode, on the decode engine. A prefill engine that dies is retried
once on another live one; with none left the request fails (EngineDeadError, a 503). Once a
pool has no live engine the client is dead, as when no engine at all is left.

Liveness, each of which drops one engine and fails the requests it holds with
EngineDeadError naming it:
  - a watched process (the engine core, its workers, when on this host) is gone;
  - the engine sent its DEAD sentinel;
  - nothing arrived from it for ENGINE_HEARTBEAT_TIMEOUT_S (its output thread beats every
    interval, whatever the busy loop does, so silence means the process is gone or frozen).
New requests go to the engines left; once none is left the client is dead (`wait_dead`),
unless it waits for restarts (`--restart-dead-engines`, headless nodes that may rejoin): then
it answers 503 until an engine is back.

Readmission: an engine core that says READY after start-up (restarted by the launcher or by
compose, or a headless node that rejoined) takes its index back: the ROUTER hands its identity
over to the new connection, a live predecessor is dropped first (its requests fail), and the
new one gets requests as soon as it is admitted. A READY that does not fit (an index outside
the deployment, another block size or hash, a shorter max_model_len, another KV role) is
refused and logged.

Engines that are not the api's children watch it in turn: it sends every engine a
FRONTEND_HEARTBEAT every interval, and they shut down after KVSERVE_FRONTEND_TIMEOUT_S without
a word from it.
A loop that is alive but makes no progress while it has work (hung, or one step longer than
ENGINE_STALL_TIMEOUT_S) gets no new requests while it lasts; /health turns 503 only when no
engine is serving.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from kvserve.services.api.dp_router import DPRouter, DPRouting
from kvserve.services.api.engine_client import (
    EngineClient,
    EngineDeadError,
    StatsTotals,
    estimate_waiting,
    overloaded,
)
from kvserve.services.api.engine_connection import EngineChannel, EngineConnection
from kvserve.services.api.tokenizer import TokenizerInfo
from kvserve.shared.env import (
    ENGINE_HEARTBEAT_INTERVAL_S,
    ENGINE_HEARTBEAT_TIMEOUT_S,
    ENGINE_READY_TIMEOUT_S,
    ENGINE_STALL_TIMEOUT_S,
)
from kvserve.shared.hashing import get_hash_fn, make_extra_keys
from kvserve.shared.logging import init_logger
from kvserve.shared.lora import lora_extra_key
from kvserve.shared.messages import EngineCoreOutputs, EngineCoreRequest, SchedulerStats
from kvserve.shared.sampling_params import SamplingParams
from kvserve.shared.transport import MessageDecoder, MessageEncoder, make_socket
from kvserve.shared.wire import (
    EngineHeartbeat,
    EngineReady,
    EngineStats,
    GetStats,
    LoadTable,
    MsgType,
    Ping,
    ResetPrefixCache,
    UtilityCall,
    UtilityMethod,
    UtilityOutput,
    UtilityResult,
)

logger = init_logger(__name__)

__all__ = ["EngineChannel", "EngineStalledError", "MPEngineClient"]


class EngineStalledError(EngineDeadError):
    """The engine process is alive but its loop has made no progress with work queued."""


PREFILL_SUFFIX = "-prefill"  # a prefill copy's engine-core id: the child's id + this
MAX_PREFILL_ATTEMPTS = 2  # a prefill whose engine died is retried once on another


@dataclass(slots=True)
class _Prefill:
    """A prefill copy in flight: its engine, and a future set when it ends (None when it
    finished, the reason when its engine died)."""

    engine_index: int
    done: asyncio.Future


def prefill_request(request: EngineCoreRequest) -> EngineCoreRequest:
    """The prefill copy of one child: its prompt (and adapter, cache salt, priority) with one
    greedy token to make, no stop strings, logprobs or constraints."""
    return msgspec.structs.replace(
        request,
        request_id=request.request_id + PREFILL_SUFFIX,
        sampling_params=SamplingParams(max_tokens=1, temperature=0.0, seed=None),
    )


class MPEngineClient(EngineClient):
    """
    Args:
        tokenizer_info: the model's tokenizer and stop ids.
        model_name: the name the API serves the model under.
        channel: the bound sockets; every engine has said READY on them.
        engines: one EngineConnection per engine core.
        routing: how requests pick an engine ("load" or "prefix"; see DPRouter).
        load_table_addr: the DP coordinator's PUB address (None: no coordinator).
        kv_store_address: the P/D KV store's address, for /health (None: not known here).
        engine_processes: engine index -> process, for the engines that are our children;
            the launcher replaces an entry when it restarts that engine.
        wait_for_restarts: with no engine left, answer 503 and wait for one to say READY
            again rather than die.
    """

    def __init__(
        self,
        tokenizer_info: TokenizerInfo,
        model_name: str,
        channel: EngineChannel,
        engines: list[EngineConnection],
        routing: DPRouting = "load",
        load_table_addr: str | None = None,
        kv_store_address: str | None = None,
        engine_processes: dict[int, Any] | None = None,
        wait_for_restarts: bool = False,
    ):
        assert engines, "a client needs at least one engine core"
        first = engines[0].handshake
        super().__init__(
            tokenizer_info,
            min(e.handshake.max_model_len for e in engines),
            model_name,
            max_logprobs=min(e.handshake.max_logprobs for e in engines),
            max_waiting_requests=min(e.handshake.max_waiting_requests for e in engines),
        )
        self.channel = channel
        self.engines = {engine.engine_index: engine for engine in engines}
        self.router = _make_router(engines, routing)
        self.heartbeat_interval_s = ENGINE_HEARTBEAT_INTERVAL_S.get()
        self.heartbeat_timeout_s = ENGINE_HEARTBEAT_TIMEOUT_S.get()
        self.stall_timeout_s = ENGINE_STALL_TIMEOUT_S.get()
        self.handshake = first  # engine 0's, for single-engine callers
        self._encoder = MessageEncoder()
        self._call_ids = itertools.count()
        self._utility_futures: dict[int, tuple[int, asyncio.Future]] = {}
        self._child_engine: dict[str, int] = {}  # engine-core request id -> engine index
        self._num_in_flight = {index: 0 for index in self.engines}  # children per engine
        self._dead_event = asyncio.Event()
        self.kv_store_address = kv_store_address
        self.engine_processes = engine_processes if engine_processes is not None else {}
        self.wait_for_restarts = wait_for_restarts
        self.num_readmissions = 0
        self._last_death: str | None = None  # the reason the last engine died
        self.prefill_ids, self.decode_ids = _pd_pools(engines)
        self._prefills: dict[str, _Prefill] = {}  # prefill copy id -> where it runs
        if self.prefill_ids:
            logger.info(
                "P/D disaggregation: prefill engine cores %s, decode engine cores %s",
                sorted(self.prefill_ids),
                sorted(self.decode_ids),
            )
        self._tasks = [
            asyncio.create_task(self._process_outputs(), name="engine-outputs"),
            asyncio.create_task(self._watch_liveness(), name="engine-liveness"),
            asyncio.create_task(self._receive_readmissions(), name="engine-readmissions"),
        ]
        if load_table_addr is not None:
            self._tasks.append(
                asyncio.create_task(
                    self._receive_load_tables(load_table_addr), name="dp-load-table"
                )
            )

    @classmethod
    async def connect(
        cls,
        channel: EngineChannel,
        tokenizer_info: TokenizerInfo,
        model_name: str,
        engine_process=None,
        ready_timeout_s: float | None = None,
        *,
        num_engines: int = 1,
        engine_processes: dict[int, Any] | None = None,
        routing: DPRouting = "load",
        load_table_addr: str | None = None,
        kv_store_address: str | None = None,
        wait_for_restarts: bool = False,
    ) -> MPEngineClient:
        """Wait for READY from engines 0..num_engines-1 on `channel`; return a running client.

        Args:
            engine_process: engine 0's process (single-engine callers).
            engine_processes: engine index -> process, for the engines that are our children
                (kept, not copied: the launcher updates it when it restarts an engine).
            wait_for_restarts: see the class.
        """
        timeout_s = ready_timeout_s or ENGINE_READY_TIMEOUT_S.get()
        processes = engine_processes if engine_processes is not None else {}
        if engine_process is not None:
            processes[0] = engine_process
        ready = await channel.wait_all_ready(num_engines, timeout_s, processes)
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
            engines.append(EngineConnection(identity, handshake, processes.get(engine_index)))
        return cls(
            tokenizer_info,
            model_name,
            channel,
            engines,
            routing,
            load_table_addr,
            kv_store_address,
            processes,
            wait_for_restarts,
        )

    # ------------------------------------------------------------------ health

    @property
    def identity(self) -> bytes:
        return self.engines[self.handshake.engine_index].identity

    @property
    def watched_processes(self) -> list:
        return [watched for engine in self.engines.values() for watched in engine.watched_processes]

    def _serving_engines(self) -> list[EngineConnection]:
        return [
            engine
            for engine in self.engines.values()
            if engine.state(self.stall_timeout_s) == "serving"
        ]

    @property
    def is_healthy(self) -> bool:
        """Some engine serves (with P/D: some prefill engine and some decode engine)."""
        serving = {engine.engine_index for engine in self._serving_engines()}
        if self.prefill_ids:
            serving = serving & self.prefill_ids and serving & self.decode_ids
        return self.dead_reason is None and bool(serving)

    @property
    def stall_reason(self) -> str | None:
        """Why no engine takes requests while some live, or None while one serves."""
        if self.dead_reason is not None or self._serving_engines():
            return None
        if not self._live_ids(self.engines):
            return str(self._no_engine_error())
        return "; ".join(
            engine.stall_reason(self.stall_timeout_s)
            for engine in self.engines.values()
            if engine.is_alive
        )

    def health_report(self) -> dict:
        engines = []
        for _, engine in sorted(self.engines.items()):
            entry = engine.describe(self.stall_timeout_s)
            if engine.handshake.kv_role is not None:
                entry["kv_role"] = engine.handshake.kv_role
            engines.append(entry)
        num_serving = sum(entry["state"] == "serving" for entry in engines)
        status = (
            "healthy" if num_serving == len(engines) else "degraded" if num_serving else "unhealthy"
        )
        if self.prefill_ids and not self.is_healthy:
            status = "unhealthy"  # one of the two stages has no engine
        report: dict[str, Any] = {"status": status, "engines": engines}
        if self.kv_store_address is not None:
            report["kv_store"] = self.kv_store_address
        return report

    def per_engine_stats(self) -> list[tuple[int, SchedulerStats | None, StatsTotals]]:
        return [
            (index, engine.latest_stats, engine.stats_totals)
            for index, engine in sorted(self.engines.items())
        ]

    def engine_handshakes(self) -> list[EngineReady]:
        return [engine.handshake for _, engine in sorted(self.engines.items())]

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
        return self.dead_reason

    def _engine_died(self, engine: EngineConnection, reason: str, replaced: bool = False) -> None:
        """Drop one engine: its requests and utility calls fail; the others serve on.

        Args:
            replaced: a new process of the same index is being admitted in its place.
        """
        if engine.dead_reason is not None or self.dead_reason is not None:
            return  # the first cause is the one worth reporting
        engine.dead_reason = reason
        self._last_death = reason
        self.router.remove_engine(engine.engine_index)
        num_alive = sum(e.is_alive for e in self.engines.values())
        logger.error(
            "engine core %d is gone (%s); failing its %d in-flight requests; %d of "
            "%d engine cores left",
            engine.engine_index,
            reason,
            len(engine.request_ids),
            num_alive,
            len(self.engines),
        )
        for engine_index, future in list(self._utility_futures.values()):
            if engine_index == engine.engine_index and not future.done():
                future.set_exception(EngineDeadError(reason))
        for prefill_id, prefill in list(self._prefills.items()):
            if prefill.engine_index == engine.engine_index:
                self._end_prefill(prefill_id, reason)  # retried elsewhere, or fails
        self._fail_requests(list(engine.request_ids), reason)
        # Its children leave the books now, so that a successor of the same index starts
        # from zero (their generators' own clean-up finds nothing to undo or abort).
        for child_id, engine_index in list(self._child_engine.items()):
            if engine_index == engine.engine_index:
                del self._child_engine[child_id]
        self._num_in_flight[engine.engine_index] = 0
        if replaced:
            return
        if self.wait_for_restarts:
            if num_alive == 0 or (self.prefill_ids and not self.is_healthy):
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
        elif self.prefill_ids:
            for stage, pool in (("prefill", self.prefill_ids), ("decode", self.decode_ids)):
                if not self._live_ids(pool):
                    self._fail_all(f"no {stage} engine core is left (the last: {reason})")

    def _no_engine_error(self) -> EngineDeadError:
        return EngineDeadError(
            f"no engine core is serving (the last one died: {self._last_death}); waiting for "
            f"a restarted one"
        )

    async def _receive_readmissions(self) -> None:
        """Admit every engine core that says READY on the input socket after start-up."""
        decoder = MessageDecoder((MsgType.READY,))
        socket = self.channel.input_socket
        while True:
            identity, *frames = await socket.recv_multipart(copy=False)
            try:
                _, handshake = decoder.decode(frames)
            except (ValueError, msgspec.ValidationError) as exc:
                logger.error("dropped a malformed message on the engine input socket: %s", exc)
                continue
            self._admit(identity.bytes, handshake)

    def _admit(self, identity: bytes, handshake: EngineReady) -> None:
        index = handshake.engine_index
        refusal = self._admission_refusal(handshake)
        if refusal is not None:
            logger.error(
                "refused engine core %d (pid %d on %s): %s",
                index,
                handshake.pid,
                handshake.hostname,
                refusal,
            )
            previous = self.engines.get(index)
            if previous is not None and previous.is_alive:
                # Its identity is the newcomer's now (ROUTER_HANDOVER): it is unreachable.
                self._engine_died(
                    previous,
                    f"engine core {index} lost its connection to a process that was refused "
                    f"(pid {handshake.pid} on {handshake.hostname}: {refusal})",
                )
            return
        previous = self.engines[index]
        if previous.is_alive:
            self._engine_died(
                previous,
                f"engine core {index} was replaced by a new process (pid {handshake.pid} "
                f"on {handshake.hostname})",
                replaced=True,
            )
        self.engines[index] = EngineConnection(
            identity, handshake, self.engine_processes.get(index)
        )
        self._num_in_flight[index] = 0
        self.router.add_engine(index, handshake.num_blocks, handshake.kv_role)
        self.num_readmissions += 1
        logger.info(
            "engine core %d readmitted (pid %d on %s): %d KV blocks; %d of %d engine cores serve",
            index,
            handshake.pid,
            handshake.hostname,
            handshake.num_blocks,
            len(self._live_ids(self.engines)),
            len(self.engines),
        )

    def _admission_refusal(self, handshake: EngineReady) -> str | None:
        """Why a late READY cannot take its index back, or None."""
        if self.dead_reason is not None:
            return f"the api is shutting down ({self.dead_reason})"
        previous = self.engines.get(handshake.engine_index)
        if previous is None:
            return f"this deployment has engine cores {sorted(self.engines)} only"
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

    def _fail_all(self, reason: str) -> None:
        if self.dead_reason is not None:
            return
        super()._fail_all(reason)
        for _, future in self._utility_futures.values():
            if not future.done():
                future.set_exception(EngineDeadError(reason))
        self._utility_futures.clear()
        self._dead_event.set()

    # ------------------------------------------------------------------ utilities

    async def call_utility(
        self, method: UtilityMethod, timeout_s: float | None = None, engine_index: int | None = None
    ) -> UtilityResult:
        """Run a utility in one engine's busy loop (between two steps) and return its result.

        Args:
            engine_index: the engine (default: the lowest-index live one).

        Raises:
            RuntimeError: the utility failed in the engine (the engine lives on).
            EngineDeadError: the engine died before answering.
            TimeoutError: no answer within timeout_s.
        """
        engine = self._utility_engine(engine_index)
        call_id = next(self._call_ids)
        future = asyncio.get_running_loop().create_future()
        self._utility_futures[call_id] = (engine.engine_index, future)
        try:
            await self._send(engine, MsgType.UTILITY, UtilityCall(call_id, method))
            return await asyncio.wait_for(future, timeout_s)
        finally:
            self._utility_futures.pop(call_id, None)

    def _utility_engine(self, engine_index: int | None) -> EngineConnection:
        if self.dead_reason is not None:
            raise EngineDeadError(self.dead_reason)
        if engine_index is not None:
            if engine_index not in self.engines:
                raise ValueError(
                    f"no engine core {engine_index}: engines are {sorted(self.engines)}"
                )
            return self.engines[engine_index]
        return next(e for _, e in sorted(self.engines.items()) if e.is_alive)

    async def reset_prefix_cache(self) -> bool:
        """Reset every live engine's prefix cache; True when all of them did."""
        results = [
            await self.call_utility(ResetPrefixCache(), engine_index=index)
            for index, engine in sorted(self.engines.items())
            if engine.is_alive
        ]
        return all(results)

    async def get_stats(self, engine_index: int | None = None) -> EngineStats:
        return await self.call_utility(GetStats(), engine_index=engine_index)

    async def ping(
        self, timeout_s: float | None = None, engine_index: int | None = None
    ) -> EngineHeartbeat:
        """Answered by the busy loop itself: proves it is not stuck."""
        return await self.call_utility(Ping(), timeout_s, engine_index)

    # ------------------------------------------------------------------ transport

    def _engines_with_room(self, num_requests: int) -> list[EngineConnection]:
        """The serving engines that can queue num_requests more within their
        --max-waiting-requests (an idle engine always can)."""
        return [
            engine
            for engine in self._serving_engines()
            if (num_waiting := self._num_waiting(engine)) == 0
            or num_waiting + num_requests <= engine.handshake.max_waiting_requests
        ]

    def _num_waiting(self, engine: EngineConnection) -> int:
        return estimate_waiting(self._num_in_flight[engine.engine_index], engine.latest_stats)

    def check_capacity(self, num_requests: int = 1) -> None:
        serving = self._serving_engines()
        if serving and not self._engines_with_room(num_requests):
            engine = min(serving, key=self._num_waiting)
            raise overloaded(self._num_waiting(engine), engine.handshake.max_waiting_requests)

    def _live_ids(self, pool: Collection[int]) -> list[int]:
        return [index for index in pool if self.engines[index].is_alive]

    def _choose_engine(
        self, requests: list[EngineCoreRequest], pool: Collection[int] | None
    ) -> EngineConnection:
        """The least loaded engine of `pool` (None: every engine) for these requests."""
        first = requests[0]
        # Engines with room first; when none has (a race with check_capacity), the
        # engine refuses past its bound itself.
        candidates = self._engines_with_room(len(requests)) or self._serving_engines()
        candidate_ids = [e.engine_index for e in candidates]
        if not candidate_ids and not self._live_ids(self.engines):
            raise self._no_engine_error()
        if pool is not None:
            candidate_ids = [i for i in candidate_ids if i in pool] or self._live_ids(pool)
            if not candidate_ids:
                raise EngineDeadError("no engine core of this stage is left")
        return self.engines[
            self.router.choose(
                first.prompt_token_ids,
                make_extra_keys(first.cache_salt, lora_extra_key(first.lora_request)),
                candidate_ids=candidate_ids or None,
            )
        ]

    async def _route_and_send(
        self,
        requests: list[EngineCoreRequest],
        pool: Collection[int] | None = None,
        before_send: Callable[[EngineConnection], None] | None = None,
    ) -> EngineConnection:
        """Send the requests to one engine of `pool` (None: any); returns it.

        Args:
            before_send: called with the chosen engine before the first request goes out.
        """
        while True:
            if self.dead_reason is not None:
                raise EngineDeadError(self.dead_reason)
            engine = self._choose_engine(requests, pool)
            if before_send is not None:
                before_send(engine)
            try:
                for request in requests:
                    await self._send(engine, MsgType.ADD, request)
                return engine
            except EngineDeadError:
                if not self._live_ids(self.engines if pool is None else pool):
                    raise
                # Unreachable before its heartbeats lapsed: try another engine.

    async def _send_requests(self, requests: list[EngineCoreRequest]) -> None:
        # The n children of one request share its prompt: one engine gets them all.
        decode_pool = None
        if self.prefill_ids:
            await self._prefill(requests)
            decode_pool = self.decode_ids
        engine = await self._route_and_send(requests, decode_pool)
        parent = self.output_processor.child_to_parent.get(requests[0].request_id)
        if parent is not None:
            engine.request_ids.add(parent.request_id)
            if len(self.engines) > 1:
                logger.debug("request %s -> engine core %d", parent.request_id, engine.engine_index)
        for request in requests:
            self._child_engine[request.request_id] = engine.engine_index
        self._num_in_flight[engine.engine_index] += len(requests)

    # ------------------------------------------------------------------ P/D prefill

    async def _prefill(self, requests: list[EngineCoreRequest]) -> None:
        """Run the children's prompts on a prefill engine (one token each, dropped) and wait
        until they finish, so that the decode engine finds their KV blocks in the store.

        A cancelled wait (the client went away) aborts them there.

        Raises:
            EngineDeadError: the prefill engine died, and so did the retry's (or no other
                prefill engine is left).
        """
        copies = [prefill_request(request) for request in requests]
        loop = asyncio.get_running_loop()
        failures: list[str] = []
        prefills: dict[str, _Prefill] = {}

        def track(engine: EngineConnection) -> None:
            # Before the first ADD: its finish may come back before the last one is sent.
            self._drop_prefills(prefills)
            for copy in copies:
                prefills[copy.request_id] = _Prefill(engine.engine_index, loop.create_future())
            self._prefills.update(prefills)
            self._num_in_flight[engine.engine_index] += len(copies)

        try:
            for _ in range(MAX_PREFILL_ATTEMPTS):
                engine = await self._route_and_send(copies, self.prefill_ids, track)
                logger.debug(
                    "prefill %s -> engine core %d", copies[0].request_id, engine.engine_index
                )
                reasons = await asyncio.gather(*(p.done for p in prefills.values()))
                reason = next((r for r in reasons if r is not None), None)
                if reason is None:
                    return
                failures.append(reason)
                if self.dead_reason is not None or not self._live_ids(self.prefill_ids):
                    break
                logger.warning(
                    "prefill of %s failed (%s); retrying on another prefill engine core",
                    requests[0].request_id,
                    reason,
                )
        finally:
            await self._abort_prefills(prefills)
        left = "the retry failed too" if len(failures) > 1 else "no prefill engine core is left"
        raise EngineDeadError(
            f"the prefill of request {requests[0].request_id} failed: {failures[0]}; {left}"
        )

    def _end_prefill(self, prefill_id: str, dead_reason: str | None) -> None:
        prefill = self._prefills.pop(prefill_id, None)
        if prefill is None:
            return
        self._num_in_flight[prefill.engine_index] -= 1
        if not prefill.done.done():
            prefill.done.set_result(dead_reason)

    def _drop_prefills(self, prefills: dict[str, _Prefill]) -> None:
        for prefill_id in prefills:
            self._end_prefill(prefill_id, None)
        prefills.clear()

    async def _abort_prefills(self, prefills: dict[str, _Prefill]) -> None:
        """Abort the copies still running (the wait for them was cancelled)."""
        running = [pid for pid, p in prefills.items() if self._prefills.get(pid) is p]
        by_engine: dict[int, list[str]] = {}
        for prefill_id in running:
            by_engine.setdefault(prefills[prefill_id].engine_index, []).append(prefill_id)
        self._drop_prefills(prefills)
        for engine_index, prefill_ids in by_engine.items():
            engine = self.engines[engine_index]
            if engine.is_alive and self.dead_reason is None:
                try:
                    await self._send(engine, MsgType.ABORT, prefill_ids)
                except EngineDeadError:
                    pass  # a dead engine holds nothing to abort

    def _engine_index_of(self, engine_request_id: str) -> int:
        return self._child_engine.get(engine_request_id, 0)

    def _forget_request(self, request_id: str, child_ids: list[str]) -> None:
        for child_id in child_ids:
            engine_index = self._child_engine.pop(child_id, None)
            if engine_index is not None:
                self.engines[engine_index].request_ids.discard(request_id)
                self._num_in_flight[engine_index] -= 1

    async def _send_abort(self, engine_request_ids: list[str]) -> None:
        by_engine: dict[int, list[str]] = {}
        for child_id in engine_request_ids:
            engine_index = self._child_engine.get(child_id)
            if engine_index is not None:
                by_engine.setdefault(engine_index, []).append(child_id)
        for engine_index, child_ids in by_engine.items():
            engine = self.engines[engine_index]
            if engine.is_alive:  # a dead engine holds nothing to abort
                await self._send(engine, MsgType.ABORT, child_ids)

    async def _send(self, engine: EngineConnection, msg_type: MsgType, payload: Any) -> None:
        if engine.dead_reason is not None:
            raise EngineDeadError(engine.dead_reason)
        frames = [engine.identity, *self._encoder.encode(msg_type, payload)]
        try:
            await self.channel.input_socket.send_multipart(frames, copy=False)
        except zmq.ZMQError as exc:  # EHOSTUNREACH: the engine's DEALER is gone
            dead_process = engine.find_dead_process()
            reason = (
                f"{dead_process} died"
                if dead_process is not None
                else f"engine core {engine.engine_index} is unreachable: {exc}"
            )
            self._engine_died(engine, reason)
            raise EngineDeadError(engine.dead_reason or reason) from exc

    async def _handle_outputs(self, outputs: EngineCoreOutputs) -> None:
        engine = self.engines.get(outputs.engine_index)
        if engine is not None and outputs.scheduler_stats is not None:
            engine.on_stats(outputs.scheduler_stats)
        if self._prefills:
            # Prefill copies end here; the OutputProcessor does not know their ids and
            # drops their outputs.
            for output in outputs.outputs:
                if output.finished and output.request_id in self._prefills:
                    if output.error is not None:
                        logger.warning(
                            "prefill %s failed in the engine (%s); the decode engine "
                            "computes the prompt itself",
                            output.request_id,
                            output.error,
                        )
                    self._end_prefill(output.request_id, None)
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
                    self._resolve_utility(payload, now)
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

    def _resolve_utility(self, output: UtilityOutput, now: float) -> None:
        engine_index, future = self._utility_futures.pop(output.call_id, (None, None))
        if engine_index is not None:
            self.engines[engine_index].on_message(now, progress=True)
        if future is None or future.done():
            return  # the caller timed out or went away
        if output.failure_message is not None:
            future.set_exception(RuntimeError(f"engine utility failed: {output.failure_message}"))
        else:
            future.set_result(output.result)

    async def _watch_liveness(self) -> None:
        while self.dead_reason is None:
            await asyncio.sleep(self.heartbeat_interval_s)
            # Messages already waiting mean the engines spoke and this loop was busy.
            waiting = self.channel.output_socket.get(zmq.EVENTS) & zmq.POLLIN
            now = time.monotonic()
            for engine in list(self.engines.values()):
                if not engine.is_alive:
                    continue
                dead_process = engine.find_dead_process()
                if dead_process is not None:
                    self._engine_died(engine, f"{dead_process} died")
                    continue
                try:  # engines that are not our children watch for these
                    await self._send(engine, MsgType.FRONTEND_HEARTBEAT, None)
                except EngineDeadError:
                    continue
                silence_s = now - engine.last_message_time
                if silence_s > self.heartbeat_timeout_s and not waiting:
                    self._engine_died(
                        engine,
                        f"engine core {engine.engine_index} sent nothing "
                        f"for {silence_s:.1f} s: its process is gone or "
                        f"frozen",
                    )

    async def _receive_load_tables(self, load_table_addr: str) -> None:
        """Feed the coordinator's load tables to the router."""
        socket = make_socket(self.channel.ctx, load_table_addr, zmq.SUB, bind=False)
        decoder = msgspec.msgpack.Decoder(LoadTable)
        try:
            while True:
                try:
                    table = decoder.decode(await socket.recv())
                except msgspec.DecodeError as exc:
                    logger.error("dropped a malformed load table: %s", exc)
                    continue
                self.router.update_loads(table.loads)
        finally:
            socket.close()

    async def shutdown(self) -> None:
        """Stop the background tasks and close the sockets (the engine processes are the
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


def _pd_pools(engines: list[EngineConnection]) -> tuple[frozenset[int], frozenset[int]]:
    """(prefill engine indices, decode engine indices) by the roles the engines reported:
    kv_producers prefill, every other engine decodes. Both empty unless there are some
    of each (no P/D)."""
    prefill = frozenset(e.engine_index for e in engines if e.handshake.kv_role == "kv_producer")
    decode = frozenset(e.engine_index for e in engines) - prefill
    if not prefill or not decode:
        return frozenset(), frozenset()
    return prefill, decode


def _make_router(engines: list[EngineConnection], routing: DPRouting) -> DPRouter:
    """A router that hashes prompts as every engine does (they must agree)."""
    first = engines[0].handshake
    hashing = {
        (
            e.handshake.block_size,
            e.handshake.enable_prefix_caching,
            e.handshake.prefix_caching_hash_algo,
        )
        for e in engines
    }
    if routing == "prefix" and len(hashing) > 1:
        raise ValueError(
            f"prefix routing needs engine cores that hash blocks alike; they "
            f"report (block_size, prefix caching, hash algo) {sorted(hashing)}: "
            f"start them with the same --block-size and "
            f"--prefix-caching-hash-algo"
        )
    hash_fn = (
        get_hash_fn(first.prefix_caching_hash_algo)
        if routing == "prefix" and first.enable_prefix_caching
        else None
    )
    router = DPRouter(routing, first.block_size, hash_fn)
    for engine in engines:
        router.add_engine(
            engine.engine_index, engine.handshake.num_blocks, engine.handshake.kv_role
        )
    return router
