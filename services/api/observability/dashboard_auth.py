"""Who may see the status page when API keys are set: a browser logs in once with its key.

A browser cannot add `Authorization: Bearer` to a page load, and a key in the URL
(`?key=`) would stay in the history, in proxies' and uvicorn's access logs and in a
Referer. So /dashboard/login is a form that POSTs the key in the body; a known key gets a
session cookie and a redirect to /dashboard:

    kvserve_dashboard=<expiry>.<HMAC-SHA256(key, "kvserve-dashboard:" + expiry)>
    HttpOnly; SameSite=Strict; Path=<root path>/dashboard; Max-Age=12 h; Secure on https

The cookie is derived from the key, never the key: it opens the page and its JSON only (not
/v1/*), stops working at its expiry, and stops at once when its key is removed from the key
file (SIGHUP). Nothing is stored on the server, so every api process accepts it. Scripts may
send `Authorization: Bearer <key>` instead. Each key is compared in constant time, none
skipped (auth.match_key's rule).
"""

from __future__ import annotations

import hashlib
import hmac
import time
from collections.abc import Callable

from starlette.requests import Request

from kvserve.services.api.auth import match_key

COOKIE_NAME = "kvserve_dashboard"
SESSION_S = 12 * 3600
_DOMAIN = b"kvserve-dashboard:"


def session_token(key: str, expires: int) -> str:
    """The cookie value that `key` gets, valid until unix second `expires`."""
    mac = hmac.new(key.encode(), _DOMAIN + str(expires).encode(), hashlib.sha256)
    return f"{expires}.{mac.hexdigest()}"


def token_key_name(
    token: str, keys: dict[str, str], clock: Callable[[], float] = time.time
) -> str | None:
    """The name of the key whose unexpired session `token` is, or None."""
    expires_text, _, _ = token.partition(".")
    if not expires_text.isdigit() or len(expires_text) > 12:
        return None
    expires = int(expires_text)
    now = clock()
    if not now < expires <= now + SESSION_S + 60:
        return None
    found = None
    for name, key in keys.items():
        if hmac.compare_digest(token.encode(), session_token(key, expires).encode()):
            found = name
    return found


def request_key_name(request: Request, keys: dict[str, str]) -> str | None:
    """The name of the key a dashboard request carries (its bearer key or its session
    cookie), or None."""
    given = request.headers.get("authorization")
    if given:
        return match_key(given.encode(), {n: f"Bearer {k}".encode() for n, k in keys.items()})
    token = request.cookies.get(COOKIE_NAME)
    return token_key_name(token, keys) if token else None


def login_key_name(key: str, keys: dict[str, str]) -> str | None:
    """The name of the key typed into the login form, or None."""
    return match_key(key.encode(), {name: k.encode() for name, k in keys.items()})


def cookie_path(request: Request) -> str:
    """The page's path under uvicorn's --root-path."""
    return request.scope.get("root_path", "") + "/dashboard"
