"""The status page's goodput panel: how the requests with latency targets fared
(GET /dashboard/state's `slo`).

Read from the latency-target series (slo_metrics.py), so the panel and /metrics agree:
goodput is kvserve:slo_goodput_requests_per_second summed over engines (the requests that met
every target they had, per second over its window), met / missed per target are
kvserve:request_slo_total since the api started, and per tenant
kvserve:tenant_request_slo_total with the tenant's own goodput.
"""

from __future__ import annotations

from collections.abc import Iterable

import msgspec

from kvserve.services.api.observability.slo_metrics import GOODPUT_WINDOW_S, SloMetrics

TARGETS = ("ttft", "tpot")


class TargetOutcomes(msgspec.Struct, kw_only=True):
    """Finished requests with this target that met or missed it, since the api started."""

    target: str  # "ttft" or "tpot"
    met: int = 0
    missed: int = 0


class TenantSlo(msgspec.Struct, kw_only=True):
    """One tenant's goodput (per second over the window) and outcomes per target."""

    name: str
    goodput_per_s: float
    targets: list[TargetOutcomes]


class SloView(msgspec.Struct, kw_only=True):
    """The goodput panel. `tenants` is None for a key that may not see tenants, and empty
    while no tenant's request had a target."""

    goodput_window_s: float
    goodput_per_s: float
    targets: list[TargetOutcomes]
    tenants: list[TenantSlo] | None


def slo_view(slo: SloMetrics, engine_indices: Iterable[int], show_tenants: bool) -> SloView:
    """The panel's figures now.

    Args:
        slo: the api's latency-target series (ApiMetrics.slo).
        engine_indices: the engines whose goodput adds up.
        show_tenants: whether the asking key may see tenants.
    """
    tenants = None
    if show_tenants:
        tenants = [
            TenantSlo(
                name=name,
                goodput_per_s=slo.tenant_goodput(name),
                targets=_outcomes(counts),
            )
            for name, counts in sorted(slo.tenant_outcome_counts().items())
        ]
    return SloView(
        goodput_window_s=GOODPUT_WINDOW_S,
        goodput_per_s=sum(slo.goodput(i) for i in engine_indices),
        targets=_outcomes(slo.outcome_counts()),
        tenants=tenants,
    )


def _outcomes(counts: dict[tuple[str, str], int]) -> list[TargetOutcomes]:
    return [
        TargetOutcomes(
            target=target,
            met=counts.get((target, "met"), 0),
            missed=counts.get((target, "missed"), 0),
        )
        for target in TARGETS
    ]
