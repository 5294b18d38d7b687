"""The status page's figures: GET /dashboard/state's JSON (routes_dashboard.py serves it).

Built from what the api already keeps: the engines' states from the engine client's health
report (/health's), their loads from `per_engine_stats`, the figures over the window from
DashboardSampler's readings (dashboard_sampler.py: ApiMetrics' series, read at most once a
second), per-tenant usage from the usage ledger (GET /v1/usage's, services/api/tenancy/usage.py).
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec

from kvserve.services.api.engine_client.client import EngineClient
from kvserve.services.api.observability.dashboard_sampler import (
    NUM_HISTORY_POINTS,
    QUANTILES,
    RATE_WINDOW_S,
    WINDOW_S,
    DashboardSampler,
    Reading,
    quantile,
    ratio,
)
from kvserve.services.api.observability.dashboard_slo import SloView, slo_view


class EngineView(msgspec.Struct, kw_only=True):
    """One engine core: `engine` is its index, the DP rank; `state` /health's (serving,
    suspect, stalled or dead) and `reason` why it is not serving."""

    engine: int
    state: str
    hostname: str | None = None
    pid: int | None = None
    kv_role: str | None = None
    reason: str | None = None
    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    num_blocks: int | None = None
    prefix_cache_hit_rate: float | None = None  # since the api started


class Latency(msgspec.Struct, kw_only=True):
    """Percentiles in seconds over the window (None: no observation in it)."""

    count: int
    p50: float | None
    p90: float | None
    p99: float | None


class SpecDecode(msgspec.Struct, kw_only=True):
    """Speculative decoding, present once an engine verified drafts.

    acceptance_rate: accepted / draft tokens over the window (None: no drafts in it).
    mean_acceptance_length: 1 + accepted / drafts over the window (vLLM's).
    acceptance_rate_total: the same since the api started.
    accepted_per_position: since start, accepted / drafts at each draft position.
    """

    num_drafts: int
    acceptance_rate: float | None
    mean_acceptance_length: float | None
    acceptance_rate_total: float | None
    accepted_per_position: list[float]


class TenantView(msgspec.Struct, kw_only=True):
    """One tenant: its requests now, over the window's minutes (GET /v1/usage's ledger,
    one-minute buckets) and since the api started."""

    name: str
    num_running: int = 0
    num_waiting: int = 0
    requests: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_requests: int = 0
    total_tokens: int = 0


class PinView(msgspec.Struct, kw_only=True):
    """One engine's prompt pins (scheduler/core/prompt_pins.py): blocks held now, and since
    the api started the pinned prefixes hit and missed per TTL class, expirations, and pins
    yielded to the budget or to a request."""

    engine: int
    num_pinned_blocks: int = 0
    hits: dict[str, int] = {}
    misses: dict[str, int] = {}
    num_expired: int = 0
    num_yielded: int = 0


class History(msgspec.Struct, kw_only=True):
    """The charts: NUM_HISTORY_POINTS points over the window, oldest first; None before the
    api started."""

    seconds_ago: list[float]
    prompt_tokens_per_s: list[float | None]
    generation_tokens_per_s: list[float | None]
    num_running: list[int | None]
    num_waiting: list[int | None]
    kv_cache_usage: list[float | None]


class DashboardState(msgspec.Struct, kw_only=True):
    """GET /dashboard/state's body. Rates and latencies cover `window_s` (WINDOW_S, or
        less since the api started); throughput the last RATE_WINDOW_S; `tenants` is None for
        a key that may not see them (not in --usage-admin-keys); `needs_key` says API keys are
    set."""

    model: str
    version: str
    status: str
    needs_key: bool
    uptime_s: float
    window_s: float
    engines: list[EngineView]
    num_running: int
    num_waiting: int
    kv_cache_usage: float
    prefix_cache_hit_rate: float | None
    prefix_cache_hit_rate_total: float | None
    prompt_tokens_per_s: float
    generation_tokens_per_s: float
    prompt_tokens_total: int
    generation_tokens_total: int
    finished_requests_total: int
    ttft: Latency
    itl: Latency
    spec_decode: SpecDecode | None
    tenants: list[TenantView] | None
    history: History
    slo: SloView  # the goodput panel (dashboard_slo.py)
    pins: list[PinView] = []


def dashboard_state(
    sampler: DashboardSampler,
    model: str,
    version: str,
    show_tenants: bool,
    needs_key: bool = False,
) -> DashboardState:
    """The page's figures now (see DashboardState).

    Args:
        sampler: the readings (AppContext.dashboard).
        model: the served model name.
        version: kvserve's version.
        show_tenants: whether the asking key may see per-tenant usage.
        needs_key: whether API keys are set (the page then offers to log out).
    """
    now = sampler.sample()
    uptime_s = now.time - sampler.start_time
    # Between two readings the figures did not change (a step is read within an interval),
    # so the newest reading before an instant is the value at that instant.
    first = sampler.readings[0]
    base = sampler.at(now.time - WINDOW_S) or first
    recent = sampler.at(now.time - RATE_WINDOW_S) or first
    rate_s = min(RATE_WINDOW_S, uptime_s)
    health = sampler.engine_client.health_report()
    return DashboardState(
        model=model,
        version=version,
        status=health["status"],
        needs_key=needs_key,
        uptime_s=uptime_s,
        window_s=min(WINDOW_S, uptime_s),
        engines=_engines(sampler.engine_client, health),
        num_running=now.num_running,
        num_waiting=now.num_waiting,
        kv_cache_usage=now.kv_cache_usage,
        prefix_cache_hit_rate=ratio(
            now.prefix_cache_hits - base.prefix_cache_hits,
            now.prefix_cache_queries - base.prefix_cache_queries,
        ),
        prefix_cache_hit_rate_total=ratio(now.prefix_cache_hits, now.prefix_cache_queries),
        prompt_tokens_per_s=_per_s(now.prompt_tokens - recent.prompt_tokens, rate_s),
        generation_tokens_per_s=_per_s(now.generation_tokens - recent.generation_tokens, rate_s),
        prompt_tokens_total=int(now.prompt_tokens),
        generation_tokens_total=int(now.generation_tokens),
        finished_requests_total=int(now.finished_requests),
        ttft=_latency(sampler.ttft_bounds, now.ttft_buckets, base.ttft_buckets),
        itl=_latency(sampler.itl_bounds, now.itl_buckets, base.itl_buckets),
        spec_decode=_spec_decode(sampler.engine_client, now, base),
        tenants=_tenants(sampler) if show_tenants else None,
        history=_history(sampler, now),
        slo=slo_view(
            sampler.metrics.slo,
            (index for index, _, _ in sampler.engine_client.per_engine_stats()),
            show_tenants,
        ),
        pins=_pins(sampler.engine_client),
    )


def _per_s(count: float, seconds: float) -> float:
    return count / seconds if seconds > 0 else 0.0


def _engines(engine_client: EngineClient, health: dict) -> list[EngineView]:
    loads = {index: (stats, totals) for index, stats, totals in engine_client.per_engine_stats()}
    num_blocks = {
        ready.engine_index: ready.num_blocks for ready in engine_client.engine_handshakes()
    }
    engines = []
    for entry in health["engines"]:
        index = entry["engine"]
        stats, totals = loads.get(index, (None, None))
        engines.append(
            EngineView(
                engine=index,
                state=entry["state"],
                hostname=entry.get("hostname"),
                pid=entry.get("pid"),
                kv_role=entry.get("kv_role"),
                reason=entry.get("reason"),
                num_running=stats.num_running_reqs if stats else 0,
                num_waiting=stats.num_waiting_reqs if stats else 0,
                kv_cache_usage=stats.kv_cache_usage if stats else 0.0,
                num_blocks=num_blocks.get(index),
                prefix_cache_hit_rate=(
                    ratio(totals.prefix_cache_hits, totals.prefix_cache_queries) if totals else None
                ),
            )
        )
    return engines


def _pins(engine_client: EngineClient) -> list[PinView]:
    """Each engine's pins, for the engines that ever pinned anything."""
    return [
        PinView(
            engine=index,
            num_pinned_blocks=stats.num_pinned_blocks if stats else 0,
            hits=dict(totals.pin_hits),
            misses=dict(totals.pin_misses),
            num_expired=totals.num_pins_expired,
            num_yielded=totals.num_pins_yielded,
        )
        for index, stats, totals in engine_client.per_engine_stats()
        if (stats and stats.num_pinned_blocks) or totals.pin_hits or totals.pin_misses
    ]


