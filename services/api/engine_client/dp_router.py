"""DPRouter: which data-parallel engine core gets the next request.

`load` (default): the lowest score = 4 x waiting + running, vLLM's rule. The counts come from
the DP coordinator's load table (~every 100 ms); between two tables the router bumps its copy
of the chosen engine's waiting count, so a burst spreads instead of piling on one engine.
Ties go round-robin (vLLM takes the lowest index), so a light load, whose table reads all
zeros, still uses, and warms, every engine.

`prefix`: prefer the engine that already holds the longest run of the prompt's block-hash
chain, if its score is within PREFIX_LOAD_SLACK of the lowest; else fall back to `load`.
The router hashes prompts exactly as the engines do (shared/hashing.py, their block size and
hash algorithm from the READY handshake) and keeps, per engine, the hashes it routed there:
an LRU bounded by that engine's number of KV blocks, since the engine cannot cache more. It
is an estimate (the engine may have evicted a block since), which costs at worst one miss.

With a shared KV store (engines with a KV connector: `kv_role` from READY) the router also
keeps the hashes that engines which save to the store (kv_producer, kv_both) were sent: the
store's view, bounded by the engines' blocks together. An engine that loads from the store
(kv_consumer, kv_both) holds, for routing, the longer of its own chain and the store's: when
the store has the prefix every such engine does, so the least loaded one gets the request
instead of the one that computed it first.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Literal

from kvserve.services.api.engine_client.cache_affinity import CacheKeyAffinity
from kvserve.services.api.engine_client.slo_routing import engines_meeting_ttft
from kvserve.shared.hashing import HashFn, hash_new_full_blocks
from kvserve.shared.wire import EngineLoad

DPRouting = Literal["load", "prefix"]
WAITING_WEIGHT = 4  # a waiting request costs four running ones (vLLM's weight)
# How much higher than the lowest score the engine holding a prefix may be and still get the
# request: 8 = two requests waiting. A hit saves a whole prefill of the prefix, but queueing
# behind a popular prefix costs TTFT and TPOT: in the routing simulation of the shipped code
# (bench/RESULTS.md) 8 kept 16's hit rates with lower mean and P99 TTFT and TPOT.
PREFIX_LOAD_SLACK = 8


@dataclass(slots=True)
class _EngineView:
    """The router's picture of one engine core."""

    num_blocks: int
    saves_to_store: bool = False
    loads_from_store: bool = False
    num_waiting: int = 0
    num_running: int = 0
    predicted_delay_ms: float = 0.0  # the engine's predicted queue delay (slo_routing.py)
    # Block hashes routed here, least recently used first (values unused).
    cached_hashes: OrderedDict[bytes, None] = field(default_factory=OrderedDict)

    @property
    def score(self) -> int:
        return WAITING_WEIGHT * self.num_waiting + self.num_running

    def num_matched_blocks(self, block_hashes: Sequence[bytes]) -> int:
        """Leading blocks of the chain held here (a chain is only useful from its start)."""
        num_matched = 0
        for block_hash in block_hashes:
            if block_hash not in self.cached_hashes:
                break
            num_matched += 1
        return num_matched

    def remember(self, block_hashes: Sequence[bytes]) -> None:
        for block_hash in block_hashes:
            self.cached_hashes[block_hash] = None
            self.cached_hashes.move_to_end(block_hash)
        while len(self.cached_hashes) > self.num_blocks:
            self.cached_hashes.popitem(last=False)


