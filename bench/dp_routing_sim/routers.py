"""Routers: which engine gets a new request.

`load` and `prefix` are the shipped router, kvserve.services.api.engine_client.dp_router.DPRouter,
built as the api builds it (make_router in services/api/engine_client/routing.py: the engines' block
size and hash function, one `add_engine` per engine with its KV blocks) and driven through its own
API: `choose` with the prompt's token ids, `update_loads` with the coordinator's load table. Nothing
of its rule (scores, tie-breaks, prefix slack, hashing, its per-engine record) is repeated here.

`round_robin` is a baseline of this simulator only; kvserve ships no such policy.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from kvserve.services.api.engine_client import dp_router
from kvserve.services.api.engine_client.dp_router import DPRouter
from kvserve.shared.hashing import HashFn
from kvserve.shared.wire import EngineLoad

ROUTER_NAMES = ("load", "prefix", "round_robin")


class RoundRobinRouter:
    """Engine i % E for the i-th request, blind to load and cache: a baseline that is not
    shipped logic. It takes the same calls as DPRouter so the simulator drives both alike.

    Args:
        num_engines: engines in the fleet.
    """

    def __init__(self, num_engines: int):
        self.num_engines = num_engines
        self._next = 0

    def update_loads(self, loads: Iterable[EngineLoad]) -> None:
        pass  # blind to load

    def choose(self, prompt_token_ids: Sequence[int]) -> int:
        engine_idx = self._next
        self._next = (self._next + 1) % self.num_engines
        return engine_idx


def make_router(
    name: str,
    num_engines: int,
    num_blocks: int,
    block_size: int,
    hash_fn: HashFn,
    prefix_slack: int | None = None,
) -> DPRouter | RoundRobinRouter:
    """A router by name (see ROUTER_NAMES).

    Args:
        name: "load", "prefix" (the shipped DPRouter) or "round_robin" (the baseline).
        num_engines: engines 0 .. num_engines - 1.
        num_blocks: each engine's KV blocks, as its READY handshake reports them.
        block_size, hash_fn: the engines' hashing, which the prefix router repeats.
        prefix_slack: an override of the shipped PREFIX_LOAD_SLACK; None keeps it.
    """
    if name == "round_robin":
        return RoundRobinRouter(num_engines)
    if name not in ("load", "prefix"):
        raise ValueError(f"unknown router {name!r}; choose from {', '.join(ROUTER_NAMES)}")
    # Read at call time, not bound as DPRouter's default argument is at import, so a change
    # of the shipped constant (or a test's monkeypatch) reaches the simulation.
    if prefix_slack is None:
        prefix_slack = dp_router.PREFIX_LOAD_SLACK
    # As the api does: only prefix routing hashes prompts.
    router = DPRouter(
        name, block_size, hash_fn if name == "prefix" else None, prefix_slack=prefix_slack
    )
    for engine_idx in range(num_engines):
        router.add_engine(engine_idx, num_blocks)
    return router
