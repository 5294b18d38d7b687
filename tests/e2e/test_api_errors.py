"""Every error the API reports: status, OpenAI's error body, and a server that stays healthy.

Real HTTP against the shared server (a real engine); the API-key and dead-engine cases get
servers of their own over the same kind of app.
"""

from __future__ import annotations

import httpx
import openai
import pytest

from kvserve.services.api.engine_client.client import EngineClient
from kvserve.services.api.server import build_app
from kvserve.services.api.serving.tokenizer import TokenizerInfo
from tests.support.api_server import (
    MAX_MODEL_LEN,
    SERVED_MODEL_NAME,
    ServerThread,
    shared_api_server,
)

PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def url() -> str:
    return shared_api_server()[1].url


def assert_error(
    response: httpx.Response, status: int, param: str | None = None, message_part: str = ""
) -> dict:
    """The response is OpenAI's error body with this status (and param, when given)."""
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == "application/json"
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == status and error["message"] and error["type"]
    if param is not None:
        assert error["param"] == param, error
    assert message_part in error["message"]
    return error


def post(url: str, path: str, body) -> httpx.Response:
    if isinstance(body, (bytes, str)):
        return httpx.post(url + path, content=body, headers={"content-type": "application/json"})
    return httpx.post(url + path, json=body, timeout=60)


def completion(**fields) -> dict:
    return {"model": SERVED_MODEL_NAME, "prompt": PROMPT, "max_tokens": 4} | fields


def chat(**fields) -> dict:
    return {
        "model": SERVED_MODEL_NAME,
        "max_tokens": 4,
        "messages": [{"role": "user", "content": "Hi"}],
    } | fields


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("body", [b"{not json", b"", b"[1, 2]"])
def test_malformed_json_is_400(url, path, body):
    assert_error(post(url, path, body), 400)


@pytest.mark.parametrize(
    "body, param",
    [
        (completion(max_tokens="ten"), "max_tokens"),
        (completion(temperature="hot"), "temperature"),
        (completion(prompt=3.5), "prompt"),
        (completion(stop=7), "stop"),
        (completion(echo="yes"), "echo"),
        ({"model": SERVED_MODEL_NAME}, None),  # no prompt at all
    ],
)
def test_wrong_types_are_400_naming_the_field(url, body, param):
    error = assert_error(post(url, "/v1/completions", body), 400, param)
    if param is None:
        assert "prompt" in error["message"]


def test_chat_wrong_types_are_400(url):
    assert_error(post(url, "/v1/chat/completions", chat(messages="hi")), 400, "messages")
    assert_error(post(url, "/v1/chat/completions", chat(logprobs=3)), 400, "logprobs")


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": -3}, "max_tokens"),
        ({"temperature": -1.0}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_k": -5}, "top_k"),
        ({"min_p": 1.5}, "min_p"),
        ({"presence_penalty": 3.0}, "presence_penalty"),
        ({"frequency_penalty": -2.5}, "frequency_penalty"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"n": 0}, "n"),
        ({"logprobs": 21}, "logprobs"),
        ({"min_tokens": 9}, "min_tokens"),  # more than max_tokens=4
        ({"stop": ["ok", ""]}, "stop"),
    ],
)
def test_bad_sampling_params_are_400(url, fields, param):
    assert_error(post(url, "/v1/completions", completion(**fields)), 400, param)


def test_chat_limits_are_400(url):
    assert_error(
        post(url, "/v1/chat/completions", chat(max_completion_tokens=0)), 400, "max_tokens"
    )
    assert_error(post(url, "/v1/chat/completions", chat(top_logprobs=2)), 400, "top_logprobs")
    assert_error(
        post(url, "/v1/chat/completions", chat(logprobs=True, top_logprobs=30)), 400, "logprobs"
    )
    assert_error(post(url, "/v1/chat/completions", chat(messages=[])), 400, "messages")
    image = [{"role": "user", "content": [{"type": "image_url"}]}]
    assert_error(post(url, "/v1/chat/completions", chat(messages=image)), 400, "messages")


@pytest.mark.parametrize("prompt", ["", [], [1, "a"], [[]], [-1, 5], [10**7]])
def test_bad_prompts_are_400(url, prompt):
    assert_error(post(url, "/v1/completions", completion(prompt=prompt)), 400, "prompt")


