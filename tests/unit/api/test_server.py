"""build_app: the app is the routes of its route modules (one per API surface) over one
shared serving core, `app.state.ctx`."""

from __future__ import annotations

from types import SimpleNamespace

import httpx
import pytest
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response
from starlette.routing import Route

from kvserve.services.api import server
from kvserve.services.api.app_context import AppContext, context_of
from kvserve.services.api.engine_client.client import EngineClient
from kvserve.services.api.server import build_app
from kvserve.services.api.serving.tokenizer import TokenizerInfo
from kvserve.shared.api_config import FrontendConfig
from kvserve.shared.config import LoRAConfig

BASE_ROUTES = {
    "/v1/completions",
    "/v1/chat/completions",
    "/v1/responses",
    "/v1/embeddings",
    "/rerank",  # the scoring routes answer 400 unless the server runs --runner pooling
    "/v1/rerank",
    "/v2/rerank",
    "/score",
    "/v1/score",
    "/classify",
    "/v1/classify",
    "/v1/responses/{response_id}",
    "/v1/messages",
    "/v1/messages/count_tokens",
    "/v1/models",
    "/v1/usage",
    "/tokenize",
    "/detokenize",
    "/health",
    "/ping",
    "/version",
    "/reset_prefix_cache",
    "/metrics",
    "/openapi.json",
    "/dashboard",
    "/dashboard/state",
    "/dashboard/login",
    "/dashboard/logout",
    "/dashboard/app.js",
    "/dashboard/app.css",
    "/sleep",  # answered 404 unless the engines run with --enable-sleep-mode
    "/wake_up",
    "/is_sleeping",
}
LORA = {"/v1/load_lora_adapter", "/v1/unload_lora_adapter"}
QUIET = FrontendConfig(disable_log_stats=True)


@pytest.fixture(scope="module")
def tokenizer_info(tiny_llama_dir) -> TokenizerInfo:
    return TokenizerInfo(tiny_llama_dir)


def paths(app) -> set[str]:
    return {route.path for route in app.routes}


def test_routes_are_the_route_modules_and_lora_only_when_enabled(tokenizer_info):
    client = EngineClient(tokenizer_info, 256, "tiny")
    assert paths(build_app(client, served_model_name="tiny", frontend=QUIET)) == BASE_ROUTES
    with_lora = build_app(
        client, served_model_name="tiny", frontend=QUIET, lora_config=LoRAConfig(enable_lora=True)
    )
    assert paths(with_lora) == BASE_ROUTES | LORA


@pytest.mark.anyio
async def test_a_new_surface_is_one_more_route_module(tokenizer_info, monkeypatch):
    async def echo_model(request: Request) -> Response:
        return PlainTextResponse(context_of(request).served_model_name)

    def routes(ctx: AppContext) -> list[Route]:
        return [Route("/v1/echo_model", echo_model, methods=["GET"])]

    surface = SimpleNamespace(routes=routes)
    monkeypatch.setattr(server, "ROUTE_MODULES", (*server.ROUTE_MODULES, surface))
    app = build_app(EngineClient(tokenizer_info, 256, "tiny"), served_model_name="tiny")
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
        assert (await client.get("/v1/echo_model")).text == "tiny"
        assert (await client.get("/health")).status_code == 200


@pytest.mark.anyio
async def test_sleep_routes_are_404_without_sleep_mode(tokenizer_info):
    """As vLLM's, where the routes are not registered without --enable-sleep-mode."""
    app = build_app(EngineClient(tokenizer_info, 256, "tiny"), served_model_name="tiny")
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
        for method, path in (("POST", "/sleep"), ("POST", "/wake_up"), ("GET", "/is_sleeping")):
            response = await client.request(method, path)
            assert response.status_code == 404, (path, response.text)
            assert "--enable-sleep-mode" in response.json()["error"]["message"]
