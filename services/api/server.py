"""The HTTP app (starlette); `kvserve serve` runs it under uvicorn.

An API surface is one module of routes over the shared serving core (app_context.py's
AppContext, on `app.state.ctx`); build_app registers each module of ROUTE_MODULES:

    surfaces/routes_openai.py     /v1/completions, /v1/chat/completions, /v1/models,
                                  /tokenize, /detokenize
    surfaces/routes_anthropic.py  /v1/messages, /v1/messages/count_tokens (Anthropic's)
    surfaces/routes_scoring.py    /rerank, /v1/rerank, /v2/rerank, /score, /v1/score,
                                  /classify, /v1/classify (with --runner pooling)
    routes_admin.py               /health, /ping, /metrics, /version, /openapi.json,
                                  /reset_prefix_cache
    routes_lora.py                /v1/load_lora_adapter, /v1/unload_lora_adapter
                                  (with --enable-lora)
    tenancy/routes_usage.py       /v1/usage (each tenant's requests and tokens; admin keys)
    observability/routes_dashboard.py  /dashboard (the live status page), /dashboard/state
    routes_sleep.py               /sleep, /wake_up, /is_sleeping (with --enable-sleep-mode)

A route module has module-level handlers, which find the core with `context_of(request)`,
and `routes(ctx) -> list[Route]`; adding a surface is one more line in ROUTE_MODULES.

Every error is OpenAI's body `{"error": {"message", "type", "param", "code"}}` (unknown
routes and methods too), but Anthropic's `{"type": "error", "error": {"type", "message"}}`
on /v1/messages. With API keys (services/api/auth.py), /v1/* needs `Authorization: Bearer
<key>` (or `x-api-key`), and /dashboard a key too (observability/routes_dashboard.py: a login form
and a session cookie); the other routes stay open, as in vLLM. Request bounds (body size, n, prompt
characters, ...) are services/api/serving/limits.py's; a full engine queue is a 429 with
Retry-After. With --enable-request-id-headers every response carries `X-Request-Id`: the client's,
else the id the request got, else a fresh one.
"""

from __future__ import annotations

import uuid

from starlette.applications import Starlette
from starlette.datastructures import Headers, MutableHeaders
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

from kvserve.services.api import routes_admin, routes_lora, routes_sleep
from kvserve.services.api.app_context import error_response, make_context
from kvserve.services.api.auth import APIKeyMiddleware
from kvserve.services.api.engine_client.client import EngineClient
from kvserve.services.api.observability import routes_dashboard
from kvserve.services.api.observability.metrics import ApiMetrics
from kvserve.services.api.observability.tracing import TracingMiddleware, make_tracer
from kvserve.services.api.serving.base import REQUEST_ID_HEADER
from kvserve.services.api.serving.errors import APIError
from kvserve.services.api.serving.limits import BodySizeLimitMiddleware
from kvserve.services.api.surfaces import routes_anthropic, routes_openai, routes_scoring
from kvserve.services.api.tenancy import routes_usage
from kvserve.services.api.tenancy.tenants import TenantDirectory, TenantMiddleware
from kvserve.shared.api_config import FrontendConfig, HTTPConfig
from kvserve.shared.config import LoRAConfig

# The API surfaces: each module's routes(ctx) joins the app.
ROUTE_MODULES = (
    routes_openai,
    routes_anthropic,
    routes_scoring,
    routes_admin,
    routes_lora,
    routes_usage,
    routes_dashboard,
    routes_sleep,
)


def build_app(
    engine_client: EngineClient,
    *,
    served_model_name: str,
    api_key: str | None = None,
    http: HTTPConfig | None = None,
    frontend: FrontendConfig | None = None,
    api_keys: dict[str, str] | None = None,
    lora_config: LoRAConfig | None = None,
    tenants: TenantDirectory | None = None,
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
        tenants: the keys and tenants (TenantDirectory, reloaded on SIGHUP); None builds
            one from `http` and `frontend.tenants`, with api_key and api_keys added.
    """
    frontend = frontend or FrontendConfig()
    http = http or HTTPConfig()
    if tenants is None:
        tenants = TenantDirectory(http, frontend.tenants)
        tenants.keys = dict(api_keys or {}) | tenants.keys
        if api_key:
            tenants.keys.setdefault("default", api_key)
    ctx = make_context(engine_client, served_model_name, frontend, lora_config, tenants)
    app = Starlette(
        routes=[route for module in ROUTE_MODULES for route in module.routes(ctx)],
        middleware=_middleware(http, frontend, tenants, ctx.metrics),
        exception_handlers={404: _routing_error, 405: _routing_error},
    )
    app.state.ctx = ctx
    return app


async def _routing_error(request: Request, exc: Exception) -> Response:
    """An unknown path (404) or a method its route does not take (405, with `Allow`) in the
    API's JSON error body, not Starlette's plain text: clients parse the body of any error."""
    assert isinstance(exc, HTTPException)
    what = "no such route" if exc.status_code == 404 else "method not allowed on this route"
    return error_response(
        APIError(
            exc.status_code,
            f"{request.method} {request.url.path}: {what}",
            headers=dict(exc.headers or {}),
        )
    )


def _middleware(
    http: HTTPConfig, frontend: FrontendConfig, tenants: TenantDirectory, metrics: ApiMetrics
) -> list[Middleware]:
    """Outermost first."""
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
    if frontend.otlp_traces_endpoint:
        # Outside the key check: a refused request is traced too. OpenTelemetry is imported
        # only here (and by the spans' helpers), so a server without the flag never loads it.
        tracer = make_tracer(frontend.otlp_traces_endpoint)
        middleware.append(Middleware(TracingMiddleware, tracer=tracer))
    if frontend.enable_request_id_headers:
        # Outside the API-key check, so a 401 carries the id too.
        middleware.append(Middleware(_RequestIdMiddleware))
    if tenants.keys:
        middleware.append(
            Middleware(
                APIKeyMiddleware,
                keys=tenants.keys,
                registry=metrics.registry,
                route_path=_route_path,
                current_keys=lambda: tenants.keys,
            )
        )
    # Inside the key check: the tenant is the key's name.
    middleware.append(Middleware(TenantMiddleware, directory=tenants))
    # Inside the key check: a client without a key cannot make the server buffer a body.
    middleware.append(
        Middleware(BodySizeLimitMiddleware, max_bytes=frontend.limits.max_request_body_bytes)
    )
    return middleware


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
