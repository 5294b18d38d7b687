"""Which engine core a request goes to, and the plain (data-parallel) request flow.

EngineRouting picks the least loaded serving engine (the DPRouter, fed by the DP
coordinator's load tables when there is one, by the api's own counts while it is lost:
load_tables.py) among those whose queue has room, and sends
there, moving on to another engine when the chosen one turns out unreachable. With the fair
policy the load tables carry each engine's tenant counters, and every engine gets the sum of
the others' (TenantService), so its scheduler sees the tenants' cluster-wide service. A suspect
engine (silent past the heartbeat timeout: liveness.py) gets no new request while
another engine of the pool serves; while none does, requests queue to it rather than fail.

A RequestFlow is how the n children of one request reach the engines; the client picks one
at start-up. DirectFlow sends them to one engine of all (this module); PDFlow runs a
prefill copy on a kv_producer first (pd_flow.py).
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import Protocol, cast

from kvserve.services.api.engine_client.cache_affinity import PROMPT_CACHE_KEY
from kvserve.services.api.engine_client.client import EngineDeadError, estimate_waiting, overloaded
from kvserve.services.api.engine_client.connection import EngineConnection
from kvserve.services.api.engine_client.dp_router import PREFIX_LOAD_SLACK, DPRouter, DPRouting
from kvserve.services.api.engine_client.load_tables import LoadTableFeed
from kvserve.services.api.engine_client.pool import EnginePool
from kvserve.shared.hashing import HashAlgo, get_hash_fn, make_extra_keys
from kvserve.shared.logging import init_logger
from kvserve.shared.lora import lora_extra_key
from kvserve.shared.messages import EngineCoreOutputs, EngineCoreRequest
from kvserve.shared.wire import EngineLoad, MsgType, TenantService

logger = init_logger(__name__)


class EngineRouting:
    """
    Args:
        pool: the engines.
        router: picks one of the candidate engines (see DPRouter).
    """

    def __init__(self, pool: EnginePool, router: DPRouter):
        self.pool = pool
        self.router = router
        # The DP coordinator's tables (None: no coordinator); set by the client.
        self.load_tables: LoadTableFeed | None = None

    def _num_waiting(self, engine: EngineConnection) -> int:
        return estimate_waiting(self.pool.num_in_flight[engine.engine_index], engine.latest_stats)

    def _candidates(self) -> list[EngineConnection]:
        """The serving engines new requests go to: those not suspect, or, while every one
        is, all of them."""
        serving = self.pool.serving_engines()
        return [engine for engine in serving if not engine.is_suspect] or serving

    def _engines_with_room(self, num_requests: int) -> list[EngineConnection]:
        """The candidate engines that can queue num_requests more within their
        --max-waiting-requests (an idle engine always can)."""
        return [
            engine
            for engine in self._candidates()
            if (num_waiting := self._num_waiting(engine)) == 0
            or num_waiting + num_requests <= engine.handshake.max_waiting_requests
        ]

    def check_capacity(self, num_requests: int) -> None:
        """Raise EngineOverloadedError when no candidate engine has room for num_requests."""
        serving = self._candidates()
        if serving and not self._engines_with_room(num_requests):
            engine = min(serving, key=self._num_waiting)
            raise overloaded(self._num_waiting(engine), engine.handshake.max_waiting_requests)

    def choose(
        self, requests: list[EngineCoreRequest], pool: Collection[int] | None
    ) -> EngineConnection:
        """The least loaded engine of `pool` (None: every engine) for these requests."""
        first = requests[0]
        if self.load_tables is not None:
            self.load_tables.refresh()
        # Engines with room first; when none has (a race with check_capacity), the
        # engine refuses past its bound itself.
        candidates = self._engines_with_room(len(requests)) or self._candidates()
        candidate_ids = [e.engine_index for e in candidates]
        if not candidate_ids and not self.pool.live_ids(self.pool.engines):
            raise self.pool.no_engine_error()
        if pool is not None:
            candidate_ids = [i for i in candidate_ids if i in pool] or self.pool.live_ids(pool)
            if not candidate_ids:
                raise EngineDeadError("no engine core of this stage is left")
        return self.pool.engines[
            self.router.choose(
                first.prompt_token_ids,
                make_extra_keys(first.cache_salt, lora_extra_key(first.lora_request)),
                candidate_ids=candidate_ids or None,
                ttft_ms=first.slo_ttft_ms,
                cache_key=PROMPT_CACHE_KEY.get(),
            )
        ]

    async def route_and_send(
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
            closed_reason = self.pool.closed_reason()
            if closed_reason is not None:
                raise EngineDeadError(closed_reason)
            engine = self.choose(requests, pool)
            if before_send is not None:
                before_send(engine)
            try:
                for request in requests:
                    await self.pool.send(engine, MsgType.ADD, request)
            except EngineDeadError:
                if not self.pool.live_ids(self.pool.engines if pool is None else pool):
                    raise
                continue  # unreachable before its heartbeats lapsed: try another engine
            if engine.is_suspect:
                # Chosen only because no engine of its pool serves: it waits for this one.
                logger.warning(
                    "request %s queued to suspect engine core %d (no engine of its pool "
                    "serves; it runs once that one speaks again)",
                    requests[0].request_id,
                    engine.engine_index,
                )
            return engine

    async def share_tenant_service(self, loads: list[EngineLoad]) -> None:
        """Hand each engine core the others' tenant counters (the fair policy's cluster
        view: fair_share.py); nothing to do while no engine reports any."""
        reporting = [load for load in loads if load.tenant_service]
        if not reporting:
            return
        for engine in self.pool.serving_engines():
            remote: dict[str, float] = {}
            for load in reporting:
                if load.engine_index != engine.engine_index:
                    for tenant, served in load.tenant_service.items():
                        remote[tenant] = remote.get(tenant, 0.0) + served
            try:
                await self.pool.send(engine, MsgType.TENANT_SERVICE, TenantService(remote))
            except EngineDeadError:
                continue  # its death is handled where it is noticed


def make_router(
    engines: list[EngineConnection], routing: DPRouting, prefix_slack: int = PREFIX_LOAD_SLACK
) -> DPRouter:
    """A router that hashes prompts as every engine does (they must agree); `prefix_slack`:
    --dp-prefix-slack."""
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
        get_hash_fn(cast(HashAlgo, first.prefix_caching_hash_algo))
        if routing == "prefix" and first.enable_prefix_caching
        else None
    )
    router = DPRouter(routing, first.block_size, hash_fn, prefix_slack)
    for engine in engines:
        router.add_engine(
            engine.engine_index, engine.handshake.num_blocks, engine.handshake.kv_role
        )
    return router


# --------------------------------------------------------------------------- request flows


class RequestFlow(Protocol):
    """How one request's children reach the engines, and what that needs to serve."""

    async def send(self, requests: list[EngineCoreRequest]) -> EngineConnection:
        """Send the children (they share a prompt: one engine gets them all); returns the
        engine that runs them."""
        ...

    def on_outputs(self, outputs: EngineCoreOutputs) -> None:
        """See one batch of outputs before the OutputProcessor does."""
        ...

    def on_engine_died(self, engine_index: int, reason: str) -> None:
        """An engine died: what this flow runs there ends."""
        ...

    def serves(self, serving_ids: set[int]) -> bool:
        """Whether these serving engines can serve a request."""
        ...

    def lost_stage(self) -> str | None:
        """A stage without a live engine (the client is dead then), or None."""
        ...

    def health_status(self, num_serving: int, num_engines: int, client_healthy: bool) -> str:
        """/health's "status": healthy, degraded or unhealthy."""
        ...


def engines_status(num_serving: int, num_engines: int, client_healthy: bool) -> str:
    """healthy: every engine serves; degraded: requests are taken, but some engine is not
    serving (dead, stalled, or suspect: then perhaps only slow); unhealthy: they are not."""
    if not client_healthy:
        return "unhealthy"
    return "healthy" if num_serving == num_engines else "degraded"


class DirectFlow:
    """Data parallelism (or one engine): the children go to the least loaded engine."""

    def __init__(self, routing: EngineRouting):
        self.routing = routing

    async def send(self, requests: list[EngineCoreRequest]) -> EngineConnection:
        return await self.routing.route_and_send(requests)

    def on_outputs(self, outputs: EngineCoreOutputs) -> None:
        pass

    def on_engine_died(self, engine_index: int, reason: str) -> None:
        pass

    def serves(self, serving_ids: set[int]) -> bool:
        return bool(serving_ids)

    def lost_stage(self) -> str | None:
        return None

    def health_status(self, num_serving: int, num_engines: int, client_healthy: bool) -> str:
        return engines_status(num_serving, num_engines, client_healthy)
