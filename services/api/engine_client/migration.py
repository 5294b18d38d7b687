"""RequestMigrator: the requests of an engine core that died move on to a live one.

When an engine core dies (its process, one of its workers, or a hang past the hung budget),
MPEngineClient hands the api requests it held here instead of failing them. Each unfinished
child is sent again, as it was first sent but with `resumed_output_token_ids` = the tokens
the api already has of it, to the engine the request flow picks (with P/D: a prefill copy
first, as for any request). The new engine recomputes prompt + those tokens (loading the
blocks a KV store holds as external hits) and emits only what follows, with the
sampling state carried over (the seeded generator past its draws, the grammar and the
thinking replayed), so the client's stream goes on with no gap, no repeat and no error.

    engine dies ─▶ move(request ids) ─▶ a task per request ─▶ flow.send(resumed children)
                                          └─ no live engine: wait for one (restarts), up to
                                             --migration-wait-s, then fail as before

What cannot move fails with EngineDeadError naming why:
- a request that may be the cause: each death that came before it produced anything on
  that engine counts (a request that crashes engines crashes them while they compute it),
  and past --max-request-migrations such deaths it is quarantined. A bystander (it was
  streaming there) moves without counting, BYSTANDER_MOVES_PER_LIMIT times the limit at
  most;
- no engine came back within --migration-wait-s; the api is shutting down.
An engine declared dead that is still running (a hang that ends) may go on sending outputs
for a moved child: the client drops every output of a moved child that does not come from
the engine that holds it now (`is_stale`).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import msgspec

from kvserve.services.api.engine_client.client import EngineDeadError
from kvserve.services.api.engine_client.pool import EnginePool
from kvserve.services.api.observability.stats import MigrationStats
from kvserve.services.api.observability.tracing import process_tracer
from kvserve.services.api.serving.output_processor import OutputProcessor
from kvserve.shared.logging import init_logger
from kvserve.shared.messages import EngineCoreRequest

logger = init_logger(__name__)

BYSTANDER_MOVES_PER_LIMIT = 3
_RETRY_INTERVAL_S = 0.25  # how often a move waiting for an engine tries again


def death_kind(reason: str) -> str:
    """The `reason` label of kvserve:request_migrations_total for one death's reason text:
    worker_died, engine_hung, engine_replaced or engine_died."""
    if "worker" in reason:
        return "worker_died"
    if "hung" in reason:
        return "engine_hung"
    if "replaced" in reason:
        return "engine_replaced"
    return "engine_died"


@dataclass(slots=True)
class _Moves:
    suspect: int = 0  # deaths before it produced anything on that engine
    total: int = 0


class RequestMigrator:
    """
    Args:
        pool: the engines and their books.
        output_processor: what the api holds of each request (prompt, emitted tokens).
        send: sends a request's children (the client's `_send_requests`: the flow, the
            books); raises EngineDeadError when no engine can take them.
        fail: ends one api request with EngineDeadError(reason).
        max_migrations: --max-request-migrations (0: never move).
        wait_s: --migration-wait-s, how long a move waits for a live engine.
    """

    def __init__(
        self,
        pool: EnginePool,
        output_processor: OutputProcessor,
        send: Callable[[list[EngineCoreRequest]], Awaitable[None]],
        fail: Callable[[str, str], None],
        max_migrations: int,
        wait_s: float,
    ):
        self.pool = pool
        self.output_processor = output_processor
        self._send = send
        self._fail = fail
        self.max_migrations = max_migrations
        self.wait_s = wait_s
        self.sent: dict[str, EngineCoreRequest] = {}  # child id -> as last sent
        self._moves: dict[str, _Moves] = {}  # api request id -> its moves so far
        self.moved_children: set[str] = set()  # children sent again (checked by is_stale)
        # child id -> (when its engine died, that engine's index)
        self._resuming: dict[str, tuple[float, int]] = {}
        self._tasks: set[asyncio.Task] = set()
        self.stats: dict[int, MigrationStats] = {}  # by the index of the engine that died

    # ------------------------------------------------------------------ books

    def on_sent(self, requests: list[EngineCoreRequest]) -> None:
        for request in requests:
            self.sent[request.request_id] = request

    def forget(self, request_id: str, child_ids: list[str]) -> None:
        self._moves.pop(request_id, None)
        for child_id in child_ids:
            self.sent.pop(child_id, None)
            self.moved_children.discard(child_id)
            self._resuming.pop(child_id, None)

    def is_stale(self, child_id: str, engine_index: int) -> bool:
        """An output of a moved child from an engine other than the one holding it now."""
        return (
            child_id in self.moved_children and self.pool.child_engine.get(child_id) != engine_index
        )

    def on_output(self, child_id: str, now: float) -> None:
        """A child's output arrived (call only while `resuming`)."""
        resuming = self._resuming.pop(child_id, None)
        if resuming is not None:
            died_at, engine_index = resuming
            self._stats(engine_index).observe_resume(now - died_at)

    @property
    def resuming(self) -> bool:
        return bool(self._resuming)

    # ------------------------------------------------------------------ moving

    def _stats(self, engine_index: int) -> MigrationStats:
        stats = self.stats.get(engine_index)
        if stats is None:
            stats = self.stats[engine_index] = MigrationStats()
        return stats

    def move(self, request_ids: list[str], engine_index: int, reason: str) -> None:
        """Engine `engine_index`, which held these api requests, died (`reason`): move
        each, or fail it."""
        stats = self._stats(engine_index)
        died_at = time.monotonic()
        kind = death_kind(reason)
        reason = reason.splitlines()[0]  # one log line per request (not a traceback each)
        for request_id in request_ids:
            parent = self.output_processor.parents.get(request_id)
            if parent is None:
                continue  # it ended meanwhile
            if self.max_migrations == 0:
                self._fail(request_id, reason)
                continue
            moves = self._moves.setdefault(request_id, _Moves())
            produced = any(
                len(child.completion.token_ids) > self._num_resumed(child_id)
                for child_id, child in parent.children.items()
            )
            moves.total += 1
            moves.suspect += not produced
            refusal = self._refusal(moves)
            if refusal is not None:
                stats.quarantined += 1
                logger.error(
                    "request %s is quarantined: %s (its engine core died: %s)",
                    request_id,
                    refusal,
                    reason,
                )
                self._fail(
                    request_id,
                    f"request quarantined: {refusal}; the last engine core died: {reason}",
                )
                continue
            stats.moves[kind] = stats.moves.get(kind, 0) + 1
            task = asyncio.get_running_loop().create_task(
                self._move(request_id, reason, died_at, engine_index),
                name=f"migrate-{request_id}",
            )
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    def _refusal(self, moves: _Moves) -> str | None:
        if moves.suspect > self.max_migrations:
            return (
                f"{moves.suspect} engine cores died before it produced a token there (at most "
                f"{self.max_migrations} moves, --max-request-migrations): it may crash them"
            )
        cap = BYSTANDER_MOVES_PER_LIMIT * self.max_migrations
        if moves.total > cap:
            return f"it was on {moves.total} engine cores that died (at most {cap} moves)"
        return None

    def _num_resumed(self, child_id: str) -> int:
        sent = self.sent.get(child_id)
        return len(sent.resumed_output_token_ids) if sent is not None else 0

    def _resumed_children(self, request_id: str) -> list[EngineCoreRequest]:
        """The request's unfinished children, as they go to a new engine (none once the
        request ended or all its children did)."""
        parent = self.output_processor.parents.get(request_id)
        if parent is None:
            return []
        resumed = []
        for child_id, child in parent.children.items():
            sent = self.sent.get(child_id)
            if child.completion.finished() or sent is None:
                continue
            params = sent.sampling_params
            if params.prompt_logprobs is not None:
                if parent.prompt_logprobs is not None and len(parent.prompt_logprobs) >= len(
                    parent.prompt_token_ids
                ):
                    params = msgspec.structs.replace(params, prompt_logprobs=None)  # all sent
                else:
                    parent.prompt_logprobs = [None]  # computed again, from the start
            resumed.append(
                msgspec.structs.replace(
                    sent,
                    sampling_params=params,
                    resumed_output_token_ids=list(child.completion.token_ids),
                )
            )
        return resumed

    async def _move(self, request_id: str, reason: str, died_at: float, engine_index: int) -> None:
        deadline = died_at + self.wait_s
        while True:
            children = self._resumed_children(request_id)
            if not children or self.pool.closed_reason() is not None:
                return
            for child in children:  # before the send: its first output may come at once
                self.moved_children.add(child.request_id)
                self._resuming[child.request_id] = (died_at, engine_index)
            try:
                await self._send(children)
            except EngineDeadError as exc:
                if time.monotonic() < deadline and self.pool.closed_reason() is None:
                    await asyncio.sleep(_RETRY_INTERVAL_S)
                    continue
                self._stats(engine_index).failed += 1
                self._fail(
                    request_id,
                    f"its engine core died ({reason}) and no engine core took it within "
                    f"{self.wait_s:g} s (--migration-wait-s): {exc}",
                )
                return
            break
        child_ids = [child.request_id for child in children]
        if request_id not in self.output_processor.parents:
            # It ended (the client went away) while it was being sent: undo that.
            await self.pool.abort(child_ids)
            self.pool.forget(request_id, child_ids)
            self.forget(request_id, child_ids)
            return
        self._trace_move(children, died_at, engine_index, reason)
        logger.info(
            "request %s moved to engine core %s with %s emitted tokens (%.2f s after its "
            "engine core died: %s)",
            request_id,
            self.pool.child_engine.get(child_ids[0]),
            "+".join(str(len(c.resumed_output_token_ids)) for c in children),
            time.monotonic() - died_at,
            reason,
        )

    def _trace_move(
        self, children: list[EngineCoreRequest], died_at: float, engine_index: int, reason: str
    ) -> None:
        """A traced request's move (--otlp-traces-endpoint): a `migrate` span under its
        `generate` span, from the engine's death to the resend."""
        tracer = process_tracer()
        if tracer is None:
            return
        end_ns = time.time_ns()
        start_ns = end_ns - int((time.monotonic() - died_at) * 1e9)
        for child in children:
            if child.trace_context is not None:
                tracer.add_span(
                    "migrate",
                    child.trace_context,
                    start_ns,
                    end_ns,
                    request_id=child.request_id,
                    from_engine=engine_index,
                    to_engine=self.pool.child_engine.get(child.request_id, -1),
                    reason=death_kind(reason),
                    resumed_tokens=len(child.resumed_output_token_ids or ()),
                )

    async def shutdown(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
