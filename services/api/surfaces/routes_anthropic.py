"""The Anthropic surface: the Messages API (services/api/surfaces/messages.py).

POST /v1/messages                JSON, or Anthropic's SSE events with "stream": true
POST /v1/messages/count_tokens   {"input_tokens": N}

Errors here use Anthropic's body (`{"type": "error", "error": {"type", "message"}}`); with
API keys, `x-api-key: <key>` is accepted beside `Authorization: Bearer <key>` (auth.py).
"""

from __future__ import annotations

import msgspec
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from kvserve.services.api.app_context import AppContext, context_of, json_response, with_errors
from kvserve.services.api.serving.errors import APIError
from kvserve.services.api.serving.latency_targets import set_request_targets
from kvserve.services.api.serving.protocol import decode_request
from kvserve.services.api.surfaces.anthropic_protocol import (
    CountTokensRequest,
    MessagesRequest,
    error_body,
)


def anthropic_error_response(exc: APIError) -> Response:
    response = Response(
        msgspec.json.encode(error_body(exc.status_code, exc.message)),
        status_code=exc.status_code,
        media_type="application/json",
    )
    response.headers.update(exc.headers or {})
    return response


async def create_message(request: Request) -> Response:
    ctx = context_of(request)
    body = decode_request(await request.body(), MessagesRequest, ctx.max_json_depth)
    set_request_targets(body.slo, request.headers)
    return await ctx.messages.create_message(body, request)


async def count_tokens(request: Request) -> Response:
    ctx = context_of(request)
    body = decode_request(await request.body(), CountTokensRequest, ctx.max_json_depth)
    return json_response(ctx.messages.count_tokens(body))


def routes(ctx: AppContext) -> list[Route]:
    return [
        Route(
            "/v1/messages",
            with_errors(create_message, anthropic_error_response),
            methods=["POST"],
        ),
        Route(
            "/v1/messages/count_tokens",
            with_errors(count_tokens, anthropic_error_response),
            methods=["POST"],
        ),
    ]
