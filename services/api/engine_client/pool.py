"""EnginePool: the engine cores behind one EngineChannel, and what the api books per engine.

Every other part of the multi-process client (routing, the P/D flow, liveness, utility
calls) reaches the engines through it: which engines live and serve, how many engine
requests each holds, which engine holds each engine request, and `send`, the one place
that puts a message on an engine's ROUTER identity.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import Any

import zmq

from kvserve.services.api.engine_client.client import EngineDeadError
from kvserve.services.api.engine_client.connection import EngineChannel, EngineConnection
from kvserve.shared.messages import EngineCoreRequest
from kvserve.shared.transport import MessageEncoder
from kvserve.shared.wire import MsgType


class EnginePool:
    """
    Args:
        channel: the bound sockets every engine talks to.
        engines: one EngineConnection per engine core.
        stall_timeout_s: how long a loop with work may make no progress and still serve.
        closed_reason: why the client takes no more requests (None while it does); the
            client's own `dead_reason`, read through this so that it has one owner.
        engine_lost: called with an engine found unreachable while sending to it (the
            client drops it, as for any other death).
    """

    def __init__(
        self,
        channel: EngineChannel,
        engines: list[EngineConnection],
        stall_timeout_s: float,
        closed_reason: Callable[[], str | None],
        engine_lost: Callable[[EngineConnection, str], None],
    ):
        self.channel = channel
        self.engines = {engine.engine_index: engine for engine in engines}
        self.stall_timeout_s = stall_timeout_s
        self.closed_reason = closed_reason
        self._engine_lost = engine_lost
        self._encoder = MessageEncoder()
        self.num_in_flight = {index: 0 for index in self.engines}  # engine requests per engine
        self.child_engine: dict[str, int] = {}  # engine-core request id -> engine index
        self.last_death: str | None = None  # the reason the last engine died

    # ------------------------------------------------------------------ who serves

    def sorted_engines(self) -> list[EngineConnection]:
        return [engine for _, engine in sorted(self.engines.items())]

    def live_ids(self, pool: Collection[int]) -> list[int]:
        """The indices of `pool` whose engine is alive."""
        return [index for index in pool if self.engines[index].is_alive]

    def serving_engines(self) -> list[EngineConnection]:
        """The engines that are alive and not stalled. Suspect ones (silent, maybe only
        slow) count: routing prefers the others (EngineRouting), and a server whose engines
        are all suspect still takes requests, which wait for them."""
        return [
            engine
            for engine in self.engines.values()
            if engine.state(self.stall_timeout_s) in ("serving", "suspect")
        ]

    def no_engine_error(self) -> EngineDeadError:
        return EngineDeadError(
            f"no engine core is serving (the last one died: {self.last_death}); waiting for "
            f"a restarted one"
        )

    # ------------------------------------------------------------------ books

    def assign(self, requests: list[EngineCoreRequest], engine: EngineConnection) -> None:
        """These engine requests run on `engine` now."""
        for request in requests:
            self.child_engine[request.request_id] = engine.engine_index
        self.num_in_flight[engine.engine_index] += len(requests)

    def forget(self, request_id: str, child_ids: list[str]) -> None:
        """The api request `request_id` ended: its children leave the books."""
        for child_id in child_ids:
            engine_index = self.child_engine.pop(child_id, None)
            if engine_index is not None:
                self.engines[engine_index].request_ids.discard(request_id)
                self.num_in_flight[engine_index] -= 1

    def mark_dead(self, engine: EngineConnection, reason: str) -> None:
        engine.dead_reason = reason
        self.last_death = reason

    def drop_books(self, engine_index: int) -> None:
        """A dead engine's children leave the books, so that a successor of the same index
        starts from zero (their generators' own clean-up finds nothing to undo or abort)."""
        for child_id, index in list(self.child_engine.items()):
            if index == engine_index:
                del self.child_engine[child_id]
        self.num_in_flight[engine_index] = 0

    def replace(self, engine: EngineConnection) -> None:
        """A new process takes the engine's index (its predecessor is dead)."""
        self.engines[engine.engine_index] = engine
        self.num_in_flight[engine.engine_index] = 0

    # ------------------------------------------------------------------ sending

    async def send(self, engine: EngineConnection, msg_type: MsgType, payload: Any) -> None:
        """Send one message to `engine`.

        Raises:
            EngineDeadError: the engine is dead, or unreachable now (then it is dropped).
        """
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
            self._engine_lost(engine, reason)
            raise EngineDeadError(engine.dead_reason or reason) from exc

    async def abort(self, engine_request_ids: list[str]) -> None:
        """Abort engine requests on the live engines that hold them."""
        by_engine: dict[int, list[str]] = {}
        for child_id in engine_request_ids:
            engine_index = self.child_engine.get(child_id)
            if engine_index is not None:
                by_engine.setdefault(engine_index, []).append(child_id)
        for engine_index, child_ids in by_engine.items():
            engine = self.engines[engine_index]
            if engine.is_alive:  # a dead engine holds nothing to abort
                await self.send(engine, MsgType.ABORT, child_ids)
