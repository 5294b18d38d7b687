"""Per-tenant quotas, checked in the api before a request costs anything.

A tenant (services/api/tenancy/tenants.py) may have three limits, each from its key file line's
column or else the --tenant-* flag (none: unlimited):

- max_concurrent: HTTP requests in flight. One HTTP request takes one slot, whatever its
  prompts x n; the slot is freed once, when the request ends in any way (finished, aborted,
  failed, client gone). Past it: 429 with Retry-After: 1.
- requests_per_minute: requests admitted in the last 60 s. Past it: 429, Retry-After the
  seconds until the oldest admissions leave the window.
- tokens_per_minute: as OpenAI counts them. Admission reserves prompt + max_tokens (every
  prompt, every n) in the window, and refuses when the window's tokens + that reservation
  exceed the limit (429, Retry-After the seconds until enough tokens leave the window). When
  the request ends, its reservation becomes what it really used (prompt tokens + tokens
  generated; nothing for a prompt the engine rejected), so an early end gives the unused
  part back. A request whose reservation alone exceeds the limit is a 400 (see
  `TenantQuotas.admit`).

Each admission counts for 60 s from the moment it was admitted (a request still running
then stops counting: its whole reservation, an upper bound of its use, was counted for 60 s).

    admit ──▶ QuotaTicket ──(the request ends: SettledResults)──▶ ticket.settle(used)

Refused requests count nothing. Memory stays bounded: window entries older than 60 s go,
and a tenant with nothing in flight and an empty window is forgotten. A reload of the key
file (SIGHUP) changes the limits of the next admissions; what was admitted stays counted.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass, field
from typing import Any

from kvserve.services.api.serving.errors import APIError
from kvserve.services.api.serving.outputs import RequestOutput
from kvserve.services.api.tenancy.tenants import TenantSpec

WINDOW_S = 60.0

Results = AsyncGenerator[tuple[int, RequestOutput], None]


def has_quotas(spec: TenantSpec) -> bool:
    """Whether any quota applies to the tenant (else admission is skipped entirely)."""
    return (
        spec.max_concurrent is not None
        or spec.tokens_per_minute is not None
        or spec.requests_per_minute is not None
    )


def _set_by(option: str) -> str:
    return f"set by {option}= on its --api-key-file line, else --tenant-{option.replace('_', '-')}"


@dataclass(slots=True)
class _TokenCharge:
    """One admission's tokens in the window: its reservation, then what it used."""

    admitted_at: float
    num_tokens: int
    expired: bool = False


@dataclass(slots=True)
class _TenantUsage:
    num_in_flight: int = 0
    admitted_at: deque[float] = field(default_factory=deque)  # oldest first
    token_charges: deque[_TokenCharge] = field(default_factory=deque)  # oldest first
    num_window_tokens: int = 0

    def expire(self, now: float) -> None:
        """Drop what was admitted WINDOW_S or more ago."""
        start = now - WINDOW_S
        while self.admitted_at and self.admitted_at[0] <= start:
            self.admitted_at.popleft()
        while self.token_charges and self.token_charges[0].admitted_at <= start:
            charge = self.token_charges.popleft()
            self.num_window_tokens -= charge.num_tokens
            charge.expired = True

    def is_idle(self) -> bool:
        return self.num_in_flight == 0 and not self.admitted_at and not self.token_charges


class QuotaTicket:
    """One admitted request: its concurrency slot and its token charge. `settle` once when
    it ends (again: nothing happens)."""

    __slots__ = ("quotas", "tenant", "charge", "settled")

    def __init__(self, quotas: TenantQuotas, tenant: str, charge: _TokenCharge):
        self.quotas = quotas
        self.tenant = tenant
        self.charge = charge
        self.settled = False

    def settle(self, num_used_tokens: int) -> None:
        """Free the slot; the reservation becomes `num_used_tokens` (never more)."""
        if not self.settled:
            self.settled = True
            self.quotas._settle(self, num_used_tokens)


