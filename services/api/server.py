"""The OpenAI-compatible HTTP app (starlette); `kvserve serve` runs it under uvicorn.

Routes:
    POST /v1/completions, /v1/chat/completions   JSON, or SSE with "stream": true
    GET  /v1/models
    GET  /health        200 while an engine core serves, else 503; the JSON body lists every
                        engine's state ({"status": "healthy"|"degraded"|"unhealthy",
                        "engines": [{"engine": 0, "state": "serving"|"stalled"|"dead", ...}]})
    GET  /metrics       Prometheus text
    POST /tokenize, /detokenize                  vLLM's shapes

Every error is OpenAI's body `{"error": {"message", "type", "param", "code"}}`. With an API
key, /v1/* needs `Authorization: Bearer <key>`; the other routes stay open, as in vLLM.
"""

from __future__ import annotations

import secrets
from collections.abc import Awaitable, Callable

import msgspec
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from kvserve.services.api.engine_client import EngineClient, EngineDeadError
from kvserve.services.api.generation_config import load_generation_defaults
from kvserve.services.api.metrics import ApiMetrics
from kvserve.services.api.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    DetokenizeResponse,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
    decode_request,
)
from kvserve.services.api.serving_chat import OpenAIServingChat
from kvserve.services.api.serving_completions import OpenAIServingCompletion
from kvserve.shared.config import FrontendConfig, HTTPConfig
from kvserve.shared.logging import init_logger

logger = init_logger(__name__)

Endpoint = Callable[[Request], Awaitable[Response]]


def json_response(body: msgspec.Struct, status_code: int = 200) -> Response:
    return Response(
        msgspec.json.encode(body), status_code=status_code, media_type="application/json"
    )


def error_response(exc: APIError) -> Response:
    return json_response(exc.to_body(), exc.status_code)


def _with_errors(endpoint: Endpoint) -> Endpoint:
    """Turn whatever an endpoint raises into OpenAI's error body; the server stays up."""

    async def wrapped(request: Request) -> Response:
        try:
            return await endpoint(request)
        except APIError as exc:
            return error_response(exc)
        except EngineDeadError as exc:
            return error_response(APIError(503, f"the engine is dead: {exc}"))
        except Exception as exc:  # noqa: BLE001 - a bug must cost one request, not the server
            logger.exception("%s %s failed", request.method, request.url.path)
            return error_response(APIError(500, f"internal error: {type(exc).__name__}: {exc}"))

    return wrapped


def _route_path(scope: Scope) -> str:
    """The path routes match: uvicorn puts --root-path in front of the request's path."""
    path, root_path = scope["path"], scope.get("root_path", "")
    return path[len(root_path) :] if root_path and path.startswith(root_path) else path


class _APIKeyMiddleware:
    """Rejects /v1/* requests without `Authorization: Bearer <api_key>` (401)."""

    def __init__(self, app: ASGIApp, api_key: str):
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and _route_path(scope).startswith("/v1/"):
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not secrets.compare_digest(given, self.expected):
                response = error_response(
                    APIError(
                        401,
                        "invalid or missing API key: send 'Authorization: Bearer <key>'",
                        err_type="AuthenticationError",
                    )
                )
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


def build_app(
    engine_client: EngineClient,
    *,
    served_model_name: str,
    api_key: str | None = None,
    http: HTTPConfig | None = None,
    frontend: FrontendConfig | None = None,
) -> Starlette:
    """The HTTP app over one engine client.

    Args:
        engine_client: an EngineClient (multi-process or in-process).
        served_model_name: the name /v1/models lists and requests must use (or omit).
        api_key: when set, /v1/* requires it as a bearer token.
        http: the HTTP options the app itself honours (CORS); the server's own (host, TLS,
            root path) are uvicorn's.
        frontend: the front end's options (templates, request defaults, API details).
    """
    http = http or HTTPConfig()
    frontend = frontend or FrontendConfig()
    metrics = ApiMetrics(engine_client, served_model_name)
    completions = OpenAIServingCompletion(engine_client, served_model_name, metrics)
    chat = OpenAIServingChat(engine_client, served_model_name, metrics)
    defaults = load_generation_defaults(
        frontend.generation_config, engine_client.tokenizer_info.model_dir
    )
    if defaults:
        logger.info("request defaults from the generation config: %s", defaults)
    completions.generation_defaults = chat.generation_defaults = defaults

    async def create_completion(request: Request) -> Response:
        body = decode_request(await request.body(), CompletionRequest)
        return await completions.create_completion(body, request)

    async def create_chat_completion(request: Request) -> Response:
        body = decode_request(await request.body(), ChatCompletionRequest)
        return await chat.create_chat_completion(body, request)

    async def list_models(request: Request) -> Response:
        card = ModelCard(
            id=served_model_name,
            root=engine_client.model_name,
            max_model_len=engine_client.max_model_len,
        )
        return json_response(ModelList(data=[card]))

    async def health(request: Request) -> Response:
        # Degraded (some engines gone) still serves: 200, and the body says which are gone.
        return Response(
            msgspec.json.encode(engine_client.health_report()),
            status_code=200 if engine_client.is_healthy else 503,
            media_type="application/json",
        )

    async def metrics_endpoint(request: Request) -> Response:
        text, content_type = metrics.render()
        return Response(text, headers={"Content-Type": content_type})

    async def tokenize(request: Request) -> Response:
        body = decode_request(await request.body(), TokenizeRequest)
        completions.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "give exactly one of `prompt` or `messages`", param="prompt")
        if body.messages is not None:
            token_ids = chat.apply_chat_template(body.messages, body.add_generation_prompt)
        else:
            token_ids = engine_client.tokenizer_info.tokenizer.encode(
                body.prompt, add_special_tokens=body.add_special_tokens
            )
        return json_response(
            TokenizeResponse(len(token_ids), engine_client.max_model_len, list(token_ids))
        )

    async def detokenize(request: Request) -> Response:
        body = decode_request(await request.body(), DetokenizeRequest)
        completions.check_model(body.model)
        if body.tokens:
            completions.check_token_ids(body.tokens, "tokens")
        return json_response(
            DetokenizeResponse(engine_client.tokenizer_info.tokenizer.decode(body.tokens))
        )

    routes = [
        Route("/v1/completions", _with_errors(create_completion), methods=["POST"]),
        Route("/v1/chat/completions", _with_errors(create_chat_completion), methods=["POST"]),
        Route("/v1/models", _with_errors(list_models), methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/metrics", metrics_endpoint, methods=["GET"]),
        Route("/tokenize", _with_errors(tokenize), methods=["POST"]),
        Route("/detokenize", _with_errors(detokenize), methods=["POST"]),
    ]
    # CORS outermost, so a browser's preflight (OPTIONS, no credentials) is answered before
    # the API key is asked for, as vLLM does.
    middleware = [
        Middleware(
            CORSMiddleware,
            allow_origins=http.allowed_origins,
            allow_credentials=http.allow_credentials,
            allow_methods=http.allowed_methods,
            allow_headers=http.allowed_headers,
        )
    ]
    if api_key:
        middleware.append(Middleware(_APIKeyMiddleware, api_key=api_key))
    app = Starlette(routes=routes, middleware=middleware)
    app.state.engine_client = engine_client
    app.state.metrics = metrics
    return app
