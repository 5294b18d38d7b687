"""The bounds on a request's bytes (--max-* flags, LimitsConfig), checked before the work
they bound, so an oversized request costs microseconds:

    bytes on the socket ─▶ BodySizeLimitMiddleware   Content-Length, then bytes as they
                                                     arrive: 413 past --max-request-body-bytes
    the whole body ──────▶ protocol.json_depth       nesting past --max-json-depth: 400,
                                                     before msgspec decodes it
    the decoded request ─▶ validation.py             every other bound and check

Queue bounds (--max-waiting-requests) are the engine client's (EngineClient.check_capacity).
"""

from __future__ import annotations

import msgspec
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvserve.services.api.serving.errors import APIError

# A prompt may hold at most this many characters per max_model_len token (when
# --max-prompt-chars is not given): far above any tokenizer's average (3-5), so no prompt
# that fits the context is refused, yet a 64 MiB one is refused before it is tokenized.
CHARS_PER_TOKEN_BOUND = 32


def over_limit(param: str | None, what: str, value: int, limit: int, flag: str) -> APIError:
    return APIError(
        400, f"{what} is {value}, more than the limit of {limit} (--{flag})", param=param
    )


# --------------------------------------------------------------------------- body size


class BodySizeLimitMiddleware:
    """Reads a request's body up to `max_bytes` before the app sees it: a bigger one is a 413
    (from its Content-Length at once, else as soon as the bytes run over), never parsed.

    The app then receives the body as one message, and what the client sends afterwards
    (http.disconnect) as usual.
    """

    def __init__(self, app: ASGIApp, max_bytes: int):
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "OPTIONS"):
            await self.app(scope, receive, send)
            return
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.max_bytes):
            size = f"Content-Length {length.decode('latin-1')!r}"
            await self._refuse(scope, receive, send, size)
            return
        chunks: list[bytes] = []
        num_bytes = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client went away
                await self.app(scope, _replay([message], receive), send)
                return
            chunk = message.get("body", b"")
            num_bytes += len(chunk)
            if num_bytes > self.max_bytes:
                await self._refuse(scope, receive, send, f"over {num_bytes} bytes so far")
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body = {"type": "http.request", "body": b"".join(chunks), "more_body": False}
        await self.app(scope, _replay([body], receive), send)

    async def _refuse(self, scope: Scope, receive: Receive, send: Send, size: str) -> None:
        exc = APIError(
            413,
            f"the request body ({size}) is over the limit of {self.max_bytes} bytes "
            f"(--max-request-body-bytes)",
        )
        # Connection: close: the unread rest of the body must not be taken for a request.
        response = Response(
            msgspec.json.encode(exc.to_body()),
            status_code=exc.status_code,
            media_type="application/json",
            headers={"connection": "close"},
        )
        await response(scope, receive, send)


def _replay(messages: list[Message], receive: Receive) -> Receive:
    async def replayed() -> Message:
        return messages.pop(0) if messages else await receive()

    return replayed