def test_prompt_longer_than_max_model_len_is_400(url):
    long_prompt = "hello " * (MAX_MODEL_LEN + 10)
    assert_error(
        post(url, "/v1/completions", completion(prompt=long_prompt)),
        400,
        "prompt",
        f"maximum context length is {MAX_MODEL_LEN} tokens",
    )
    long_chat = [{"role": "user", "content": long_prompt}]
    assert_error(post(url, "/v1/chat/completions", chat(messages=long_chat)), 400, "messages")
    # Fits alone, but not with the completion asked for.
    assert_error(
        post(url, "/v1/completions", completion(max_tokens=MAX_MODEL_LEN)),
        400,
        "max_tokens",
        "you requested",
    )


def test_unknown_model_is_404_like_vllm(url):
    for path, body in (
        ("/v1/completions", completion(model="gpt-9")),
        ("/v1/chat/completions", chat(model="gpt-9")),
    ):
        error = assert_error(post(url, path, body), 404, "model")
        assert error["message"] == "The model `gpt-9` does not exist."
        assert error["type"] == "NotFoundError"


def test_unknown_route_and_wrong_method_answer_the_json_error_body(url):
    # Not Starlette's plain-text "Not Found": clients parse any error's body.
    error = assert_error(httpx.get(url + "/v1/no-such-route"), 404, None, "no such route")
    assert error["type"] == "NotFoundError"
    assert "/v1/no-such-route" in error["message"]
    response = httpx.get(url + "/v1/chat/completions")
    error = assert_error(response, 405, None, "method not allowed")
    assert error["type"] == "MethodNotAllowedError"
    assert "POST" in response.headers["allow"]
    assert httpx.get(url + "/health").status_code == 200


def test_openai_client_raises_typed_errors(url):
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-9", prompt=PROMPT)
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=SERVED_MODEL_NAME, prompt=PROMPT, max_tokens=0)
    assert info.value.body["param"] == "max_tokens"
    with pytest.raises(openai.BadRequestError):
        client.completions.create(
            model=SERVED_MODEL_NAME, prompt=PROMPT, max_tokens=2, stream=True, temperature=-2
        )


HUGE = 10**400  # far past 64 bits: Python's json writes it, msgpack could not carry it


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"seed": HUGE}, "seed"),
        ({"seed": 2**64}, "seed"),
        ({"max_tokens": 10**30}, "max_tokens"),
        ({"n": HUGE}, "n"),
        ({"top_k": -(2**70)}, "top_k"),
        ({"priority": 2**63}, "priority"),
        ({"logprobs": 10**30}, "logprobs"),
        ({"prompt_logprobs": 10**20}, "prompt_logprobs"),
        ({"min_tokens": 2**64}, "min_tokens"),
        ({"stop_token_ids": [HUGE]}, "stop_token_ids"),
        ({"stop_token_ids": [10**9]}, "stop_token_ids"),
        ({"allowed_token_ids": [2**63]}, "allowed_token_ids"),
        ({"allowed_token_ids": [10**9]}, "allowed_token_ids"),
        ({"logit_bias": {str(HUGE): 1.0}}, "logit_bias"),
        ({"logit_bias": {"9" * 5000: 1.0}}, "logit_bias"),
        ({"prompt": [HUGE]}, "prompt"),
        ({"prompt": [[1, 2**63]]}, "prompt"),
        ({"prompt": [1, 10**9]}, "prompt"),
        ({"best_of": HUGE}, "best_of"),
    ],
)
def test_huge_integers_are_400_naming_the_field(url, fields, param):
    assert_error(post(url, "/v1/completions", completion(**fields)), 400, param)


@pytest.mark.parametrize(
    "raw, param",
    [
        (b'"temperature": 1e309', "temperature"),
        (b'"temperature": -1e309', "temperature"),
        (b'"top_p": 1e400', "top_p"),
        (b'"temperature": NaN', None),
        (b'"temperature": Infinity', None),
        (b'"temperature": -Infinity', None),
        (b'"logit_bias": {"5": NaN}', None),
        (b'"logit_bias": {"5": 1e999}', "logit_bias"),
        (b'"repetition_penalty": 1e309', "repetition_penalty"),
    ],
)
def test_non_finite_floats_are_400(url, raw, param):
    """JSON has no NaN or infinity: neither literally nor as an overflowing number."""
    body = b'{"prompt": "hi", "max_tokens": 2, ' + raw + b"}"
    assert_error(post(url, "/v1/completions", body), 400, param)


def test_chat_huge_numbers_are_400(url):
    for fields, param in [
        ({"seed": HUGE}, "seed"),
        ({"max_completion_tokens": 10**30}, "max_completion_tokens"),
        ({"logprobs": True, "top_logprobs": 10**30}, "top_logprobs"),
        ({"n": 10**12}, "n"),
    ]:
        response = post(url, "/v1/chat/completions", chat(**fields))
        error = assert_error(response, 400)
        assert error["param"] in (param, "logprobs"), error