class DPRouter:
    """
    Args:
        routing: "load" or "prefix" (see the module docstring).
        block_size: the engines' tokens per KV block.
        hash_fn: the engines' block hash function (None: prefix caching is off, so `prefix`
            routing degrades to `load`).
        prefix_slack: score margin within which a prefix holder is preferred.
    """

    def __init__(
        self,
        routing: DPRouting,
        block_size: int,
        hash_fn: HashFn | None,
        prefix_slack: int = PREFIX_LOAD_SLACK,
    ):
        if routing not in ("load", "prefix"):
            raise ValueError(f"unknown DP routing {routing!r}: use 'load' or 'prefix'")
        if prefix_slack < 0:
            raise ValueError(f"--dp-prefix-slack must be >= 0, got {prefix_slack}")
        assert block_size > 0, block_size
        self.routing = routing
        self.block_size = block_size
        self.hash_fn = hash_fn
        self.prefix_slack = prefix_slack
        self._engines: dict[int, _EngineView] = {}
        self._store = _EngineView(0)  # what engines saved to the shared KV store
        self._last_chosen = -1
        self.cache_key_affinity = CacheKeyAffinity(prefix_slack)  # prompt_cache_key

    @property
    def engine_indices(self) -> list[int]:
        return sorted(self._engines)

    def add_engine(self, engine_index: int, num_blocks: int, kv_role: str | None = None) -> None:
        """
        Args:
            kv_role: the engine's --kv-transfer-config role (None: no KV connector).
        """
        assert engine_index not in self._engines, engine_index
        self._engines[engine_index] = _EngineView(
            num_blocks,
            saves_to_store=kv_role in ("kv_producer", "kv_both"),
            loads_from_store=kv_role in ("kv_consumer", "kv_both"),
        )
        self._store.num_blocks = sum(view.num_blocks for view in self._engines.values())

    def remove_engine(self, engine_index: int) -> None:
        """A dead engine gets no more requests."""
        self._engines.pop(engine_index, None)

    def score(self, engine_index: int) -> int:
        return self._engines[engine_index].score

    def update_loads(self, loads: Iterable[EngineLoad]) -> None:
        """A new load table from the coordinator replaces the local estimates."""
        for load in loads:
            view = self._engines.get(load.engine_index)
            if view is not None:
                view.num_waiting, view.num_running = load.num_waiting, load.num_running
                view.predicted_delay_ms = load.predicted_queue_delay_ms

    def block_hashes(
        self, prompt_token_ids: Sequence[int], extra_keys: bytes | None = None
    ) -> list[bytes]:
        """The prompt's full-block hash chain, as the engines compute it (prefix mode only)."""
        if self.routing != "prefix" or self.hash_fn is None:
            return []
        return hash_new_full_blocks(self.hash_fn, self.block_size, prompt_token_ids, [], extra_keys)

    def choose(
        self,
        prompt_token_ids: Sequence[int],
        extra_keys: bytes | None = None,
        candidate_ids: Iterable[int] | None = None,
        ttft_ms: float | None = None,
        cache_key: str | None = None,
    ) -> int:
        """Pick the engine for one request and count it there until the next load table.

        Args:
            prompt_token_ids: the request's prompt.
            extra_keys: the request's extra hash keys (cache salt), as the engine mixes them.
            candidate_ids: engines that may take it (default: every engine in the router).
            ttft_ms: the request's TTFT target: engines predicted to meet it come first.
            cache_key: its prompt_cache_key, whose engine it goes to while load allows
                (cache_affinity.py).
        """
        candidates = sorted(
            self._engines
            if candidate_ids is None
            else (i for i in candidate_ids if i in self._engines)
        )
        if not candidates:
            raise ValueError("no engine core can take requests: every engine is dead")
        candidates = engines_meeting_ttft(
            candidates, lambda i: self._engines[i].predicted_delay_ms, ttft_ms
        )
        block_hashes = self.block_hashes(prompt_token_ids, extra_keys)
        # Ties: the next index after the last chosen one, wrapping around.
        chosen = min(candidates, key=lambda i: (self.score(i), i <= self._last_chosen, i))
        if block_hashes:
            chosen = self._prefer_prefix_holder(candidates, chosen, block_hashes)
        if cache_key is not None:
            chosen = self.cache_key_affinity.choose(cache_key, candidates, chosen, self.score)
        self._last_chosen = chosen
        view = self._engines[chosen]
        view.num_waiting += 1
        view.remember(block_hashes)
        if view.saves_to_store:
            self._store.remember(block_hashes)
        return chosen

    def num_matched_blocks(self, engine_index: int, block_hashes: Sequence[bytes]) -> int:
        """Leading blocks of the chain that engine has or can load from the store."""
        view = self._engines[engine_index]
        matched = view.num_matched_blocks(block_hashes)
        if view.loads_from_store and self._store.cached_hashes:
            matched = max(matched, self._store.num_matched_blocks(block_hashes))
        return matched

    def _prefer_prefix_holder(
        self, candidate_ids: list[int], least_loaded: int, block_hashes: list[bytes]
    ) -> int:
        """The engine with the most leading blocks among those within the slack; the least
        loaded engine when nobody holds any."""
        max_score = self.score(least_loaded) + self.prefix_slack
        best, best_key = least_loaded, (0, -self.score(least_loaded))
        for engine_index in candidate_ids:
            view = self._engines[engine_index]
            if view.score > max_score:
                continue
            key = (self.num_matched_blocks(engine_index, block_hashes), -view.score)
            if key > best_key:
                best, best_key = engine_index, key
        return best
