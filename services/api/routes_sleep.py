"""Sleep mode (--enable-sleep-mode), vLLM's routes: free the engines' memory between jobs.

POST /sleep?level=1|2     every engine frees its KV cache (level 1: on CUDA the weights move
                          to host memory; level 2: the weights are dropped too): 200, or 409
                          while requests are in flight (nothing freed: retry when none runs)
POST /wake_up[?tags=weights&tags=kv_cache]   restore what sleep freed (default: both): 200
GET  /is_sleeping         {"is_sleeping": bool}

While asleep every generation request is refused with a 503 naming it (serving/base.py's
check_engine). Without --enable-sleep-mode the three routes answer 404, as vLLM's do (where
they are not registered). Like /reset_prefix_cache they are outside /v1, so API keys do not
guard them: keep them on a trusted network.
"""

from __future__ import annotations

import msgspec
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from kvserve.services.api.app_context import AppContext, context_of, with_errors
from kvserve.services.api.serving.errors import APIError
from kvserve.shared.logging import init_logger
from kvserve.shared.wire import check_sleep_tags

logger = init_logger(__name__)


def _sleep_mode(request: Request) -> AppContext:
    """The context, once the engines run with --enable-sleep-mode (else a 404)."""
    ctx = context_of(request)
    handshakes = ctx.engine_client.engine_handshakes()
    if not handshakes or not all(h.enable_sleep_mode for h in handshakes):
        raise APIError(
            404, f"{request.url.path} needs the engines started with --enable-sleep-mode"
        )
    return ctx


async def sleep(request: Request) -> Response:
    ctx = _sleep_mode(request)
    raw = request.query_params.get("level", "1")
    if raw not in ("1", "2"):
        raise APIError(400, f"level must be 1 or 2, got {raw!r}", param="level")
    level = int(raw)
    if ctx.engine_client.sleep_level:
        return Response(status_code=200)  # already asleep, as vLLM
    logger.info("putting every engine to sleep at level %d", level)
    if not await ctx.engine_client.sleep(level):
        raise APIError(
            409, "the engines did not sleep: requests are in flight; retry when none runs"
        )
    return Response(status_code=200)


async def wake_up(request: Request) -> Response:
    ctx = _sleep_mode(request)
    tags = request.query_params.getlist("tags") or None
    try:
        tags = check_sleep_tags(tags)
    except ValueError as exc:
        raise APIError(400, str(exc), param="tags") from None
    logger.info("waking every engine: %s", " and ".join(tags))
    try:
        await ctx.engine_client.wake_up(tags)
    except RuntimeError as exc:  # the engine refused (kv_cache before the weights)
        raise APIError(400, str(exc), param="tags") from None
    return Response(status_code=200)


async def is_sleeping(request: Request) -> Response:
    ctx = _sleep_mode(request)
    body = {"is_sleeping": ctx.engine_client.sleep_level > 0}
    return Response(msgspec.json.encode(body), media_type="application/json")


def routes(ctx: AppContext) -> list[Route]:
    return [
        Route("/sleep", with_errors(sleep), methods=["POST"]),
        Route("/wake_up", with_errors(wake_up), methods=["POST"]),
        Route("/is_sleeping", with_errors(is_sleeping), methods=["GET"]),
    ]
