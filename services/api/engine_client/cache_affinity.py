"""DP affinity for OpenAI's `prompt_cache_key`: requests that name the same key go to the
same engine core while its load allows, so their shared prefix is cached there.

The first request of a key goes where the router would send it anyway (least loaded, or the
prefix holder) and the key remembers that engine. A later request of the key goes back to
it unless its score (4 x waiting + running) is more than `slack` above the least loaded
candidate's: then the request spills to the least loaded engine, which the key follows from
then on. Keys are kept in an LRU of `max_keys`.

The surface puts the handled request's key in PROMPT_CACHE_KEY (a context variable, as the
latency targets are), which EngineRouting reads when it asks the DPRouter for an engine.
"""

from __future__ import annotations

import contextvars
from collections import OrderedDict
from collections.abc import Callable, Sequence

from kvserve.shared.logging import init_logger

logger = init_logger(__name__)

# The handled request's prompt_cache_key (None: none); set by the surface.
PROMPT_CACHE_KEY: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "kvserve_prompt_cache_key", default=None
)


class CacheKeyAffinity:
    """
    Args:
        slack: how far above the least loaded candidate's score the key's engine may be
            and still get the request.
        max_keys: keys remembered (least recently used forgotten first).
    """

    def __init__(self, slack: int, max_keys: int = 65536):
        self.slack = slack
        self.max_keys = max_keys
        self._engine_of: OrderedDict[str, int] = OrderedDict()

    def choose(
        self,
        cache_key: str,
        candidate_ids: Sequence[int],
        default: int,
        score: Callable[[int], int],
    ) -> int:
        """The engine for a request of `cache_key`.

        Args:
            candidate_ids: the engines that may take it.
            default: the router's own choice among them.
            score: an engine's load score.
        """
        engine = self._engine_of.get(cache_key)
        least = min(score(i) for i in candidate_ids)
        if engine is None or engine not in candidate_ids or score(engine) > least + self.slack:
            if engine is not None:
                logger.info(
                    "prompt_cache_key %r moves from engine %d to %d (load)",
                    cache_key,
                    engine,
                    default,
                )
            engine = default
        self._engine_of[cache_key] = engine
        self._engine_of.move_to_end(cache_key)
        while len(self._engine_of) > self.max_keys:
            self._engine_of.popitem(last=False)
        return engine
