"""Overload, request bounds and API keys on a real `kvserve serve` of the tiny model.

The server runs with one sequence per step and two waiting requests at most, and with an API
key file of two named keys; the bodies are the official ones (openai client) where it fits,
raw httpx and sockets for what a client library would not send.
"""

from __future__ import annotations

import json
import select
import socket
import threading
import time

import httpx
import openai
import pytest

from tests.support.metrics import metrics_text, read_metric
from tests.support.models import TINY_KV_CACHE_MEMORY
from tests.support.server import read_log, serving

pytestmark = pytest.mark.slow

KEYS = {"alice": "sk-alice-3f9c", "bob": "sk-bob-77aa"}
MAX_WAITING = 2
MAX_MODEL_LEN = 512  # the tiny model's max_position_embeddings


@pytest.fixture(scope="module")
def server(tiny_llama_dir, tmp_path_factory):
    folder = tmp_path_factory.mktemp("limits")
    key_file = folder / "keys.txt"
    key_file.write_text("# name:key\n" + "".join(f"{n}:{k}\n" for n, k in KEYS.items()))
    log = str(folder / "serve.log")
    args = [
        tiny_llama_dir,
        "--kv-cache-memory",
        str(TINY_KV_CACHE_MEMORY),
        "--api-key-file",
        str(key_file),
        "--max-num-seqs",
        "1",
        "--max-waiting-requests",
        str(MAX_WAITING),
        "--enable-log-requests",
        "--served-model-name",
        "tiny",
    ]
    with serving(args, log) as url:
        yield url, log


def headers(name: str = "alice") -> dict[str, str]:
    return {"Authorization": f"Bearer {KEYS[name]}"}


def post(url: str, body, path: str = "/v1/completions", **kwargs) -> httpx.Response:
    kwargs.setdefault("timeout", 60)
    if isinstance(body, bytes):
        return httpx.post(
            url + path,
            content=body,
            headers=headers() | {"content-type": "application/json"},
            **kwargs,
        )
    return httpx.post(url + path, json=body, headers=headers(), **kwargs)


def assert_error(response: httpx.Response, status: int, param: str | None = None, part: str = ""):
    assert response.status_code == status, response.text[:500]
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == status
    if param is not None:
        assert error["param"] == param, error
    assert part in error["message"], error
    return error


def completion(**fields) -> dict:
    return {"prompt": "hello", "max_tokens": 2} | fields


# ------------------------------------------------------------------ the four cases


def test_huge_n_is_400(server):
    url, _ = server
    assert_error(post(url, completion(n=100_000)), 400, "n", "--max-n")
    client = openai.OpenAI(base_url=url + "/v1", api_key=KEYS["alice"], max_retries=0)
    with pytest.raises(openai.BadRequestError, match="max-n"):
        client.completions.create(model="tiny", prompt="hi", max_tokens=1, n=100_000)


def test_400_digit_seed_is_400(server):
    url, _ = server
    assert_error(post(url, completion(seed=int("9" * 400))), 400, "seed")
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "seed": 10**400}
    assert_error(post(url, chat, "/v1/chat/completions"), 400, "seed")


def _raw_post(url: str, head: str) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=30)
    sock.sendall(
        f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Authorization: Bearer {KEYS['alice']}\r\n{head}\r\n".encode()
    )
    return sock


def _read_response(sock: socket.socket) -> tuple[int, dict]:
    data = b""
    while b"\r\n\r\n" not in data or not data.rstrip().endswith(b"}"):
        chunk = sock.recv(65536)
        if not chunk:
            break
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body)


def test_64_mib_body_is_refused_from_its_content_length(server):
    """Refused from the header alone: the server answers before a byte of the body came."""
    url, _ = server
    sock = _raw_post(url, f"Content-Length: {64 << 20}\r\n")
    try:
        status, body = _read_response(sock)
    finally:
        sock.close()
    assert status == 413
    assert "--max-request-body-bytes" in body["error"]["message"]


def test_64_mib_chunked_body_is_refused_while_it_streams(server):
    """No Content-Length: the bytes are counted as they arrive, and the answer comes once
    they pass the limit (16 MiB), not after all 64 MiB."""
    url, _ = server
    sock = _raw_post(url, "Transfer-Encoding: chunked\r\n")
    chunk = b"100000\r\n" + b"a" * (1 << 20) + b"\r\n"  # 1 MiB per chunk
    num_sent = 0
    try:
        sock.sendall(b'c\r\n{"prompt": "\r\n')
        for _ in range(64):
            readable, _, _ = select.select([sock], [], [], 0)
            if readable:
                break
            try:
                sock.sendall(chunk)
            except OSError:  # the server answered and closed its side
                break
            num_sent += 1
        try:
            status, body = _read_response(sock)
        except ConnectionResetError:
            # uvicorn closes with the rest of the upload unread, so the kernel may reset
            # the connection before the 413 is read: refused all the same.
            status, body = 413, {}
    finally:
        sock.close()
    assert status == 413, body
    assert num_sent < 48, f"the server read {num_sent} MiB before it answered"


