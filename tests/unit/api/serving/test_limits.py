"""Request bounds: JSON depth (serving/protocol.py), the body-size middleware under a real starlette
app, and each --max-* limit on decoded requests (services/api/serving/validation.py)."""

from __future__ import annotations

import json

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from kvserve.services.api.serving.errors import APIError
from kvserve.services.api.serving.limits import BodySizeLimitMiddleware
from kvserve.services.api.serving.protocol import ChatCompletionRequest, decode_request, json_depth
from kvserve.services.api.serving.validation import check_request, max_prompt_chars
from kvserve.services.api.surfaces.openai_protocol import CompletionRequest
from kvserve.shared.api_config import LimitsConfig

LIMITS = LimitsConfig()
MAX_MODEL_LEN = 512


@pytest.mark.parametrize(
    "text, depth",
    [
        ("1", 0),
        ('"[[[{{{"', 0),
        ("[]", 1),
        ('{"a": [1, {"b": []}]}', 4),
        ('{"a": "]]]]", "b": [[["\\"[["]]]}', 4),
        ('[[], [], [[]], {"x": {}}]', 3),
        ("[" * 500 + "]" * 500, 500),
    ],
)
def test_json_depth_counts_nesting_outside_strings(text, depth):
    assert json_depth(text.encode()) == depth


def test_json_depth_of_large_bodies():
    assert json_depth(b"[" * (8 << 20) + b"]" * (8 << 20)) == 8 << 20
    assert json_depth(json.dumps({"prompt": "[{" * (4 << 20)}).encode()) == 1


def test_decode_refuses_deep_nesting_before_decoding():
    body = b'{"prompt": "x", "chat_template_kwargs": {"a": ' + b"[" * 65 + b"]" * 65 + b"}}"
    with pytest.raises(APIError, match="--max-json-depth") as info:
        decode_request(body, CompletionRequest, max_depth=64)
    assert info.value.status_code == 400
    # Depth 64 in all (the body's object, the kwargs, 62 lists) is allowed.
    body = b'{"prompt": "x", "chat_template_kwargs": {"a": ' + b"[" * 62 + b"]" * 62 + b"}}"
    assert decode_request(body, CompletionRequest, max_depth=64).prompt == "x"


def test_decode_without_a_depth_bound_still_refuses_deep_nesting_as_400():
    body = b'{"prompt": "x", "chat_template_kwargs": {"a": ' + b"[" * 100_000 + b"]" * 100_000
    with pytest.raises(APIError) as info:
        decode_request(body + b"}}", CompletionRequest)
    assert info.value.status_code == 400


@pytest.mark.parametrize(
    "body, param",
    [
        ({"prompt": "x", "seed": 10**400}, "seed"),
        ({"prompt": "x", "seed": -(2**63) - 1}, "seed"),
        ({"prompt": "x", "max_tokens": 10**30}, "max_tokens"),
        ({"prompt": [1, 2**64]}, "prompt"),
        ({"prompt": "x", "stop_token_ids": [2**63]}, "stop_token_ids"),
    ],
)
def test_integers_past_64_bits_are_400_naming_the_field(body, param):
    with pytest.raises(APIError) as info:
        decode_request(json.dumps(body).encode(), CompletionRequest)
    assert info.value.status_code == 400 and info.value.param == param


def test_64_bit_integers_decode():
    request = decode_request(b'{"prompt": "x", "seed": 9223372036854775807}', CompletionRequest)
    assert request.seed == 2**63 - 1


def completion(**fields) -> CompletionRequest:
    return CompletionRequest(**({"prompt": "hi"} | fields))


def chat(**fields) -> ChatCompletionRequest:
    body = {"messages": [{"role": "user", "content": "hi"}]} | fields
    return decode_request(json.dumps(body).encode(), ChatCompletionRequest)


def refused(request, limits: LimitsConfig = LIMITS) -> APIError:
    with pytest.raises(APIError) as info:
        check_request(request, limits, MAX_MODEL_LEN)
    assert info.value.status_code == 400
    return info.value


