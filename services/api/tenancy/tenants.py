"""Tenants: who a request is served for, and what each may use.

A tenant is the name of the API key a request used (--api-key-file), or, when the operator
trusts a front end to say it (--tenant-header X-Tenant), that header's value; traffic that
names none is tenant "default". The tenant travels in the engine request (the fair scheduler
serves tenants by their weighted service) and keys the quotas (services/api/tenancy/quotas.py) and
the usage counters (services/api/tenancy/usage.py).

A key file line may give its key's tenant a weight and quotas after the key:

    # name:key [weight=W] [max_concurrent=N] [tokens_per_minute=N] [requests_per_minute=N]
    #          [slo_ttft_ms=MS] [slo_tpot_ms=MS]
    search:sk-4f9a weight=2 tokens_per_minute=200000 slo_ttft_ms=500
    batch:sk-77e1 max_concurrent=8

The slo_* columns are the tenant's latency targets, for its requests that set none of their
own (services/api/serving/latency_targets.py).

Quotas not given on the line come from the --tenant-* flags (none: unlimited). The file is
read again on SIGHUP (TenantDirectory.reload): keys, weights and quotas change without a
restart; a line that does not parse keeps the old file in force.
"""

from __future__ import annotations

import contextvars
import math
import re

import msgspec
from starlette.datastructures import Headers
from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

from kvserve.services.api.serving.errors import APIError
from kvserve.shared.api_config import HTTPConfig, TenantConfig

DEFAULT_TENANT = "default"
DEFAULT_KEY_NAME = "default"  # the name of --api-key's key
# A tenant named by a header: letters, digits and ._-@: (a label value and a JSON key).
_TENANT_NAME = re.compile(r"^[A-Za-z0-9._@:-]{1,64}$")


class TenantSpec(msgspec.Struct, frozen=True, kw_only=True):
    """One tenant's weight (its share under --scheduling-policy fair) and quotas (None:
    unlimited)."""

    name: str
    weight: float = 1.0
    max_concurrent: int | None = None
    tokens_per_minute: int | None = None
    requests_per_minute: int | None = None
    # Latency targets in ms for requests that name none (None: the server's --slo-*-ms).
    slo_ttft_ms: float | None = None
    slo_tpot_ms: float | None = None


_OPTION_TYPES = {
    "weight": float,
    "max_concurrent": int,
    "tokens_per_minute": int,
    "requests_per_minute": int,
    "slo_ttft_ms": float,
    "slo_tpot_ms": float,
}


class KeyLine(msgspec.Struct, frozen=True):
    """One key of the key file: its name, the key, and the options after it."""

    name: str
    key: str
    options: dict[str, float | int]


def parse_key_file(path: str) -> list[KeyLine]:
    """The key file's `name:key [option=value ...]` lines (blank lines and `#` comments
    skipped).

    Raises:
        ValueError: a malformed line (its number is named, its key never): no name or key,
            an unknown option, a value that is not a positive number; a name or key given
            twice.
    """
    with open(path, encoding="utf-8") as f:
        lines = f.read().splitlines()
    parsed: list[KeyLine] = []
    for line_number, line in enumerate(lines, start=1):
        text = line.strip()
        if not text or text.startswith("#"):
            continue
        where = f"{path} line {line_number}"
        name, sep, rest = (part.strip() for part in text.partition(":"))
        key, *option_texts = rest.split() if rest else [""]
        if not sep or not name or not key:
            raise ValueError(f"{where}: expected 'name:key' with a non-empty name and key")
        options: dict[str, float | int] = {}
        for option in option_texts:
            option_name, eq, value = option.partition("=")
            kind = _OPTION_TYPES.get(option_name)
            if kind is None or not eq:
                raise ValueError(
                    f"{where}: unknown option {option_name!r}; use "
                    + ", ".join(f"{o}=N" for o in _OPTION_TYPES)
                )
            try:
                number = kind(value)
            except ValueError:
                number = 0
            if not (number > 0 and math.isfinite(number)):
                raise ValueError(f"{where}: {option_name} must be a positive number")
            options[option_name] = number
        if any(p.name == name for p in parsed):
            raise ValueError(f"{where}: the key name {name!r} is used twice")
        if any(p.key == key for p in parsed):
            raise ValueError(f"{where}: this key is given twice (named {name!r} here)")
        parsed.append(KeyLine(name, key, options))
    return parsed