def test_json_nesting_is_refused_before_decoding(server):
    url, _ = server
    nested = b"[" * 200_000 + b"]" * 200_000
    body = b'{"prompt": "hi", "chat_template_kwargs": {"a": ' + nested + b"}}"
    assert_error(post(url, body), 400, None, "--max-json-depth")


def test_prompt_too_long_for_any_context_is_refused_before_tokenizing(server):
    """The bound is 32 characters per token of max_model_len: an 8 MiB prompt is refused by
    its length (the tokenized path would answer with its token count instead)."""
    url, _ = server
    body = json.dumps(completion(prompt="ab" * (4 << 20))).encode()
    error = assert_error(post(url, body), 400, "prompt", "--max-prompt-chars")
    assert "tokens. However" not in error["message"]
    assert_error(post(url, completion(prompt=["hi", "x" * 20_000])), 400, "prompt")
    messages = [{"role": "user", "content": "x" * 10_000}] * 2
    assert_error(
        post(url, {"messages": messages, "max_tokens": 2}, "/v1/chat/completions"),
        400,
        "messages",
        "--max-prompt-chars",
    )
    assert_error(post(url, {"prompt": "x" * 20_000}, "/tokenize"), 400, "prompt")


def test_100k_stop_strings_are_400(server):
    url, _ = server
    stops = [f"{i:050d}" for i in range(100_000)]
    assert_error(post(url, completion(stop=stops)), 400, "stop", "--max-stop-strings")
    assert_error(post(url, completion(stop=["x" * 600])), 400, "stop", "--max-stop-string-chars")


@pytest.mark.parametrize(
    "body, path, param, flag",
    [
        (completion(prompt=["hi"] * 1025), "/v1/completions", "prompt", "--max-prompts"),
        (completion(prompt=[[1, 2]] * 1025), "/v1/completions", "prompt", "--max-prompts"),
        (completion(prompt=[1] * 600), "/v1/completions", "prompt", "context length"),
        (completion(stop_token_ids=[1] * 5000), "/v1/completions", "stop_token_ids", "--max-"),
        (
            completion(logit_bias={str(i): 1 for i in range(5000)}),
            "/v1/completions",
            "logit_bias",
            "--max-token-id-list",
        ),
        (
            {"messages": [{"role": "user", "content": "a"}] * 2049},
            "/v1/chat/completions",
            "messages",
            "--max-messages",
        ),
        (
            {
                "messages": [{"role": "user", "content": "a"}],
                "tools": [{"type": "function", "function": {"name": f"f{i}"}} for i in range(129)],
            },
            "/v1/chat/completions",
            "tools",
            "--max-tools",
        ),
        (completion(logprobs=10**6), "/v1/completions", "logprobs", "max allowed"),
    ],
)
def test_list_limits_are_400_naming_the_limit(server, body, path, param, flag):
    url, _ = server
    assert_error(post(url, body, path), 400, param, flag)


# ------------------------------------------------------------------ overload


def _long_stream(url: str, client: httpx.Client) -> httpx.Response:
    """Open a stream that runs for a while (one sequence per step: the others wait)."""
    request = client.build_request(
        "POST",
        url + "/v1/completions",
        json=completion(max_tokens=500, ignore_eos=True, stream=True),
        headers=headers(),
    )
    response = client.send(request, stream=True)
    assert response.status_code == 200
    return response


def test_full_queue_is_429_with_retry_after_and_then_serves(server):
    url, _ = server
    # One client per stream, each kept open: a closed connection aborts its request.
    clients = [httpx.Client(timeout=120) for _ in range(1 + MAX_WAITING)]
    running = _long_stream(url, clients[0])
    lines = running.iter_lines()  # kept: a dropped iterator closes the stream
    next(lines)  # it runs in the engine now
    queued = [_long_stream(url, client) for client in clients[1:]]
    try:
        response = post(url, completion())
        error = assert_error(response, 429, None, "--max-waiting-requests")
        assert error["type"] == "RateLimitError"
        assert int(response.headers["retry-after"]) >= 1
        client = openai.OpenAI(base_url=url + "/v1", api_key=KEYS["bob"], max_retries=0)
        with pytest.raises(openai.RateLimitError):
            client.completions.create(model="tiny", prompt="hi", max_tokens=1)
        # A request of n > 1 counts n.
        assert post(url, completion(n=3)).status_code == 429
    finally:
        for response, client in zip((running, *queued), clients):
            response.close()
            client.close()
    # The aborted streams free the queue: the server serves again.
    deadline = time.monotonic() + 60
    while (response := post(url, completion())).status_code == 429:
        assert time.monotonic() < deadline, "the queue never drained"
        time.sleep(0.2)
    assert response.status_code == 200, response.text


