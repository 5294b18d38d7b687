"""Prompt caching the client asks for: which prompt prefixes to pin, for how long, and how
the usage counts their reads and writes.

A surface resolves its API's fields into pins for the request being handled and puts them
in REQUEST_PINS (a context variable, as latency_targets.REQUEST_TARGETS), where
OpenAIServing.generate reads them; each EngineCoreRequest carries them to the engine, which
pins the prefixes' full KV blocks when the request finishes (scheduler/core/prompt_pins.py).

- Anthropic `cache_control` breakpoints (surfaces/anthropic_cache.py): a pin per breakpoint,
  at the breakpoint's token offset, for 5 minutes or 1 hour.
- OpenAI `prompt_cache_retention`: "24h" pins the whole prompt for 86,400 s; "in_memory"
  (or absent) pins nothing: the ordinary LRU prefix cache.

KVSERVE_PROMPT_CACHE_TTL_SCALE (tests only) multiplies every TTL, so a test sees a 5-minute
pin expire in seconds; the TTL class ("5m", "1h", "24h") labels the metrics either way.
"""

from __future__ import annotations

import contextvars
from dataclasses import dataclass

from kvserve.services.api.engine_client.cache_affinity import PROMPT_CACHE_KEY
from kvserve.services.api.serving.errors import APIError
from kvserve.shared.env import PROMPT_CACHE_TTL_SCALE
from kvserve.shared.messages import PromptPin

TTL_SECONDS = {"5m": 300.0, "1h": 3600.0, "24h": 86400.0}
RETENTIONS = ("in_memory", "24h")
_TTL_SCALE = PROMPT_CACHE_TTL_SCALE.get()  # read once, as the api starts


@dataclass(frozen=True, slots=True)
class RequestPins:
    """The pins of the request being handled.

    Args:
        pins: explicit breakpoints (token offsets into the prompt), shortest first.
        whole_prompt_ttl: a TTL class that pins each prompt whole (prompt_cache_retention
            "24h"), or None.
    """

    pins: tuple[PromptPin, ...] = ()
    whole_prompt_ttl: str | None = None

    def for_prompt(self, num_prompt_tokens: int) -> list[PromptPin]:
        """The pins of one prompt of `num_prompt_tokens` tokens."""
        if self.whole_prompt_ttl is not None:
            return [make_pin(num_prompt_tokens, self.whole_prompt_ttl)]
        return list(self.pins)


NO_PINS = RequestPins()
REQUEST_PINS: contextvars.ContextVar[RequestPins] = contextvars.ContextVar(
    "kvserve_prompt_pins", default=NO_PINS
)


def make_pin(num_tokens: int, ttl_class: str) -> PromptPin:
    """A pin of the first `num_tokens` tokens for the TTL class's seconds (times the test
    scale)."""
    return PromptPin(num_tokens, TTL_SECONDS[ttl_class] * _TTL_SCALE, ttl_class)


def set_openai_prompt_cache(cache_key: str | None, retention: str | None) -> None:
    """OpenAI's prompt caching fields for the handled request: `prompt_cache_key` routes it
    (engine_client/cache_affinity.py); `prompt_cache_retention` "24h" pins each prompt whole.

    Raises:
        APIError: 400 for a retention other than "in_memory" or "24h".
    """
    if cache_key is not None:
        PROMPT_CACHE_KEY.set(cache_key)
    if retention is None or retention == "in_memory":
        return
    if retention not in RETENTIONS:
        raise APIError(
            400,
            f"prompt_cache_retention must be 'in_memory' or '24h', got {retention!r}",
            param="prompt_cache_retention",
        )
    REQUEST_PINS.set(RequestPins(whole_prompt_ttl=retention))


@dataclass(frozen=True, slots=True)
class CacheUsage:
    """Prompt tokens by how the cache served them, as Anthropic's usage counts them.

    Args:
        read: tokens up to the last breakpoint whose pinned blocks were all found cached.
        created: per TTL class, tokens from there up to each later breakpoint (written).
        cached_prefix: read + every created token: the prompt tokens up to the last
            breakpoint (input_tokens counts the rest).
    """

    read: int = 0
    created: dict[str, int] | None = None
    cached_prefix: int = 0


def cache_usage(pins: list[PromptPin], num_cached_tokens: int, block_size: int) -> CacheUsage:
    """Anthropic's accounting of a request's breakpoints, given its prefix-cache hit.

    A breakpoint is read when the engine found every full block before it cached (its last
    partial block, under `block_size` tokens, is always recomputed and is counted with the
    breakpoint); the tokens past the last read breakpoint up to each later one are written,
    under that breakpoint's TTL class:

        | read (up to B1) | written 1h (B1..B2) | written 5m (B2..B3) | input_tokens ... |
        0                 B1                    B2                    B3

    Args:
        pins: the request's breakpoints, shortest first.
        num_cached_tokens: the prompt tokens the prefix cache (or the KV store) served.
        block_size: the engine's tokens per KV block.
    """
    # A prefix shorter than a block pins nothing (Anthropic too caches nothing that short).
    pins = [pin for pin in pins if pin.num_tokens >= block_size]
    read = 0
    for pin in pins:
        if pin.num_tokens // block_size * block_size <= num_cached_tokens:
            read = max(read, pin.num_tokens)
    created: dict[str, int] = {}
    start = read
    for pin in pins:
        if pin.num_tokens > start:
            created[pin.ttl_class] = created.get(pin.ttl_class, 0) + pin.num_tokens - start
            start = pin.num_tokens
    return CacheUsage(read, created, max(start, read))