@pytest.mark.parametrize(
    "text",
    [b"\xff\xfe", b"caf\xe9", b"\xc3\x28", b"\xed\xa0\x80"],  # the last: a UTF-8 surrogate
)
def test_invalid_utf8_is_400(url, text):
    body = b'{"prompt": "' + text + b'", "max_tokens": 2}'
    assert_error(post(url, "/v1/completions", body), 400)


@pytest.mark.parametrize("escaped", [r"\ud800", r"\udfff abc", r"a\ud83d"])
def test_lone_surrogate_escapes_are_400(url, escaped):
    """JSON may escape half a surrogate pair: no text the tokenizer could encode."""
    text = '"' + escaped + '"'  # a JSON string holding the escape itself
    body = '{"prompt": ' + text + ', "max_tokens": 2}'
    assert_error(post(url, "/v1/completions", body), 400)
    body = '{"max_tokens": 2, "messages": [{"role": "user", "content": ' + text + "}]}"
    assert_error(post(url, "/v1/chat/completions", body), 400)
    assert_error(post(url, "/tokenize", '{"prompt": ' + text + "}"), 400)


@pytest.mark.parametrize("depth", [65, 1000, 100_000])
def test_deeply_nested_json_is_400(url, depth):
    nested = b"[" * depth + b"]" * depth
    body = b'{"prompt": "hi", "max_tokens": 2, "chat_template_kwargs": ' + nested + b"}"
    assert_error(post(url, "/v1/completions", body), 400, message_part="nesting depth")
    schema = b'{"type": "object", "properties": {"a": ' * depth + b"{}" + b"}}" * depth
    body = b'{"prompt": "hi", "max_tokens": 2, "response_format": {"type": "json_schema", '
    body += b'"json_schema": {"name": "x", "schema": ' + schema + b"}}}"
    assert_error(post(url, "/v1/completions", body), 400)


def test_nesting_inside_strings_is_not_depth(url):
    prompt = "[" * 500 + "{" * 500
    response = post(url, "/v1/completions", completion(prompt=prompt, max_tokens=1))
    assert response.status_code == 200, response.text


def test_api_key_guards_v1_only():
    client, _ = shared_api_server()
    server = ServerThread(
        build_app(client, served_model_name=SERVED_MODEL_NAME, api_key="sekret")
    ).start()
    try:
        assert_error(httpx.get(server.url + "/v1/models"), 401)
        wrong = {"Authorization": "Bearer nope"}
        assert_error(httpx.get(server.url + "/v1/models", headers=wrong), 401)
        assert_error(
            httpx.post(server.url + "/v1/completions", json=completion(), headers=wrong), 401
        )
        right = {"Authorization": "Bearer sekret"}
        assert httpx.get(server.url + "/v1/models", headers=right).status_code == 200
        assert httpx.get(server.url + "/health").status_code == 200
        assert httpx.get(server.url + "/metrics").status_code == 200
        bad_client = openai.OpenAI(base_url=server.url + "/v1", api_key="nope", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            bad_client.models.list()
        good_client = openai.OpenAI(base_url=server.url + "/v1", api_key="sekret")
        assert good_client.models.list().data[0].id == SERVED_MODEL_NAME
    finally:
        server.stop()


def test_dead_engine_is_503():
    client, _ = shared_api_server()
    # A real EngineClient in the state a dead engine leaves it in.
    dead = EngineClient(TokenizerInfo(client.tokenizer_info.model_dir), MAX_MODEL_LEN, "dead")
    dead._fail_all("engine core process exited with code -9")
    server = ServerThread(build_app(dead, served_model_name=SERVED_MODEL_NAME)).start()
    try:
        assert httpx.get(server.url + "/health").status_code == 503
        for path, body in (
            ("/v1/completions", completion()),
            ("/v1/completions", completion(stream=True)),
            ("/v1/chat/completions", chat()),
            ("/v1/chat/completions", chat(stream=True)),
        ):
            error = assert_error(post(server.url, path, body), 503)
            assert "exited with code -9" in error["message"]
    finally:
        server.stop()


def test_server_stays_healthy_after_bad_requests(url):
    """Runs last: every bad request above left the shared server serving."""
    assert httpx.get(url + "/health").status_code == 200
    response = post(url, "/v1/completions", completion(temperature=0, ignore_eos=True))
    assert response.status_code == 200
    assert response.json()["usage"]["completion_tokens"] == 4
    assert response.json()["choices"][0]["finish_reason"] == "length"
