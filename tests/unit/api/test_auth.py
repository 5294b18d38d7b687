"""API keys (services/api/auth.py): the key file, the env vars, the constant-time match, and
the middleware under a real starlette app (401 body, metric by key name, the log's name)."""

from __future__ import annotations

import logging

import httpx
import pytest
from prometheus_client import CollectorRegistry, generate_latest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from kvserve.services.api.auth import APIKeyMiddleware, load_api_keys, match_key
from kvserve.services.api.observability.request_logger import RequestLogger
from kvserve.services.api.server import _route_path
from kvserve.shared.api_config import HTTPConfig
from kvserve.shared.sampling_params import SamplingParams


@pytest.fixture(autouse=True)
def no_key_env(monkeypatch):
    monkeypatch.delenv("KVSERVE_API_KEY", raising=False)
    monkeypatch.delenv("VLLM_API_KEY", raising=False)


def test_no_key_means_no_auth():
    assert load_api_keys(HTTPConfig()) == {}


def test_key_sources_in_order(monkeypatch):
    monkeypatch.setenv("VLLM_API_KEY", "from-vllm")
    assert load_api_keys(HTTPConfig()) == {"default": "from-vllm"}
    monkeypatch.setenv("KVSERVE_API_KEY", "from-kvserve")
    assert load_api_keys(HTTPConfig()) == {"default": "from-kvserve"}
    assert load_api_keys(HTTPConfig(api_key="from-flag")) == {"default": "from-flag"}


def test_key_file_lines(tmp_path):
    path = tmp_path / "keys"
    path.write_text("# team keys\n\nalice: sk-a:with:colons \n bob:sk-b\n")
    keys = load_api_keys(HTTPConfig(api_key="sk-main", api_key_file=str(path)))
    assert keys == {"default": "sk-main", "alice": "sk-a:with:colons", "bob": "sk-b"}


@pytest.mark.parametrize(
    "text, problem",
    [
        ("alice\n", "line 1"),
        ("alice:\n", "non-empty"),
        (":sk-x\n", "non-empty"),
        ("a:sk-1\na:sk-2\n", "used twice"),
        ("a:sk-1\nb:sk-1\n", "given twice"),
    ],
)
def test_bad_key_file_says_which_line_never_the_key(tmp_path, text, problem):
    path = tmp_path / "keys"
    path.write_text(text)
    with pytest.raises(ValueError, match=problem) as info:
        load_api_keys(HTTPConfig(api_key_file=str(path)))
    assert "sk-" not in str(info.value)


def test_match_key_names_the_key_or_none():
    expected = {"alice": b"Bearer sk-a", "bob": b"Bearer sk-b"}
    assert match_key(b"Bearer sk-b", expected) == "bob"
    assert match_key(b"Bearer sk-a", expected) == "alice"
    for wrong in (b"", b"Bearer sk-", b"Bearer sk-ab", b"sk-a", b"bearer sk-a"):
        assert match_key(wrong, expected) is None


def make_app(keys: dict[str, str]) -> tuple[APIKeyMiddleware, CollectorRegistry]:
    request_logger = RequestLogger()

    async def completions(request: Request) -> Response:
        request_logger.log_inputs("req-1", "hi", [1, 2], SamplingParams())
        return Response(request.scope["state"]["api_key_name"])

    async def health(request: Request) -> Response:
        return Response("ok")

    routes = [
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/health", health, methods=["GET"]),
    ]
    registry = CollectorRegistry()
    app = APIKeyMiddleware(Starlette(routes=routes), keys, registry, _route_path)
    return app, registry


async def request(app, method: str, path: str, key: str | None = None) -> httpx.Response:
    headers = {} if key is None else {"Authorization": f"Bearer {key}"}
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
        return await client.request(method, path, headers=headers)


def sample(registry: CollectorRegistry, name: str) -> float:
    value = registry.get_sample_value("kvserve:api_key_requests_total", {"key_name": name})
    assert value is not None
    return value


@pytest.mark.anyio
async def test_each_key_passes_under_its_name_and_is_counted(caplog):
    app, registry = make_app({"alice": "sk-a", "bob": "sk-b"})
    assert sample(registry, "alice") == sample(registry, "bob") == 0
    with caplog.at_level(logging.INFO):
        response = await request(app, "POST", "/v1/completions", "sk-b")
    assert response.status_code == 200 and response.text == "bob"
    assert (await request(app, "POST", "/v1/completions", "sk-a")).text == "alice"
    assert (await request(app, "POST", "/v1/completions", "sk-a")).text == "alice"
    assert sample(registry, "alice") == 2 and sample(registry, "bob") == 1
    assert "Received request req-1 (API key 'bob')" in caplog.text
    assert "sk-b" not in caplog.text and b"sk-" not in generate_latest(registry)


@pytest.mark.anyio
@pytest.mark.parametrize("key", [None, "sk-c", "sk-a "])
async def test_unknown_or_missing_key_is_401_with_openai_body(key):
    app, registry = make_app({"alice": "sk-a"})
    response = await request(app, "POST", "/v1/completions", key)
    assert response.status_code == 401
    error = response.json()["error"]
    assert error["type"] == "AuthenticationError" and error["code"] == 401
    assert sample(registry, "alice") == 0


@pytest.mark.anyio
async def test_routes_outside_v1_stay_open():
    app, _ = make_app({"alice": "sk-a"})
    assert (await request(app, "GET", "/health")).status_code == 200


@pytest.fixture
def anyio_backend():
    return "asyncio"
