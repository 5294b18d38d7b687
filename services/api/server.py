"""The OpenAI-compatible HTTP app (starlette); `kvserve serve` runs it under uvicorn.

Routes:
    POST /v1/completions, /v1/chat/completions   JSON, or SSE with "stream": true
    GET  /v1/models
    GET  /health        200 while an engine core serves, else 503; the JSON body lists every
                        engine's state ({"status": "healthy"|"degraded"|"unhealthy",
                        "engines": [{"engine": 0, "state": "serving"|"stalled"|"dead", ...}]})
    GET  /metrics       Prometheus text
    POST /tokenize, /detokenize                  vLLM's shapes
    GET|POST /ping      /health's answer (vLLM's, for SageMaker-style probes)
    GET  /version       {"version": kvserve's package version}
    GET  /openapi.json  the OpenAPI 3.1 description of these routes (services/api/openapi.py)
    POST /reset_prefix_cache   every engine forgets its cached prefixes: 200, or 409 while
                        running requests hold KV blocks
    POST /v1/load_lora_adapter, /v1/unload_lora_adapter   with --enable-lora: serve a PEFT
                        folder as a model, or stop (services/api/serving_models.py)

Every error is OpenAI's body `{"error": {"message", "type", "param", "code"}}`. With API
keys (services/api/auth.py), /v1/* needs `Authorization: Bearer <key>`; the other routes stay
open, as in vLLM. Request bounds (body size, n, prompt characters, ...) are
services/api/limits.py's; a full engine queue is a 429 with Retry-After.
With --enable-request-id-headers every response carries `X-Request-Id`: the client's, else
the id the request got, else a fresh one.
"""

from __future__ import annotations

import importlib.metadata
import uuid
from collections.abc import Awaitable, Callable

import msgspec
from starlette.applications import Starlette
from starlette.datastructures import Headers, MutableHeaders
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from kvserve.services.api.auth import APIKeyMiddleware
from kvserve.services.api.engine_client import EngineClient, EngineDeadError, EngineOverloadedError
from kvserve.services.api.generation_config import load_generation_defaults
from kvserve.services.api.limits import BodySizeLimitMiddleware, check_prompt_chars
from kvserve.services.api.log_stats import LoggingStatLogger
from kvserve.services.api.metrics import ApiMetrics
from kvserve.services.api.openapi import openapi_document
from kvserve.services.api.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    DetokenizeResponse,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
    decode_request,
)
from kvserve.services.api.serving_base import REQUEST_ID_HEADER
from kvserve.services.api.serving_chat import OpenAIServingChat
from kvserve.services.api.serving_completions import OpenAIServingCompletion
from kvserve.services.api.serving_models import ServingModels, lora_adapter_endpoints
from kvserve.shared.config import FrontendConfig, HTTPConfig, LoRAConfig
from kvserve.shared.logging import init_logger

logger = init_logger(__name__)

Endpoint = Callable[[Request], Awaitable[Response]]

try:
    KVSERVE_VERSION = importlib.metadata.version("kvserve")
except importlib.metadata.PackageNotFoundError:  # run from a source tree, not installed
    KVSERVE_VERSION = "unknown"


def json_response(body: msgspec.Struct, status_code: int = 200) -> Response:
    return Response(
        msgspec.json.encode(body), status_code=status_code, media_type="application/json"
    )


def error_response(exc: APIError) -> Response:
    response = json_response(exc.to_body(), exc.status_code)
    response.headers.update(exc.headers or {})
    return response


def _with_errors(endpoint: Endpoint) -> Endpoint:
    """Turn whatever an endpoint raises into OpenAI's error body; the server stays up."""

    async def wrapped(request: Request) -> Response:
        try:
            return await endpoint(request)
        except APIError as exc:
            return error_response(exc)
        except EngineOverloadedError as exc:
            return error_response(exc.to_api_error())
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