class TenantDirectory:
    """The keys (name -> key) and every tenant's TenantSpec, from --api-key, --api-key-file
    and the --tenant-* flags; `reload` reads the key file again.

    Args:
        http: --api-key (named "default") and --api-key-file.
        config: the --tenant-* flags: the quotas a key file line does not set.
    """

    def __init__(self, http: HTTPConfig, config: TenantConfig):
        self.http = http
        self.config = config
        self.keys: dict[str, str] = {}
        self._specs: dict[str, TenantSpec] = {}
        self.reload()

    def reload(self) -> None:
        """Read the keys and tenants again (SIGHUP). On an error the old ones stay.

        Raises:
            ValueError, OSError: the key file does not parse or cannot be read.
        """
        keys: dict[str, str] = {}
        specs: dict[str, TenantSpec] = {}
        if self.http.effective_api_key:
            keys[DEFAULT_KEY_NAME] = self.http.effective_api_key
        lines = parse_key_file(self.http.api_key_file) if self.http.api_key_file else []
        for line in lines:
            if line.name in keys:
                raise ValueError(
                    f"{self.http.api_key_file}: the key name {line.name!r} is used twice"
                )
            if line.key in keys.values():
                raise ValueError(
                    f"{self.http.api_key_file}: this key is given twice (named {line.name!r})"
                )
            keys[line.name] = line.key
            specs[line.name] = self._spec(line.name, line.options)
        self.keys, self._specs = keys, specs

    @property
    def tightest_ttft_ms(self) -> float | None:
        """The tightest TTFT target the key file gives a tenant (None: none gives one): a
        request of that tenant may arrive at any time, so every engine request carries it
        (EngineCoreRequest.standing_ttft_ms) and a step leaves room for one arriving."""
        targets = [s.slo_ttft_ms for s in self._specs.values() if s.slo_ttft_ms is not None]
        return min(targets, default=None)

    def _spec(self, name: str, options: dict[str, float | int]) -> TenantSpec:
        defaults: dict[str, float | int | None] = {
            "max_concurrent": self.config.tenant_max_concurrent,
            "tokens_per_minute": self.config.tenant_tokens_per_minute,
            "requests_per_minute": self.config.tenant_requests_per_minute,
        }
        return msgspec.convert({"name": name, **defaults, **options}, TenantSpec)

    def get(self, name: str) -> TenantSpec:
        """The tenant's spec: its key file line's, else the flags' defaults (not kept: a
        trusted header may name any number of tenants)."""
        spec = self._specs.get(name)
        return spec if spec is not None else self._spec(name, {})

    def names(self) -> list[str]:
        """The tenants the key file names (and "default")."""
        return sorted({DEFAULT_TENANT, *self._specs})


# The tenant of the request being handled: TenantMiddleware sets it for every request, and
# the serving code hands it to the engine client.
CURRENT_TENANT: contextvars.ContextVar[TenantSpec | None] = contextvars.ContextVar(
    "kvserve_tenant", default=None
)


def tenant_name_from_header(value: str) -> str | None:
    """The tenant a trusted header names, or None when the value is not a usable name."""
    value = value.strip()
    return value if _TENANT_NAME.match(value) else None


class TenantMiddleware:
    """Sets CURRENT_TENANT for each request: the trusted header's tenant (--tenant-header),
    else the API key's name (APIKeyMiddleware puts it in scope["state"]), else "default".

    Args:
        app: the app behind it.
        directory: the tenants' specs.
    """

    def __init__(self, app: ASGIApp, directory: TenantDirectory):
        self.app = app
        self.directory = directory
        header = directory.config.tenant_header
        self.header = header.lower() if header else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        name = None
        if self.header is not None:
            value = Headers(scope=scope).get(self.header)
            if value is not None:
                name = tenant_name_from_header(value)
                if name is None:
                    message = (
                        f"header {self.directory.config.tenant_header}: a tenant name is 1 to "
                        f"64 letters, digits or ._@:-"
                    )
                    body = msgspec.json.encode(APIError(400, message).to_body())
                    response = Response(body, status_code=400, media_type="application/json")
                    await response(scope, receive, send)
                    return
        if name is None:
            name = scope.get("state", {}).get("api_key_name") or DEFAULT_TENANT
        spec = self.directory.get(name)
        scope.setdefault("state", {})["tenant"] = spec.name
        token = CURRENT_TENANT.set(spec)
        try:
            await self.app(scope, receive, send)
        finally:
            CURRENT_TENANT.reset(token)
