"""PDFlow: prefill/decode disaggregation, on when the engines' READY report both
kv_producers and other roles (the client picks its flow once, at start-up: make_flow).

    send ─▶ prefill copy ("{child id}-prefill", max_tokens 1) ─▶ a kv_producer engine
         ◀─ its finish (output dropped; its KV blocks are in the store now)
         ─▶ the request itself ─▶ a consumer (kv_consumer, kv_both or no role) ─▶ stream

Each stage picks the least loaded engine of its pool (EngineRouting, restricted to the
pool). A client that goes away during the prefill aborts it on the prefill engine (the
decode is never sent); during the decode, on the decode engine. A prefill engine that dies
is retried once on another live one; with none left `send` raises EngineDeadError, which
MPEngineClient._submit holds for the restarted prefill engine when engines restart
(--migration-wait-s; the whole send, prefill first, is tried again), else a 503. Once a
pool has no live engine the client is dead, as when no engine at all is left, unless it
waits for restarts.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import msgspec

from kvserve.services.api.engine_client.client import EngineDeadError
from kvserve.services.api.engine_client.connection import EngineConnection
from kvserve.services.api.engine_client.pool import EnginePool
from kvserve.services.api.engine_client.routing import (
    DirectFlow,
    EngineRouting,
    RequestFlow,
    engines_status,
)
from kvserve.shared.logging import init_logger
from kvserve.shared.messages import EngineCoreOutputs, EngineCoreRequest
from kvserve.shared.sampling_params import SamplingParams
from kvserve.shared.wire import MsgType

logger = init_logger(__name__)

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


def pd_pools(engines: list[EngineConnection]) -> tuple[frozenset[int], frozenset[int]]:
    """(prefill engine indices, decode engine indices) by the roles the engines reported:
    kv_producers prefill, every other engine decodes. Both empty unless there are some
    of each (no P/D)."""
    prefill = frozenset(e.engine_index for e in engines if e.handshake.kv_role == "kv_producer")
    decode = frozenset(e.engine_index for e in engines) - prefill
    if not prefill or not decode:
        return frozenset(), frozenset()
    return prefill, decode


def make_flow(pool: EnginePool, routing: EngineRouting) -> RequestFlow:
    """PDFlow when the engines' roles make two pools, else DirectFlow."""
    prefill_ids, decode_ids = pd_pools(pool.sorted_engines())
    if not prefill_ids:
        return DirectFlow(routing)
    logger.info(
        "P/D disaggregation: prefill engine cores %s, decode engine cores %s",
        sorted(prefill_ids),
        sorted(decode_ids),
    )
    return PDFlow(pool, routing, prefill_ids, decode_ids)


class PDFlow:
    """
    Args:
        pool: the engines.
        routing: picks an engine within a stage's pool.
        prefill_ids: the kv_producer engines, which run the prefill copies.
        decode_ids: the other engines, which run the requests themselves.
    """

    def __init__(
        self,
        pool: EnginePool,
        routing: EngineRouting,
        prefill_ids: frozenset[int],
        decode_ids: frozenset[int],
    ):
        self.pool = pool
        self.routing = routing
        self.prefill_ids = prefill_ids
        self.decode_ids = decode_ids
        self.prefills: dict[str, _Prefill] = {}  # prefill copy id -> where it runs

    async def send(self, requests: list[EngineCoreRequest]) -> EngineConnection:
        await self._prefill(requests)
        return await self.routing.route_and_send(requests, self.decode_ids)

    def on_outputs(self, outputs: EngineCoreOutputs) -> None:
        if not self.prefills:
            return
        # Prefill copies end here; the OutputProcessor does not know their ids and drops
        # their outputs.
        for output in outputs.outputs:
            if output.finished and output.request_id in self.prefills:
                if output.error is not None:
                    logger.warning(
                        "prefill %s failed in the engine (%s); the decode engine computes "
                        "the prompt itself",
                        output.request_id,
                        output.error,
                    )
                self._end_prefill(output.request_id, None)

    def on_engine_died(self, engine_index: int, reason: str) -> None:
        for prefill_id, prefill in list(self.prefills.items()):
            if prefill.engine_index == engine_index:
                self._end_prefill(prefill_id, reason)  # retried elsewhere, or fails

    def serves(self, serving_ids: set[int]) -> bool:
        """Some prefill engine and some decode engine serve."""
        return bool(serving_ids & self.prefill_ids and serving_ids & self.decode_ids)

    def lost_stage(self) -> str | None:
        for stage, pool in (("prefill", self.prefill_ids), ("decode", self.decode_ids)):
            if not self.pool.live_ids(pool):
                return stage
        return None

    def health_status(self, num_serving: int, num_engines: int, client_healthy: bool) -> str:
        # Unhealthy when one of the two stages has no engine.
        return engines_status(num_serving, num_engines, client_healthy)

    # ------------------------------------------------------------------ prefill

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
            self.prefills.update(prefills)
            self.pool.num_in_flight[engine.engine_index] += len(copies)

        try:
            for _ in range(MAX_PREFILL_ATTEMPTS):
                engine = await self.routing.route_and_send(copies, self.prefill_ids, track)
                logger.debug(
                    "prefill %s -> engine core %d", copies[0].request_id, engine.engine_index
                )
                reasons = await asyncio.gather(*(p.done for p in prefills.values()))
                reason = next((r for r in reasons if r is not None), None)
                if reason is None:
                    return
                failures.append(reason)
                if self.pool.closed_reason() is not None or not self.pool.live_ids(
                    self.prefill_ids
                ):
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
        prefill = self.prefills.pop(prefill_id, None)
        if prefill is None:
            return
        self.pool.num_in_flight[prefill.engine_index] -= 1
        if not prefill.done.done():
            prefill.done.set_result(dead_reason)

    def _drop_prefills(self, prefills: dict[str, _Prefill]) -> None:
        for prefill_id in prefills:
            self._end_prefill(prefill_id, None)
        prefills.clear()

    async def _abort_prefills(self, prefills: dict[str, _Prefill]) -> None:
        """Abort the copies still running (the wait for them was cancelled)."""
        running = [pid for pid, p in prefills.items() if self.prefills.get(pid) is p]
        by_engine: dict[int, list[str]] = {}
        for prefill_id in running:
            by_engine.setdefault(prefills[prefill_id].engine_index, []).append(prefill_id)
        self._drop_prefills(prefills)
        for engine_index, prefill_ids in by_engine.items():
            engine = self.pool.engines[engine_index]
            if engine.is_alive and self.pool.closed_reason() is None:
                try:
                    await self.pool.send(engine, MsgType.ABORT, prefill_ids)
                except EngineDeadError:
                    pass  # a dead engine holds nothing to abort