class _RequestIdMiddleware:
    """--enable-request-id-headers: sets X-Request-Id on every response (streams too): the
    client's own header, else the id a completion handler gave the request (the response's
    `id` without its "cmpl-" prefix), else a fresh uuid, as vLLM's XRequestIdMiddleware."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        # The handler's request.state is this dict (OpenAIServing.request_ids writes to it).
        state = scope.setdefault("state", {})

        async def send_with_request_id(message) -> None:
            if message["type"] == "http.response.start":
                request_id = (
                    Headers(scope=scope).get(REQUEST_ID_HEADER)
                    or state.get("request_id")
                    or uuid.uuid4().hex
                )
                MutableHeaders(scope=message).append(REQUEST_ID_HEADER, request_id)
            await send(message)

        await self.app(scope, receive, send_with_request_id)


def build_app(
    engine_client: EngineClient,
    *,
    served_model_name: str,
    api_key: str | None = None,
    http: HTTPConfig | None = None,
    frontend: FrontendConfig | None = None,
    api_keys: dict[str, str] | None = None,
    lora_config: LoRAConfig | None = None,
) -> Starlette:
    """The HTTP app over one engine client.

    Args:
        engine_client: an EngineClient (multi-process or in-process).
        served_model_name: the name /v1/models lists and requests must use (or omit).
        api_key: when set, /v1/* requires it as a bearer token (named "default").
        api_keys: name -> key, each accepted on /v1/* (auth.load_api_keys); with api_key.
        http: the HTTP options the app itself honours (CORS); the server's own (host, TLS,
            root path) are uvicorn's.
        frontend: the front end's options (templates, request defaults, API details).
        lora_config: the engines' LoRA options: with enable_lora, --lora-modules are served,
            `model` may name an adapter, and /v1/load_lora_adapter and
            /v1/unload_lora_adapter exist.
    """
    http = http or HTTPConfig()
    frontend = frontend or FrontendConfig()
    models = ServingModels(
        served_model_name, engine_client.model_name, lora_config, frontend.lora_modules
    )
    max_loras = models.lora_config.max_loras if models.enable_lora else None
    metrics = ApiMetrics(engine_client, served_model_name, max_loras)
    if not frontend.disable_log_stats:
        engine_client.stat_loggers.append(LoggingStatLogger())
    completions = OpenAIServingCompletion(engine_client, served_model_name, frontend, models)
    chat = OpenAIServingChat(engine_client, served_model_name, frontend, models)
    defaults = load_generation_defaults(
        frontend.generation_config, engine_client.tokenizer_info.model_dir
    )
    if defaults:
        logger.info("request defaults from the generation config: %s", defaults)
    completions.generation_defaults = chat.generation_defaults = defaults

    max_depth = frontend.limits.max_json_depth

    async def create_completion(request: Request) -> Response:
        body = decode_request(await request.body(), CompletionRequest, max_depth)
        return await completions.create_completion(body, request)

    async def create_chat_completion(request: Request) -> Response:
        body = decode_request(await request.body(), ChatCompletionRequest, max_depth)
        return await chat.create_chat_completion(body, request)

    async def list_models(request: Request) -> Response:
        return json_response(ModelList(data=models.model_cards(engine_client.max_model_len)))

    async def health(request: Request) -> Response:
        # Degraded (some engines gone) still serves: 200, and the body says which are gone.
        return Response(
            msgspec.json.encode(engine_client.health_report()),
            status_code=200 if engine_client.is_healthy else 503,
            media_type="application/json",
        )

    async def version(request: Request) -> Response:
        return Response(
            msgspec.json.encode({"version": KVSERVE_VERSION}), media_type="application/json"
        )

    async def reset_prefix_cache(request: Request) -> Response:
        completions.check_engine()  # no engine left: a 503, not a reset of nothing
        logger.info("resetting the prefix cache of every engine")
        if not await engine_client.reset_prefix_cache():
            raise APIError(
                409,
                "the prefix cache was not reset: running requests still hold KV blocks; "
                "retry when no request runs",
            )
        return Response(status_code=200)

    openapi_body = msgspec.json.encode(openapi_document(KVSERVE_VERSION))

    async def openapi(request: Request) -> Response:
        return Response(openapi_body, media_type="application/json")

    async def metrics_endpoint(request: Request) -> Response:
        text, content_type = metrics.render()
        return Response(text, headers={"Content-Type": content_type})

    async def tokenize(request: Request) -> Response:
        body = decode_request(await request.body(), TokenizeRequest, max_depth)
        completions.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "give exactly one of `prompt` or `messages`", param="prompt")
        if body.messages is not None:
            token_ids = chat.apply_chat_template(body.messages, body.add_generation_prompt)
        else:
            check_prompt_chars(
                len(body.prompt), frontend.limits, engine_client.max_model_len, "prompt"
            )
            token_ids = engine_client.tokenizer_info.tokenizer.encode(
                body.prompt, add_special_tokens=body.add_special_tokens
            )
        return json_response(
            TokenizeResponse(len(token_ids), engine_client.max_model_len, list(token_ids))
        )

    async def detokenize(request: Request) -> Response:
        body = decode_request(await request.body(), DetokenizeRequest, max_depth)
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
        Route("/ping", health, methods=["GET", "POST"]),
        Route("/version", version, methods=["GET"]),
        Route("/reset_prefix_cache", _with_errors(reset_prefix_cache), methods=["POST"]),
        Route("/metrics", metrics_endpoint, methods=["GET"]),
        Route("/tokenize", _with_errors(tokenize), methods=["POST"]),
        Route("/detokenize", _with_errors(detokenize), methods=["POST"]),
        Route("/openapi.json", openapi, methods=["GET"]),
    ]
    if models.enable_lora:
        routes += [
            Route(path, _with_errors(endpoint), methods=["POST"])
            for path, endpoint in lora_adapter_endpoints(models, max_depth).items()
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
    if frontend.enable_request_id_headers:
        # Outside the API-key check, so a 401 carries the id too.
        middleware.append(Middleware(_RequestIdMiddleware))
    keys = dict(api_keys or {})
    if api_key:
        keys.setdefault("default", api_key)
    if keys:
        middleware.append(
            Middleware(
                APIKeyMiddleware, keys=keys, registry=metrics.registry, route_path=_route_path
            )
        )
    # Inside the key check: a client without a key cannot make the server buffer a body.
    middleware.append(
        Middleware(BodySizeLimitMiddleware, max_bytes=frontend.limits.max_request_body_bytes)
    )
    app = Starlette(routes=routes, middleware=middleware)
    app.state.engine_client = engine_client
    app.state.metrics = metrics
    return app