@pytest.mark.parametrize(
    "request_, param, flag",
    [
        (completion(n=129), "n", "--max-n"),
        (completion(prompt=["a"] * 1025), "prompt", "--max-prompts"),
        (completion(prompt=[[1]] * 1025), "prompt", "--max-prompts"),
        (completion(prompt="x" * (32 * MAX_MODEL_LEN + 1)), "prompt", "--max-prompt-chars"),
        (completion(prompt=["a", "x" * 20_000]), "prompt", "--max-prompt-chars"),
        (completion(prompt=list(range(MAX_MODEL_LEN))), "prompt", "context length"),
        (completion(stop=["s"] * 65), "stop", "--max-stop-strings"),
        (completion(stop="s" * 513), "stop", "--max-stop-string-chars"),
        (completion(stop_token_ids=[1] * 4097), "stop_token_ids", "--max-token-id-list"),
        (completion(allowed_token_ids=[1] * 4097), "allowed_token_ids", "--max-token-id-list"),
        (completion(bad_words=["w"] * 4097), "bad_words", "--max-token-id-list"),
        (chat(messages=[{"role": "user", "content": "a"}] * 2049), "messages", "--max-messages"),
        (
            chat(tools=[{"function": {"name": f"f{i}"}} for i in range(129)]),
            "tools",
            "--max-tools",
        ),
        (
            chat(
                messages=[{"role": "user", "content": [{"type": "text", "text": "x" * 9000}]}] * 2
            ),
            "messages",
            "--max-prompt-chars",
        ),
    ],
)
def test_each_limit_is_a_400_naming_its_field_and_flag(request_, param, flag):
    error = refused(request_)
    assert error.param == param
    assert flag in error.message


def test_requests_at_the_limits_pass():
    check_request(completion(n=128, stop=["s" * 512] * 64), LIMITS, MAX_MODEL_LEN)
    check_request(completion(prompt=["a"] * 1024), LIMITS, MAX_MODEL_LEN)
    check_request(completion(prompt="x" * 32 * MAX_MODEL_LEN), LIMITS, MAX_MODEL_LEN)
    check_request(chat(n=3), LIMITS, MAX_MODEL_LEN)


def test_limits_follow_the_flags():
    limits = LimitsConfig(max_n=2, max_prompt_chars=10, max_stop_strings=1)
    assert refused(completion(n=3), limits).param == "n"
    assert refused(completion(prompt="x" * 11), limits).param == "prompt"
    assert refused(completion(stop=["a", "b"]), limits).param == "stop"
    assert max_prompt_chars(limits, MAX_MODEL_LEN) == 10
    assert max_prompt_chars(LIMITS, 1000) == 32_000
    with pytest.raises(ValueError, match="--max-n"):
        LimitsConfig(max_n=0)


# --------------------------------------------------------------------------- body size


def echo_app(max_bytes: int) -> Starlette:
    async def echo(request: Request) -> Response:
        return Response(str(len(await request.body())))

    app = Starlette(routes=[Route("/echo", echo, methods=["POST"])])
    return BodySizeLimitMiddleware(app, max_bytes=max_bytes)


async def post(app, **kwargs) -> httpx.Response:
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
        return await client.post("/echo", **kwargs)


@pytest.mark.anyio
async def test_body_within_the_limit_reaches_the_app_whole():
    response = await post(echo_app(1000), content=b"x" * 1000)
    assert response.status_code == 200 and response.text == "1000"


@pytest.mark.anyio
async def test_body_over_its_content_length_limit_is_413():
    response = await post(echo_app(1000), content=b"x" * 1001)
    assert response.status_code == 413
    error = response.json()["error"]
    assert error["code"] == 413 and "--max-request-body-bytes" in error["message"]
    assert response.headers["connection"] == "close"


@pytest.mark.anyio
async def test_streamed_body_is_cut_off_once_over_the_limit():
    num_chunks_sent = 0

    async def chunks():
        nonlocal num_chunks_sent
        for _ in range(100):
            num_chunks_sent += 1
            yield b"x" * 100

    response = await post(echo_app(1000), content=chunks())  # no Content-Length
    assert response.status_code == 413
    assert num_chunks_sent <= 12  # it stopped reading after 11 chunks (1100 bytes)


@pytest.fixture
def anyio_backend():
    return "asyncio"