def _latency(bounds: Sequence[float], now: Sequence[float], base: Sequence[float]) -> Latency:
    delta = [n - b for n, b in zip(now, base)]
    return Latency(
        count=int(delta[-1]) if delta else 0,
        **{f"p{round(q * 100)}": quantile(q, bounds, delta) for q in QUANTILES},
    )


def _spec_decode(engine_client: EngineClient, now: Reading, base: Reading) -> SpecDecode | None:
    if now.spec_num_drafts == 0:
        return None  # off, or no draft verified yet
    num_drafts = now.spec_num_drafts - base.spec_num_drafts
    accepted = now.spec_num_accepted_tokens - base.spec_num_accepted_tokens
    per_pos: list[int] = []
    for _, _, totals in engine_client.per_engine_stats():
        per_pos.extend([0] * (len(totals.spec_accepted_per_pos) - len(per_pos)))
        for pos, count in enumerate(totals.spec_accepted_per_pos):
            per_pos[pos] += count
    mean_length = ratio(accepted, num_drafts)
    return SpecDecode(
        num_drafts=num_drafts,
        acceptance_rate=ratio(accepted, now.spec_num_draft_tokens - base.spec_num_draft_tokens),
        mean_acceptance_length=None if mean_length is None else 1 + mean_length,
        acceptance_rate_total=ratio(now.spec_num_accepted_tokens, now.spec_num_draft_tokens),
        accepted_per_position=[count / now.spec_num_drafts for count in per_pos],
    )