def test_a_client_that_never_reads_holds_only_its_own_request(server):
    """A stream whose client stops reading: its outputs pile up in its own queue and socket
    buffer, and the other requests are served as fast as ever."""
    url, _ = server
    host, port = url.removeprefix("http://").split(":")
    # Logprobs make each event ~2 KB: the 400 of them overflow the socket buffers.
    fields = completion(max_tokens=400, ignore_eos=True, stream=True, logprobs=20)
    body = json.dumps(fields).encode()
    stalled = socket.create_connection((host, int(port)))
    stalled.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    stalled.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        + f"Authorization: Bearer {KEYS['bob']}\r\nContent-Length: {len(body)}\r\n\r\n".encode()
        + body
    )
    try:
        time.sleep(1.0)  # it streams into a socket nobody reads
        done = threading.Event()
        result: list[httpx.Response] = []

        def other() -> None:
            result.append(post(url, completion(max_tokens=3, ignore_eos=True), timeout=60))
            done.set()

        threading.Thread(target=other, daemon=True).start()
        # One sequence per step: the other request waits for the stalled one's 400 tokens,
        # which the tiny model computes in well under a minute; it must not wait on the
        # stalled client's socket.
        assert done.wait(90), "a client that never reads blocked another request"
        assert result[0].status_code == 200, result[0].text
        assert httpx.get(url + "/health", timeout=5).status_code == 200
    finally:
        stalled.close()


# ------------------------------------------------------------------ API keys


def test_each_key_is_accepted_and_counted_by_name(server):
    url, log = server
    before = {
        name: read_metric(metrics_text(url), "kvserve:api_key_requests_total", 0.0, key_name=name)
        for name in KEYS
    }
    for name in KEYS:
        client = openai.OpenAI(base_url=url + "/v1", api_key=KEYS[name], max_retries=0)
        assert client.completions.create(model="tiny", prompt="hi", max_tokens=1).choices
    client = openai.OpenAI(base_url=url + "/v1", api_key=KEYS["alice"], max_retries=0)
    client.models.list()
    text = metrics_text(url)
    after = {
        name: read_metric(text, "kvserve:api_key_requests_total", 0.0, key_name=name)
        for name in KEYS
    }
    assert after["alice"] == before["alice"] + 2
    assert after["bob"] == before["bob"] + 1
    lines = read_log(log)
    assert "(API key 'bob')" in lines and "(API key 'alice')" in lines
    for key in KEYS.values():
        assert key not in lines and key not in text  # never logged, never a label


@pytest.mark.parametrize(
    "authorization",
    [None, "Bearer sk-nope", f"Bearer {KEYS['alice']}x", KEYS["alice"], "Basic xyz", "Bearer"],
)
def test_unknown_or_missing_key_is_401(server, authorization):
    url, _ = server
    given = {} if authorization is None else {"Authorization": authorization}
    response = httpx.post(url + "/v1/completions", json=completion(), headers=given)
    error = assert_error(response, 401)
    assert error["type"] == "AuthenticationError"
    assert httpx.get(url + "/health").status_code == 200  # open routes stay open


def test_openai_client_with_a_wrong_key_raises(server):
    url, _ = server
    client = openai.OpenAI(base_url=url + "/v1", api_key="sk-wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        client.models.list()


# ------------------------------------------------------------------ /openapi.json


def test_openapi_describes_the_routes_from_the_request_types(server):
    url, _ = server
    document = httpx.get(url + "/openapi.json").json()
    assert document["openapi"].startswith("3.1")
    assert {"/v1/completions", "/v1/chat/completions", "/tokenize"} <= set(document["paths"])
    schemas = document["components"]["schemas"]
    seed = schemas["CompletionRequest"]["properties"]["seed"]["anyOf"][0]
    assert seed == {"type": "integer", "minimum": -(2**63), "maximum": 2**63 - 1}
    assert "messages" in schemas["ChatCompletionRequest"]["required"]


def test_server_stays_healthy_after_everything(server):
    url, _ = server
    assert httpx.get(url + "/health").status_code == 200
    response = post(url, completion(max_tokens=4, ignore_eos=True))
    assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 4
