"""GET /v1/usage: each tenant's requests and tokens (services/api/tenancy/usage.py).

    GET /v1/usage?start=<unix s>&end=<unix s>
    {"object": "usage", "start": 1764892800, "end": 1764896400,
     "tenants": {"alpha": {"requests": 12, "prompt_tokens": 340, "completion_tokens": 96,
                           "total_tokens": 436}}}

Both bounds are optional (default: every bucket the server keeps, up to now). Granularity is
the minute: a one-minute bucket that overlaps [start, end) counts whole, and the answer's
`start` and `end` are the range widened to whole minutes. The totals live in the api process
only: they start at zero with the server (Prometheus' kvserve:tenant_* series are the
durable record) and go back 7 days at most.

Who may read it: with API keys, only a key whose name is in --usage-admin-keys (default
["admin"]); another key gets 403, none 401 (APIKeyMiddleware). Without any key configured,
anyone may: such a server trusts every client with every route, and /metrics, as open,
already shows the same figures per tenant (kvserve:tenant_*), so a 403 there would protect
nothing and only make the operator invent a key.
"""

from __future__ import annotations

import math

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from kvserve.services.api.app_context import AppContext, context_of, json_response, with_errors
from kvserve.services.api.serving.errors import APIError

MAX_SECONDS = 1e12  # year ~33700: any real time, and JSON-safe once widened to minutes


def _check_admin(request: Request, ctx: AppContext) -> None:
    if not ctx.tenants.keys:
        return
    key_name = request.scope.get("state", {}).get("api_key_name")
    if key_name not in ctx.tenants.config.usage_admin_keys:
        raise APIError(
            403,
            "GET /v1/usage needs an admin key: one whose name is in --usage-admin-keys",
            err_type="PermissionDeniedError",
        )


def _seconds_param(request: Request, name: str) -> float | None:
    text = request.query_params.get(name)
    if text is None:
        return None
    try:
        seconds = float(text)
    except ValueError:
        seconds = math.nan
    if not 0 <= seconds <= MAX_SECONDS:  # NaN fails too
        raise APIError(
            400, f"{name} must be unix seconds (a number from 0 to 1e12), got {text!r}", name
        )
    return seconds


async def usage(request: Request) -> Response:
    ctx = context_of(request)
    _check_admin(request, ctx)
    start, end = _seconds_param(request, "start"), _seconds_param(request, "end")
    if start is not None and end is not None and start > end:
        raise APIError(400, f"start ({start:g}) is after end ({end:g})", "start")
    return json_response(ctx.metrics.usage.report(start, end))


def routes(ctx: AppContext) -> list[Route]:
    return [Route("/v1/usage", with_errors(usage), methods=["GET"])]
