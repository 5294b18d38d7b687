"""A request's latency targets (docs/api.md "Latency targets"): where they come from.

    body {"slo": {"ttft_ms": .., "tpot_ms": ..}}  ─┐ each target on its own:
    headers x-slo-ttft-ms / x-slo-tpot-ms          ├─ body > header > tenant's key file line
    key file line: slo_ttft_ms= / slo_tpot_ms=    ─┘ > None (the engine's --slo-*-ms)

`resolve_targets` picks them per HTTP request; the route puts them in REQUEST_TARGETS (as
TenantMiddleware puts the tenant in CURRENT_TENANT), and OpenAIServing.generate hands them to
the engine client, which writes them on each EngineCoreRequest and times the request
against them (kvserve:request_slo_total).
"""

from __future__ import annotations

import contextvars
import math
from typing import Annotated

import msgspec
from starlette.datastructures import Headers

from kvserve.services.api.serving.errors import APIError
from kvserve.services.api.tenancy.tenants import CURRENT_TENANT, TenantSpec

TTFT_HEADER = "x-slo-ttft-ms"
TPOT_HEADER = "x-slo-tpot-ms"

PositiveMs = Annotated[float, msgspec.Meta(gt=0)]


class LatencyTargets(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Targets in milliseconds: time to first token, time per output token after the first;
    None: no target of this request's own (the `slo` body field has this shape)."""

    ttft_ms: PositiveMs | None = None
    tpot_ms: PositiveMs | None = None

    @property
    def any(self) -> bool:
        return self.ttft_ms is not None or self.tpot_ms is not None


NO_TARGETS = LatencyTargets()

# The targets of the request being handled; set by the route, read by OpenAIServing.generate.
REQUEST_TARGETS: contextvars.ContextVar[LatencyTargets] = contextvars.ContextVar(
    "kvserve_latency_targets", default=NO_TARGETS
)


def _finite(value: float | None, param: str) -> float | None:
    if value is not None and not math.isfinite(value):
        raise APIError(400, f"{param} must be a finite number of milliseconds", param=param)
    return value


def _header_ms(headers: Headers, name: str) -> float | None:
    """A target header's value, None when absent.

    Raises:
        APIError: 400 for a value that is not a positive, finite number.
    """
    text = headers.get(name)
    if text is None:
        return None
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise APIError(
            400, f"header {name}: a target is a positive number of milliseconds, got {text!r}"
        )
    return value


def resolve_targets(
    body: LatencyTargets | None, headers: Headers, tenant: TenantSpec | None
) -> LatencyTargets:
    """The request's targets: each from the body's `slo`, else its header, else the
    tenant's key file line; None where none gives one (the engine's defaults apply).

    Raises:
        APIError: 400 for a bad header or an infinite body value (the body's shape, keys and
            signs are checked as it is decoded).
    """
    body = body or NO_TARGETS
    tenant_ttft = tenant.slo_ttft_ms if tenant is not None else None
    tenant_tpot = tenant.slo_tpot_ms if tenant is not None else None
    ttft = _finite(body.ttft_ms, "slo.ttft_ms")
    tpot = _finite(body.tpot_ms, "slo.tpot_ms")
    if ttft is None:
        ttft = _header_ms(headers, TTFT_HEADER) or tenant_ttft
    if tpot is None:
        tpot = _header_ms(headers, TPOT_HEADER) or tenant_tpot
    return LatencyTargets(ttft_ms=ttft, tpot_ms=tpot)


def set_request_targets(body: LatencyTargets | None, headers: Headers) -> None:
    """Resolve the handled request's targets (resolve_targets, for CURRENT_TENANT's tenant)
    and put them in REQUEST_TARGETS, where OpenAIServing.generate reads them.

    Raises:
        APIError: 400 for a bad target.
    """
    REQUEST_TARGETS.set(resolve_targets(body, headers, CURRENT_TENANT.get()))
