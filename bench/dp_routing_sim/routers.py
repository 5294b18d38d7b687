"""Routers: which engine gets a new request.

- `round_robin`: engine i % E, blind to load and cache.
- `load`: vLLM's DP rule. The front end holds a table of (waiting, running) per engine that
  the coordinator refreshes every ~100 ms; between refreshes it bumps `waiting` of the engine
  it just picked, so a burst spreads out. It picks the lowest score = 4 x waiting + running
  (first index on ties).
- `prefix`: the same table, plus a router-side record of which block hashes it sent where
  (one LRU per engine, as large as the engine's KV cache, since the router cannot see
  evictions). Among engines with score <= min score + slack it picks the one holding the
  longest prefix of the request's block-hash chain (lower score, then lower index, on ties);
  with no prefix anywhere within the bound it falls back to `load`.
"""

from __future__ import annotations

from collections import OrderedDict

from bench.dp_routing_sim.workload import SimRequest

ROUTER_NAMES = ("load", "prefix", "round_robin")


class RoundRobinRouter:
    name = "round_robin"
    needs_load_table = False

    def __init__(self, num_engines: int):
        self.num_engines = num_engines
        self._next = 0

    def route(self, request: SimRequest) -> int:
        engine_idx = self._next
        self._next = (self._next + 1) % self.num_engines
        return engine_idx


class LoadRouter:
    """Args:
        num_engines: engines in the fleet.
    """

    name = "load"
    needs_load_table = True

    def __init__(self, num_engines: int):
        self.num_waiting = [0] * num_engines
        self.num_running = [0] * num_engines

    def refresh(self, num_waiting: list[int], num_running: list[int]) -> None:
        """A new table from the coordinator (drops the local bumps)."""
        self.num_waiting = list(num_waiting)
        self.num_running = list(num_running)

    def scores(self) -> list[int]:
        return [4 * w + r for w, r in zip(self.num_waiting, self.num_running)]

    def route(self, request: SimRequest) -> int:
        scores = self.scores()
        engine_idx = scores.index(min(scores))
        self.num_waiting[engine_idx] += 1
        return engine_idx


class PrefixRouter(LoadRouter):
    """Args:
        num_engines: engines in the fleet.
        record_blocks: block hashes remembered per engine (LRU), ~ its KV blocks.
        slack: how far above the lowest score an engine may be and still win on prefix.
    """

    name = "prefix"

    def __init__(self, num_engines: int, record_blocks: int, slack: int):
        super().__init__(num_engines)
        self.record_blocks = record_blocks
        self.slack = slack
        self.records: list[OrderedDict[int, None]] = [OrderedDict()
                                                       for _ in range(num_engines)]
        self.engines_by_hash: dict[int, set[int]] = {}
        self.num_prefix_routed = 0

    def route(self, request: SimRequest) -> int:
        scores = self.scores()
        bound = min(scores) + self.slack
        eligible = {i for i, score in enumerate(scores) if score <= bound}
        holders = self._longest_prefix_holders(request.block_hashes, eligible)
        if holders:
            engine_idx = min(holders, key=lambda i: (scores[i], i))
            self.num_prefix_routed += 1
        else:
            engine_idx = scores.index(min(scores))
        self.num_waiting[engine_idx] += 1
        self._record(engine_idx, request.block_hashes)
        return engine_idx

    def _longest_prefix_holders(self, block_hashes: list[int], eligible: set[int]
                                ) -> set[int]:
        """Engines in `eligible` holding the longest recorded prefix of the chain."""
        alive = eligible
        longest: set[int] = set()
        for block_hash in block_hashes:
            holders = self.engines_by_hash.get(block_hash)
            if not holders:
                break
            alive = alive & holders
            if not alive:
                break
            longest = alive
        return longest

    def _record(self, engine_idx: int, block_hashes: list[int]) -> None:
        record = self.records[engine_idx]
        # Touch the chain's end first so that, as in the engine, it is forgotten first.
        for block_hash in reversed(block_hashes):
            if block_hash in record:
                record.move_to_end(block_hash)
                continue
            record[block_hash] = None
            self.engines_by_hash.setdefault(block_hash, set()).add(engine_idx)
        while len(record) > self.record_blocks:
            old_hash, _ = record.popitem(last=False)
            holders = self.engines_by_hash[old_hash]
            holders.discard(engine_idx)
            if not holders:
                del self.engines_by_hash[old_hash]


def make_router(name: str, num_engines: int, record_blocks: int, prefix_slack: int):
    """A router by name (see ROUTER_NAMES)."""
    if name == "round_robin":
        return RoundRobinRouter(num_engines)
    if name == "load":
        return LoadRouter(num_engines)
    if name == "prefix":
        return PrefixRouter(num_engines, record_blocks, prefix_slack)
    raise ValueError(f"unknown router {name!r}; choose from {', '.join(ROUTER_NAMES)}")
