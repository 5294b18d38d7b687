"""The operator's surface: health, metrics, version, the OpenAPI document, cache reset.

GET  /health        200 while an engine core serves, else 503; the JSON body lists every
                    engine's state ({"status": "healthy"|"degraded"|"unhealthy",
                    "engines": [{"engine": 0, "state": "serving"|"stalled"|"dead", ...}]})
GET|POST /ping      /health's answer (vLLM's, for SageMaker-style probes)
GET  /metrics       Prometheus text
GET  /version       {"version": kvserve's package version}
GET  /openapi.json  the OpenAPI 3.1 description of the routes (services/api/surfaces/openapi.py)
POST /reset_prefix_cache   every engine forgets its cached prefixes: 200, or 409 while
                    running requests hold KV blocks
"""

from __future__ import annotations

import functools
import importlib.metadata

import msgspec
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from kvserve.services.api.app_context import AppContext, context_of, with_errors
from kvserve.services.api.serving.errors import APIError
from kvserve.services.api.surfaces.openapi import openapi_document
from kvserve.shared.logging import init_logger

logger = init_logger(__name__)

try:
    KVSERVE_VERSION = importlib.metadata.version("kvserve")
except importlib.metadata.PackageNotFoundError:  # run from a source tree, not installed
    KVSERVE_VERSION = "unknown"


def _json(body: object, status_code: int = 200) -> Response:
    return Response(
        msgspec.json.encode(body), status_code=status_code, media_type="application/json"
    )


async def health(request: Request) -> Response:
    engine_client = context_of(request).engine_client
    # Degraded (some engines gone) still serves: 200, and the body says which are gone.
    return _json(engine_client.health_report(), 200 if engine_client.is_healthy else 503)


async def version(request: Request) -> Response:
    return _json({"version": KVSERVE_VERSION})


@functools.cache
def _openapi_body() -> bytes:
    return msgspec.json.encode(openapi_document(KVSERVE_VERSION))


async def openapi(request: Request) -> Response:
    return Response(_openapi_body(), media_type="application/json")


async def metrics(request: Request) -> Response:
    text, content_type = context_of(request).metrics.render()
    return Response(text, headers={"Content-Type": content_type})


async def reset_prefix_cache(request: Request) -> Response:
    ctx = context_of(request)
    ctx.completions.check_engine()  # no engine left: a 503, not a reset of nothing
    logger.info("resetting the prefix cache of every engine")
    if not await ctx.engine_client.reset_prefix_cache():
        raise APIError(
            409,
            "the prefix cache was not reset: running requests still hold KV blocks; "
            "retry when no request runs",
        )
    return Response(status_code=200)


def routes(ctx: AppContext) -> list[Route]:
    return [
        Route("/health", health, methods=["GET"]),
        Route("/ping", health, methods=["GET", "POST"]),
        Route("/version", version, methods=["GET"]),
        Route("/reset_prefix_cache", with_errors(reset_prefix_cache), methods=["POST"]),
        Route("/metrics", metrics, methods=["GET"]),
        Route("/openapi.json", openapi, methods=["GET"]),
    ]
