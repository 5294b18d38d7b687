"""Tenants (services/api/tenancy/tenants.py): key file columns, the flags' defaults, reloading, and
the middleware that names each request's tenant under a real starlette app."""

from __future__ import annotations

import httpx
import pytest
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from kvserve.services.api.tenancy.tenants import (
    CURRENT_TENANT,
    TenantDirectory,
    TenantMiddleware,
    TenantSpec,
    parse_key_file,
)
from kvserve.shared.api_config import HTTPConfig, TenantConfig


@pytest.fixture(autouse=True)
def no_key_env(monkeypatch):
    monkeypatch.delenv("KVSERVE_API_KEY", raising=False)
    monkeypatch.delenv("VLLM_API_KEY", raising=False)


def _key_file(tmp_path, text: str) -> str:
    path = tmp_path / "keys"
    path.write_text(text)
    return str(path)


def test_key_file_columns_override_the_flags(tmp_path):
    path = _key_file(
        tmp_path,
        "# name:key [option=value ...]\n"
        "search:sk-1 weight=2 tokens_per_minute=5000\n"
        "batch:sk-2   max_concurrent=8 requests_per_minute=60\n"
        "plain:sk-3\n",
    )
    directory = TenantDirectory(
        HTTPConfig(api_key_file=path), TenantConfig(tenant_max_concurrent=4)
    )
    assert directory.keys == {"search": "sk-1", "batch": "sk-2", "plain": "sk-3"}
    assert directory.get("search") == TenantSpec(
        name="search", weight=2.0, max_concurrent=4, tokens_per_minute=5000
    )
    assert directory.get("batch") == TenantSpec(
        name="batch", max_concurrent=8, requests_per_minute=60
    )
    assert directory.get("plain") == TenantSpec(name="plain", max_concurrent=4)
    # A tenant no key names (a trusted header's) gets the flags' quotas, weight 1.
    assert directory.get("elsewhere") == TenantSpec(name="elsewhere", max_concurrent=4)
    assert directory.names() == ["batch", "default", "plain", "search"]


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("a:k speed=3", "unknown option 'speed'"),
        ("a:k weight", "unknown option 'weight'"),
        ("a:k weight=0", "weight must be a positive number"),
        ("a:k max_concurrent=1.5", "max_concurrent must be a positive number"),
        ("a:k tokens_per_minute=-3", "tokens_per_minute must be a positive number"),
        ("a", "expected 'name:key'"),
    ],
)
def test_bad_lines_name_the_line_and_never_the_key(tmp_path, line, message):
    path = _key_file(tmp_path, line + "\n")
    with pytest.raises(ValueError, match=message) as info:
        parse_key_file(path)
    assert "line 1" in str(info.value)


def test_a_key_or_name_given_twice_is_refused(tmp_path):
    with pytest.raises(ValueError, match="used twice"):
        parse_key_file(_key_file(tmp_path, "a:k1\na:k2\n"))
    with pytest.raises(ValueError, match="given twice") as info:
        parse_key_file(_key_file(tmp_path, "a:secret\nb:secret\n"))
    assert "secret" not in str(info.value)


def test_reload_reads_the_file_again_and_keeps_it_on_an_error(tmp_path):
    path = _key_file(tmp_path, "a:k1 max_concurrent=1\n")
    directory = TenantDirectory(HTTPConfig(api_key_file=path), TenantConfig())
    keys = directory.keys
    _key_file(tmp_path, "a:k1 max_concurrent=3\nb:k2\n")
    directory.reload()
    assert directory.get("a").max_concurrent == 3
    assert directory.keys == {"a": "k1", "b": "k2"} and directory.keys is not keys
    _key_file(tmp_path, "a:k1 max_concurrent=oops\n")
    with pytest.raises(ValueError):
        directory.reload()
    assert directory.get("a").max_concurrent == 3 and "b" in directory.keys


async def _tenant_of(app: Starlette, headers: dict[str, str] | None = None) -> httpx.Response:
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
        return await client.get("/v1/who", headers=headers or {})


def _app(directory: TenantDirectory, key_name: str | None = None) -> Starlette:
    async def who(request: Request) -> JSONResponse:
        spec = CURRENT_TENANT.get()
        assert spec is not None and request.state.tenant == spec.name
        return JSONResponse({"tenant": spec.name, "weight": spec.weight})

    class FakeKeyCheck:  # what APIKeyMiddleware leaves in the scope for a named key
        def __init__(self, app):
            self.app = app

        async def __call__(self, scope, receive, send):
            if key_name is not None:
                scope.setdefault("state", {})["api_key_name"] = key_name
            await self.app(scope, receive, send)

    return Starlette(
        routes=[Route("/v1/who", who)],
        middleware=[
            Middleware(FakeKeyCheck),
            Middleware(TenantMiddleware, directory=directory),
        ],
    )


@pytest.mark.anyio
async def test_the_tenant_is_the_keys_name_else_default(tmp_path):
    path = _key_file(tmp_path, "gold:k1 weight=3\n")
    directory = TenantDirectory(HTTPConfig(api_key_file=path), TenantConfig())
    assert (await _tenant_of(_app(directory, "gold"))).json() == {"tenant": "gold", "weight": 3.0}
    assert (await _tenant_of(_app(directory))).json()["tenant"] == "default"
    # Without --tenant-header a client cannot name another tenant.
    response = await _tenant_of(_app(directory, "gold"), {"X-Tenant": "other"})
    assert response.json()["tenant"] == "gold"


@pytest.mark.anyio
async def test_a_trusted_header_names_the_tenant(tmp_path):
    directory = TenantDirectory(HTTPConfig(), TenantConfig(tenant_header="X-Tenant"))
    app = _app(directory, "frontend")
    assert (await _tenant_of(app, {"x-tenant": "acme"})).json()["tenant"] == "acme"
    assert (await _tenant_of(app)).json()["tenant"] == "frontend"  # no header: the key's
    bad = await _tenant_of(app, {"X-Tenant": "no spaces allowed"})
    assert bad.status_code == 400
    assert "X-Tenant" in bad.json()["error"]["message"]


def test_the_tightest_ttft_target_of_the_key_file_follows_a_reload(tmp_path):
    path = _key_file(tmp_path, "a:sk-1 slo_ttft_ms=800\nb:sk-2 slo_ttft_ms=500 slo_tpot_ms=9\n")
    directory = TenantDirectory(HTTPConfig(api_key_file=path), TenantConfig())
    assert directory.tightest_ttft_ms == 500.0
    _key_file(tmp_path, "a:sk-1 slo_tpot_ms=50\nb:sk-2\n")
    directory.reload()
    assert directory.tightest_ttft_ms is None