class TenantQuotas:
    """Requests in flight and 60 s windows of requests and tokens, per tenant name.

    One object serves every handler (AppContext.quotas); all calls come from the event
    loop, so nothing is locked.

    Args:
        clock: seconds, monotonic (tests pass a fake one).
        on_refused: called with (tenant, limit name) for each request a limit refused
            (the kvserve:tenant_quota_refusals_total series).
    """

    def __init__(
        self,
        clock: Callable[[], float] = time.monotonic,
        on_refused: Callable[[str, str], None] | None = None,
    ):
        self.clock = clock
        self.on_refused = on_refused
        self._usage: dict[str, _TenantUsage] = {}
        self._next_sweep_at = clock() + WINDOW_S

    def admit(self, spec: TenantSpec, num_prompt_tokens: int, max_new_tokens: int) -> QuotaTicket:
        """Take a slot and reserve prompt + max new tokens for the tenant, or refuse.

        Args:
            spec: the tenant and its limits.
            num_prompt_tokens: the request's prompt tokens (all prompts).
            max_new_tokens: the most tokens it may generate (max_tokens x n, all prompts).

        Raises:
            APIError: 429 (Retry-After set) past a limit. 400 when the reservation alone
                exceeds tokens_per_minute: it could never be admitted, and a 429 would only
                make clients (the openai SDK retries 429s by itself) retry in vain; the
                message says to lower max_tokens.
        """
        now = self.clock()
        if now >= self._next_sweep_at:
            self._sweep(now)
        usage = self._usage.get(spec.name)
        if usage is None:
            usage = _TenantUsage()
        else:
            usage.expire(now)
        num_reserved_tokens = num_prompt_tokens + max_new_tokens
        try:
            self._check(spec, usage, num_reserved_tokens, now)
        except _Refused as refused:
            if self.on_refused is not None:
                self.on_refused(spec.name, refused.limit)
            raise refused.error from None
        charge = _TokenCharge(now, num_reserved_tokens)
        usage.num_in_flight += 1
        usage.admitted_at.append(now)
        usage.token_charges.append(charge)
        usage.num_window_tokens += num_reserved_tokens
        self._usage[spec.name] = usage
        return QuotaTicket(self, spec.name, charge)

    def _check(
        self, spec: TenantSpec, usage: _TenantUsage, num_reserved_tokens: int, now: float
    ) -> None:
        name = spec.name
        limit = spec.max_concurrent
        if limit is not None and usage.num_in_flight >= limit:
            raise _too_many(
                "max_concurrent",
                f"tenant {name!r} has {usage.num_in_flight} requests in flight, its "
                f"max_concurrent limit {limit} ({_set_by('max_concurrent')})",
                1,
            )
        limit = spec.requests_per_minute
        if limit is not None and len(usage.admitted_at) >= limit:
            # Room comes when all but limit - 1 of the window's requests have left it.
            leaves_at = usage.admitted_at[len(usage.admitted_at) - limit]
            raise _too_many(
                "requests_per_minute",
                f"tenant {name!r} reached its requests_per_minute limit {limit} "
                f"({_set_by('requests_per_minute')}): {len(usage.admitted_at)} requests in the "
                f"last 60 s",
                leaves_at + WINDOW_S - now,
            )
        limit = spec.tokens_per_minute
        if limit is None:
            return
        if num_reserved_tokens > limit:
            error = APIError(
                400,
                f"this request may use {num_reserved_tokens} tokens (prompt + max_tokens x n), "
                f"more than tenant {name!r}'s whole tokens_per_minute limit {limit} "
                f"({_set_by('tokens_per_minute')}): it can never be admitted; lower max_tokens "
                f"(without it, the rest of the context is reserved) or shorten the prompt",
                param="max_tokens",
            )
            raise _Refused("tokens_per_minute", error)
        num_over = usage.num_window_tokens + num_reserved_tokens - limit
        if num_over > 0:
            raise _too_many(
                "tokens_per_minute",
                f"tenant {name!r} reached its tokens_per_minute limit {limit} "
                f"({_set_by('tokens_per_minute')}): {usage.num_window_tokens} tokens in the "
                f"last 60 s (reserved while running), and this request may use "
                f"{num_reserved_tokens} (prompt + max_tokens x n)",
                _seconds_until_freed(usage.token_charges, num_over) - now,
            )

    def _settle(self, ticket: QuotaTicket, num_used_tokens: int) -> None:
        usage = self._usage[ticket.tenant]  # kept while the ticket is in flight
        usage.num_in_flight -= 1
        charge = ticket.charge
        if not charge.expired:
            num_used_tokens = min(num_used_tokens, charge.num_tokens)
            usage.num_window_tokens += num_used_tokens - charge.num_tokens
            charge.num_tokens = num_used_tokens
        usage.expire(self.clock())
        if usage.is_idle():
            del self._usage[ticket.tenant]

    def _sweep(self, now: float) -> None:
        """Forget the tenants idle for a whole window (every WINDOW_S, on an admission)."""
        for name, usage in list(self._usage.items()):
            usage.expire(now)
            if usage.is_idle():
                del self._usage[name]
        self._next_sweep_at = now + WINDOW_S

    def in_use(self, tenant: str) -> tuple[int, int, int] | None:
        """(requests in flight, requests and tokens in the last 60 s) of a tenant, or None
        when it is not tracked."""
        usage = self._usage.get(tenant)
        if usage is None:
            return None
        usage.expire(self.clock())
        return usage.num_in_flight, len(usage.admitted_at), usage.num_window_tokens

    def __len__(self) -> int:
        """The tenants tracked now."""
        return len(self._usage)


