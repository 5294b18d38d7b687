"""The bounds on what one request may ask for (--max-* flags, LimitsConfig).

Each is checked before the work it bounds, so an oversized request costs microseconds:

    bytes on the socket ─▶ BodySizeLimitMiddleware   Content-Length, then bytes as they
                                                     arrive: 413 past --max-request-body-bytes
    the whole body ──────▶ protocol.json_depth       nesting past --max-json-depth: 400,
                                                     before msgspec decodes it
    the decoded request ─▶ check_request_limits      n, prompts, characters (before any
                                                     tokenizing), stop strings, token-id
                                                     lists, messages, tools: 400 naming the
                                                     field and the flag

Queue bounds (--max-waiting-requests) are the engine client's (EngineClient.check_capacity).
"""

from __future__ import annotations

from typing import Any

import msgspec
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvserve.services.api.protocol import APIError
from kvserve.shared.config import LimitsConfig

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


# --------------------------------------------------------------------------- requests


def max_prompt_chars(limits: LimitsConfig, max_model_len: int) -> int:
    if limits.max_prompt_chars is not None:
        return limits.max_prompt_chars
    return CHARS_PER_TOKEN_BOUND * max_model_len


def check_prompt_chars(text_chars: int, limits: LimitsConfig, max_model_len: int, param: str):
    """A prompt of `text_chars` characters, refused before it is tokenized when longer than
    any prompt that could fit the context."""
    limit = max_prompt_chars(limits, max_model_len)
    if text_chars > limit:
        raise APIError(
            400,
            f"the prompt has {text_chars} characters, more than the limit of {limit} "
            f"(--max-prompt-chars; default {CHARS_PER_TOKEN_BOUND} x max_model_len "
            f"{max_model_len}): it cannot fit the model's context",
            param=param,
        )


def check_request_limits(request: Any, limits: LimitsConfig, max_model_len: int) -> None:
    """The bounds of a CompletionRequest or ChatCompletionRequest, before anything is
    tokenized or sent; raises APIError(400) naming the field and its flag."""
    if request.n > limits.max_n:
        raise over_limit("n", "n", request.n, limits.max_n, "max-n")
    _check_stop(request.stop, limits)
    for field in ("stop_token_ids", "allowed_token_ids", "logit_bias", "bad_words"):
        values = getattr(request, field)
        if values is not None and len(values) > limits.max_token_id_list:
            raise over_limit(
                field,
                f"the number of {field}",
                len(values),
                limits.max_token_id_list,
                "max-token-id-list",
            )
    if hasattr(request, "messages"):
        _check_chat(request, limits, max_model_len)
    else:
        _check_prompts(request.prompt, limits, max_model_len)


def _check_stop(stop: str | list[str] | None, limits: LimitsConfig) -> None:
    if stop is None:
        return
    stops = [stop] if isinstance(stop, str) else stop
    if len(stops) > limits.max_stop_strings:
        raise over_limit(
            "stop",
            "the number of stop strings",
            len(stops),
            limits.max_stop_strings,
            "max-stop-strings",
        )
    longest = max((len(s) for s in stops), default=0)
    if longest > limits.max_stop_string_chars:
        raise over_limit(
            "stop",
            "a stop string's length",
            longest,
            limits.max_stop_string_chars,
            "max-stop-string-chars",
        )


def _check_prompts(prompt: Any, limits: LimitsConfig, max_model_len: int) -> None:
    if isinstance(prompt, str):
        check_prompt_chars(len(prompt), limits, max_model_len, "prompt")
        return
    is_batch = any(isinstance(item, (str, list)) for item in prompt)
    if is_batch and len(prompt) > limits.max_prompts:
        raise over_limit(
            "prompt", "the number of prompts", len(prompt), limits.max_prompts, "max-prompts"
        )
    for item in prompt if is_batch else (prompt,):
        if isinstance(item, str):
            check_prompt_chars(len(item), limits, max_model_len, "prompt")
        elif isinstance(item, list) and len(item) >= max_model_len:
            # Token ids: longer than the context is refused later too, but this bounds the
            # cost of the vocabulary check.
            raise APIError(
                400,
                f"a prompt has {len(item)} token ids; the model's maximum context length is "
                f"{max_model_len} tokens",
                param="prompt",
            )


def _check_chat(request: Any, limits: LimitsConfig, max_model_len: int) -> None:
    messages = request.messages
    if len(messages) > limits.max_messages:
        raise over_limit(
            "messages",
            "the number of messages",
            len(messages),
            limits.max_messages,
            "max-messages",
        )
    if request.tools is not None and len(request.tools) > limits.max_tools:
        raise over_limit(
            "tools", "the number of tools", len(request.tools), limits.max_tools, "max-tools"
        )
    num_chars = 0
    for message in messages:
        content = message.content
        if isinstance(content, str):
            num_chars += len(content)
        elif content is not None:
            num_chars += sum(len(part.text or "") for part in content)
    check_prompt_chars(num_chars, limits, max_model_len, "messages")
