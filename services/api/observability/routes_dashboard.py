"""The status page: a live picture of the server in a browser, served by the api itself.

GET  /dashboard            the page (HTML); its script and style below; no build step, no
                           CDN: nothing it loads comes from elsewhere (its CSP says so too)
GET  /dashboard/app.js     the page's script: polls /dashboard/state every 1.5 s, draws
                           inline SVG charts
GET  /dashboard/app.css    its style (responsive: a phone-sized screen shows one column)
GET  /dashboard/state      the figures as JSON (dashboard.py's DashboardState)
GET|POST /dashboard/login  with API keys: the login form, and its key check (a cookie)
POST /dashboard/logout     forget the session cookie

Without API keys everything is open, as /metrics is. With keys, the page and its JSON need
one (dashboard_auth.py: a login form sets a session cookie; scripts may send the bearer
key): without, the page redirects to the login form and /dashboard/state answers 401.
Per-tenant usage shows to the keys that may read GET /v1/usage (--usage-admin-keys) only.
The script and style are public: they hold no figure.
"""

from __future__ import annotations

import functools
import time
import urllib.parse
from pathlib import Path

from starlette.requests import Request
from starlette.responses import RedirectResponse, Response
from starlette.routing import Route

from kvserve.services.api.app_context import AppContext, context_of, json_response, with_errors
from kvserve.services.api.observability.dashboard import dashboard_state
from kvserve.services.api.observability.dashboard_auth import (
    COOKIE_NAME,
    SESSION_S,
    cookie_path,
    login_key_name,
    request_key_name,
    session_token,
)
from kvserve.services.api.routes_admin import KVSERVE_VERSION
from kvserve.services.api.serving.errors import APIError

STATIC_DIR = Path(__file__).parent / "dashboard_static"
_CONTENT_TYPES = {".html": "text/html", ".js": "text/javascript", ".css": "text/css"}
# Only this server: no inline script or style, no other origin, no framing.
_PAGE_HEADERS = {
    "Content-Security-Policy": (
        "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
        "img-src 'self' data:; form-action 'self'; frame-ancestors 'none'; base-uri 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store",
}
_LOGIN_FAILED = '<p class="error">That key is not known.</p>'


@functools.cache
def _static(name: str) -> bytes:
    return (STATIC_DIR / name).read_bytes()


def _file(name: str, status_code: int = 200, body: bytes | None = None) -> Response:
    content_type = _CONTENT_TYPES[Path(name).suffix] + "; charset=utf-8"
    return Response(
        _static(name) if body is None else body,
        status_code,
        headers=_PAGE_HEADERS,
        media_type=content_type,
    )


def _key_name(request: Request, ctx: AppContext) -> str | None:
    """The request's key name; "" when no key is configured (all may see the page)."""
    keys = ctx.tenants.keys
    return request_key_name(request, keys) if keys else ""


def _redirect(request: Request, path: str) -> RedirectResponse:
    return RedirectResponse(request.scope.get("root_path", "") + path, status_code=303)


async def page(request: Request) -> Response:
    if _key_name(request, context_of(request)) is None:
        return _redirect(request, "/dashboard/login")
    return _file("index.html")


async def state(request: Request) -> Response:
    ctx = context_of(request)
    key_name = _key_name(request, ctx)
    if key_name is None:
        raise APIError(401, "the status page needs an API key: log in at /dashboard/login")
    show_tenants = key_name == "" or key_name in ctx.tenants.config.usage_admin_keys
    body = dashboard_state(
        ctx.dashboard,
        ctx.served_model_name,
        KVSERVE_VERSION,
        show_tenants,
        needs_key=bool(ctx.tenants.keys),
    )
    response = json_response(body)
    response.headers["Cache-Control"] = "no-store"
    return response


async def login_form(request: Request) -> Response:
    return _file("login.html")


async def login(request: Request) -> Response:
    keys = context_of(request).tenants.keys
    form = urllib.parse.parse_qs((await request.body()).decode("utf-8", "replace"))
    key = (form.get("key") or [""])[0].strip()
    if not keys:
        return _redirect(request, "/dashboard")
    if login_key_name(key, keys) is None:
        page = _static("login.html").replace(b"<!--error-->", _LOGIN_FAILED.encode())
        return _file("login.html", 401, page)
    expires = int(time.time()) + SESSION_S
    response = _redirect(request, "/dashboard")
    response.set_cookie(
        COOKIE_NAME,
        session_token(key, expires),
        max_age=SESSION_S,
        path=cookie_path(request),
        secure=request.url.scheme == "https",
        httponly=True,
        samesite="strict",
    )
    return response


async def logout(request: Request) -> Response:
    response = _redirect(request, "/dashboard/login")
    response.delete_cookie(COOKIE_NAME, path=cookie_path(request))
    return response


async def script(request: Request) -> Response:
    return _file("app.js")


async def style(request: Request) -> Response:
    return _file("app.css")


def routes(ctx: AppContext) -> list[Route]:
    return [
        Route("/dashboard", with_errors(page), methods=["GET"]),
        Route("/dashboard/state", with_errors(state), methods=["GET"]),
        Route("/dashboard/login", login_form, methods=["GET"]),
        Route("/dashboard/login", with_errors(login), methods=["POST"]),
        Route("/dashboard/logout", logout, methods=["POST"]),
        Route("/dashboard/app.js", script, methods=["GET"]),
        Route("/dashboard/app.css", style, methods=["GET"]),
    ]