def _seconds_until_freed(charges: deque[_TokenCharge], num_tokens: int) -> float:
    """When the oldest charges that hold `num_tokens` tokens leave the window."""
    num_freed = 0
    for charge in charges:
        num_freed += charge.num_tokens
        if num_freed >= num_tokens:
            return charge.admitted_at + WINDOW_S
    raise AssertionError("a reservation within the limit always fits an empty window")


class _Refused(Exception):
    """A limit refused the request: which one, and the error the client gets."""

    def __init__(self, limit: str, error: APIError):
        super().__init__(limit)
        self.limit = limit
        self.error = error


def _too_many(limit: str, message: str, retry_after_s: float) -> _Refused:
    seconds = max(1, math.ceil(retry_after_s))
    error = APIError(429, f"{message}; retry in {seconds} s", headers={"Retry-After": str(seconds)})
    return _Refused(limit, error)


class SettledResults(Results):
    """A request's merged results again; its ticket settles once when they end: exhausted,
    failed, cancelled, closed (also before the first item: an async generator's `finally`
    would not run then), or dropped unclosed (`__del__`).

    Tokens used: per prompt, its latest (cumulative) output's prompt and generated tokens;
    a prompt without an output yet counts its prompt (it may be prefilling), one the engine
    rejected counts nothing.

    Args:
        results: OpenAIServing.generate's merged (prompt index, RequestOutput) stream.
        ticket: the request's admission.
        num_prompt_tokens: each prompt's length.
    """

    def __init__(self, results: Results, ticket: QuotaTicket, num_prompt_tokens: list[int]):
        self.results = results
        self.ticket = ticket
        self.num_used_tokens = list(num_prompt_tokens)

    async def asend(self, value: None) -> tuple[int, RequestOutput]:
        try:
            item = await self.results.asend(value)
        except BaseException:
            # Whatever came out of the generator (its end included) finished it.
            self._settle()
            raise
        index, output = item
        if any(c.finish_reason == "error" for c in output.outputs):
            self.num_used_tokens[index] = 0
        else:
            num_generated = sum(len(c.token_ids) for c in output.outputs)
            self.num_used_tokens[index] = len(output.prompt_token_ids) + num_generated
        return item

    async def athrow(self, *args: Any) -> tuple[int, RequestOutput]:
        try:
            return await self.results.athrow(*args)
        except BaseException:
            self._settle()
            raise

    async def aclose(self) -> None:
        try:
            await self.results.aclose()
        finally:
            self._settle()

    def _settle(self) -> None:
        self.ticket.settle(sum(self.num_used_tokens))

    def __del__(self) -> None:
        self._settle()
