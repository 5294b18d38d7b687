"""API keys: /v1/* needs `Authorization: Bearer <key>` (or Anthropic's `x-api-key: <key>`)
once any key is configured.

Keys come from --api-key (else $KVSERVE_API_KEY, else $VLLM_API_KEY), named "default", and
from --api-key-file, a file of `name:key` lines (blank lines and `#` comments skipped). A
key's name, never the key, is what the server shows: in the request log line
(--enable-log-requests) and as the `key_name` label of kvserve:api_key_requests_total.
"""

from __future__ import annotations

import hmac
from collections.abc import Callable

import msgspec
from prometheus_client import CollectorRegistry, Counter
from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

from kvserve.services.api.observability.request_logger import API_KEY_NAME
from kvserve.services.api.serving.errors import APIError
from kvserve.services.api.surfaces.anthropic_protocol import error_body
from kvserve.services.api.tenancy.tenants import DEFAULT_KEY_NAME, TenantDirectory
from kvserve.shared.api_config import HTTPConfig, TenantConfig

__all__ = ["DEFAULT_KEY_NAME", "APIKeyMiddleware", "load_api_keys", "match_key"]


def load_api_keys(http: HTTPConfig) -> dict[str, str]:
    """name -> key, from --api-key (or its env vars) and --api-key-file; {} means no auth.

    Raises:
        ValueError: a malformed key file line (its number is named, its key never), an
            empty key, or a name or key given twice.
    """
    return TenantDirectory(http, TenantConfig()).keys


def match_key(given: bytes, expected: dict[str, bytes]) -> str | None:
    """The name of the key `given` equals, or None; every key is compared in constant time
    (hmac.compare_digest) and none is skipped, so the timing tells nothing of which matched."""
    found = None
    for name, key in expected.items():
        if hmac.compare_digest(given, key):
            found = name
    return found


class APIKeyMiddleware:
    """Rejects /v1/* requests without a known bearer key (401, OpenAI's error body).

    Args:
        app: the app behind it.
        keys: name -> key; a dict that TenantDirectory.reload replaces (SIGHUP) is read
            again through `current_keys` when given.
        registry: where kvserve:api_key_requests_total (by key_name) is registered.
        route_path: the request's path without the root path (server._route_path).
        current_keys: returns the keys now (the tenant directory's, reloaded on SIGHUP).
    """

    def __init__(
        self,
        app: ASGIApp,
        keys: dict[str, str],
        registry: CollectorRegistry,
        route_path,
        current_keys: Callable[[], dict[str, str]] | None = None,
    ):
        assert keys, "APIKeyMiddleware needs at least one key"
        self.app = app
        self.current_keys = current_keys or (lambda: keys)
        self._keys: dict[str, str] = {}
        self.expected: dict[str, bytes] = {}
        self.route_path = route_path
        self.requests_total = Counter(
            "kvserve:api_key_requests",
            "Authenticated /v1/* requests, by the name of the API key they used.",
            ["key_name"],
            registry=registry,
        )
        self._refresh()

    def _refresh(self) -> None:
        """Follow a reload of the keys (the same dict object: nothing to do)."""
        keys = self.current_keys()
        if keys is self._keys:
            return
        self._keys = keys
        self.expected = {name: f"Bearer {key}".encode() for name, key in keys.items()}
        for name in keys:  # every key's series exists from the start, at 0
            self.requests_total.labels(key_name=name)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not self.route_path(scope).startswith("/v1/"):
            await self.app(scope, receive, send)
            return
        self._refresh()
        headers = dict(scope["headers"])
        given = headers.get(b"authorization", b"")
        if not given and b"x-api-key" in headers:  # Anthropic's clients send the key so
            given = b"Bearer " + headers[b"x-api-key"]
        name = match_key(given, self.expected)
        if name is None:
            message = "invalid or missing API key: send 'Authorization: Bearer <key>'"
            if self.route_path(scope).startswith("/v1/messages"):  # Anthropic's error body
                body = msgspec.json.encode(error_body(401, message + " or 'x-api-key: <key>'"))
            else:
                body = msgspec.json.encode(APIError(401, message).to_body())
            response = Response(body, status_code=401, media_type="application/json")
            await response(scope, receive, send)
            return
        self.requests_total.labels(key_name=name).inc()
        scope.setdefault("state", {})["api_key_name"] = name
        token = API_KEY_NAME.set(name)
        try:
            await self.app(scope, receive, send)
        finally:
            API_KEY_NAME.reset(token)