def _tenants(sampler: DashboardSampler) -> list[TenantView]:
    views: dict[str, TenantView] = {}

    def view(name: str) -> TenantView:
        return views.setdefault(name, TenantView(name=name))

    for _, stats, _ in sampler.engine_client.per_engine_stats():
        if stats is None:
            continue
        for name, count in stats.running_by_tenant.items():
            view(name).num_running += count
        for name, count in stats.waiting_by_tenant.items():
            view(name).num_waiting += count
    ledger = sampler.metrics.usage
    for name, usage in ledger.report(ledger.clock() - WINDOW_S).tenants.items():
        tenant = view(name)
        tenant.requests = usage.requests
        tenant.prompt_tokens = usage.prompt_tokens
        tenant.completion_tokens = usage.completion_tokens
    for name, usage in ledger.report().tenants.items():
        tenant = view(name)
        tenant.total_requests = usage.requests
        tenant.total_tokens = usage.total_tokens
    return sorted(views.values(), key=lambda t: (-t.total_tokens, t.name))


def _history(sampler: DashboardSampler, now: Reading) -> History:
    step_s = WINDOW_S / NUM_HISTORY_POINTS
    edges = [now.time - WINDOW_S + step_s * k for k in range(NUM_HISTORY_POINTS + 1)]
    # The newest reading at each edge; the last edge is now.
    at = [sampler.at(edge) for edge in edges[:-1]] + [now]
    history = History(
        seconds_ago=[round(now.time - edge, 1) for edge in edges[1:]],
        prompt_tokens_per_s=[],
        generation_tokens_per_s=[],
        num_running=[],
        num_waiting=[],
        kv_cache_usage=[],
    )
    for start, end in zip(at, at[1:]):
        if start is None or end is None:  # before the api started: no rate
            history.prompt_tokens_per_s.append(None)
            history.generation_tokens_per_s.append(None)
        else:
            history.prompt_tokens_per_s.append((end.prompt_tokens - start.prompt_tokens) / step_s)
            history.generation_tokens_per_s.append(
                (end.generation_tokens - start.generation_tokens) / step_s
            )
        history.num_running.append(end.num_running if end else None)
        history.num_waiting.append(end.num_waiting if end else None)
        history.kv_cache_usage.append(end.kv_cache_usage if end else None)
    return history
