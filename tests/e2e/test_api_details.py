"""API details vLLM's clients rely on, through the official `openai` client against
`kvserve serve` (real api and engine processes) of the tiny model.

Two servers: ON has --enable-prompt-tokens-details, --enable-request-id-headers,
--max-logprobs 5 and request logs; OFF has the defaults plus --return-tokens-as-token-ids.
The tiny model's tokenizer is byte-level without merges: one token per ASCII character.
"""

from __future__ import annotations

import asyncio
import importlib.metadata
import uuid

import httpx
import openai
import pytest

from tests.support.models import TINY_KV_CACHE_MEMORY
from tests.support.server import read_log, serving
from tests.support.waiting import wait_until

pytestmark = pytest.mark.slow

MODEL = "tiny"
BLOCK_SIZE = 16
MAX_LOGPROBS = 5
MAX_LOG_LEN = 10
# The tiny model has no chat template of its own: the conversation is its contents.
CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
GREEDY = dict(model=MODEL, temperature=0, extra_body={"ignore_eos": True})


def common_args(model_dir: str) -> list[str]:
    return [
        model_dir,
        "--served-model-name",
        MODEL,
        "--kv-cache-memory",
        str(TINY_KV_CACHE_MEMORY),
        "--block-size",
        str(BLOCK_SIZE),
        "--chat-template",
        CHAT_TEMPLATE,
        "--uvicorn-log-level",
        "warning",
    ]


@pytest.fixture(scope="module")
def on_server(tiny_llama_dir, tmp_path_factory):
    """(base URL, log path) of the server with the API details on."""
    log_path = str(tmp_path_factory.mktemp("serve-on") / "serve.log")
    args = common_args(tiny_llama_dir) + [
        "--enable-prompt-tokens-details",
        "--enable-request-id-headers",
        "--max-logprobs",
        str(MAX_LOGPROBS),
        "--enable-log-requests",
        "--max-log-len",
        str(MAX_LOG_LEN),
    ]
    with serving(args, log_path) as url:
        yield url, log_path


@pytest.fixture(scope="module")
def off_url(tiny_llama_dir, tmp_path_factory):
    log_path = str(tmp_path_factory.mktemp("serve-off") / "serve.log")
    with serving(common_args(tiny_llama_dir) + ["--return-tokens-as-token-ids"], log_path) as url:
        yield url


@pytest.fixture(scope="module")
def on_url(on_server) -> str:
    return on_server[0]


def client_of(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)


def unique_prompt(num_chars: int) -> str:
    """An ASCII prompt of num_chars tokens that no other test shares (no prefix hits)."""
    head = uuid.uuid4().hex
    return (head + " the quick brown fox jumps over the lazy dog" * 20)[:num_chars]


def detokenize(url: str, token_ids: list[int]) -> str:
    return httpx.post(url + "/detokenize", json={"tokens": token_ids}).json()["prompt"]


def expected_hit(prompt_len: int) -> int:
    # The scheduler's rule: the last prompt token is always recomputed, and only full
    # blocks are cached.
    return (prompt_len - 1) // BLOCK_SIZE * BLOCK_SIZE


def cached_tokens(usage) -> int | None:
    return (
        None if usage.prompt_tokens_details is None else usage.prompt_tokens_details.cached_tokens
    )


# --------------------------------------------------------------------------- cached tokens


@pytest.mark.parametrize("prompt_len", [47, 64])
def test_cached_tokens_equal_the_prefix_hits(on_url, prompt_len):
    client = client_of(on_url)
    prompt = unique_prompt(prompt_len)
    first = client.completions.create(prompt=prompt, max_tokens=2, **GREEDY)
    second = client.completions.create(prompt=prompt, max_tokens=2, **GREEDY)
    assert first.usage.prompt_tokens == second.usage.prompt_tokens == prompt_len
    assert cached_tokens(first.usage) == 0
    assert cached_tokens(second.usage) == expected_hit(prompt_len)  # 32 for 47, 48 for 64
    assert second.choices[0].text == first.choices[0].text


def test_cached_tokens_in_the_streamed_chat_usage_chunk(on_url):
    client = client_of(on_url)
    messages = [{"role": "user", "content": unique_prompt(50)}]
    usages = []
    for _ in range(2):
        stream = client.chat.completions.create(
            messages=messages,
            max_tokens=3,
            stream=True,
            stream_options={"include_usage": True},
            **GREEDY,
        )
        chunks = list(stream)
        assert all(chunk.usage is None for chunk in chunks[:-1])
        usages.append(chunks[-1].usage)
    assert [u.prompt_tokens for u in usages] == [50, 50]
    assert [cached_tokens(u) for u in usages] == [0, expected_hit(50)]


def test_no_prompt_tokens_details_without_the_flag(off_url):
    client = client_of(off_url)
    prompt = unique_prompt(40)
    responses = [client.completions.create(prompt=prompt, max_tokens=1, **GREEDY) for _ in range(2)]
    assert [r.usage.prompt_tokens_details for r in responses] == [None, None]
    raw = httpx.post(
        off_url + "/v1/completions",
        timeout=60,
        json={"model": MODEL, "prompt": prompt, "max_tokens": 1},
    )
    assert "prompt_tokens_details" not in raw.json()["usage"]


def test_reset_prefix_cache_forgets_the_prompt(on_url):
    client = client_of(on_url)
    prompt = unique_prompt(40)
    hits = [
        cached_tokens(client.completions.create(prompt=prompt, max_tokens=1, **GREEDY).usage)
        for _ in range(2)
    ]
    assert hits == [0, expected_hit(40)]
    response = httpx.post(on_url + "/reset_prefix_cache", timeout=60)
    assert response.status_code == 200
    again = client.completions.create(prompt=prompt, max_tokens=1, **GREEDY)
    assert cached_tokens(again.usage) == 0


def test_reset_prefix_cache_while_a_request_runs_is_409(on_url):
    body = {
        "model": MODEL,
        "prompt": unique_prompt(8),
        "max_tokens": 480,
        "stream": True,
        "ignore_eos": True,
    }
    with httpx.stream("POST", on_url + "/v1/completions", json=body, timeout=120) as stream:
        lines = stream.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))  # it runs
        response = httpx.post(on_url + "/reset_prefix_cache", timeout=60)
        assert response.status_code == 409, response.text
        assert "hold KV blocks" in response.json()["error"]["message"]
        assert [line for line in lines if line][-1] == "data: [DONE]"
    assert httpx.post(on_url + "/reset_prefix_cache", timeout=60).status_code == 200


# --------------------------------------------------------------------------- request ids


def test_x_request_id_is_the_request_id_and_echoed(on_url):
    client = client_of(on_url)
    request_id = f"trace-{uuid.uuid4().hex[:8]}"
    raw = client.completions.with_raw_response.create(
        prompt="Hello", max_tokens=2, extra_headers={"X-Request-Id": request_id}, **GREEDY
    )
    assert raw.headers["x-request-id"] == request_id
    assert raw.parse().id == f"cmpl-{request_id}"

    raw = client.chat.completions.with_raw_response.create(
        messages=[{"role": "user", "content": "Hello"}],
        max_tokens=3,
        stream=True,
        extra_headers={"X-Request-Id": request_id},
        **GREEDY,
    )
    assert raw.headers["x-request-id"] == request_id
    chunks = list(raw.parse())
    assert len(chunks) >= 2 and {chunk.id for chunk in chunks} == {f"chatcmpl-{request_id}"}

    # Without a header, the echoed id is the one the response got.
    raw = client.completions.with_raw_response.create(prompt="Hi", max_tokens=1, **GREEDY)
    assert raw.parse().id == "cmpl-" + raw.headers["x-request-id"]
    # Every route carries one, errors too (as vLLM's middleware).
    assert (
        httpx.get(on_url + "/health", headers={"X-Request-Id": "h-1"}).headers["x-request-id"]
        == "h-1"
    )
    bad = httpx.post(
        on_url + "/v1/completions",
        json={"prompt": "x", "max_tokens": 0},
        headers={"X-Request-Id": "bad-1"},
    )
    assert bad.status_code == 400 and bad.headers["x-request-id"] == "bad-1"


def test_a_repeated_request_id_serves_both_requests(on_url):
    client = openai.AsyncOpenAI(
        base_url=on_url + "/v1", api_key="unused", max_retries=0, timeout=120
    )
    headers = {"X-Request-Id": "same-id"}

    async def one() -> tuple[str, int]:
        response = await client.completions.create(
            prompt="Repeat", max_tokens=40, extra_headers=headers, **GREEDY
        )
        return response.id, response.usage.completion_tokens

    async def both():
        try:
            return await asyncio.gather(one(), one())
        finally:
            await client.close()

    assert asyncio.run(both()) == [("cmpl-same-id", 40), ("cmpl-same-id", 40)]


def test_without_the_flag_the_id_is_used_but_not_echoed(off_url):
    raw = client_of(off_url).completions.with_raw_response.create(
        prompt="Hello", max_tokens=1, extra_headers={"X-Request-Id": "quiet-1"}, **GREEDY
    )
    assert "x-request-id" not in raw.headers
    assert raw.parse().id == "cmpl-quiet-1"


# --------------------------------------------------------------------------- endpoints


def test_version_and_ping(on_url):
    version = httpx.get(on_url + "/version")
    assert version.status_code == 200
    assert version.json() == {"version": importlib.metadata.version("kvserve")}
    for method in ("GET", "POST"):
        ping = httpx.request(method, on_url + "/ping")
        assert ping.status_code == 200 and ping.json()["status"] == "healthy"


# --------------------------------------------------------------------------- logprobs


def test_return_tokens_as_token_ids_per_request(on_url):
    client = client_of(on_url)
    prompt = "Token ids!"
    prompt_ids = httpx.post(on_url + "/tokenize", json={"prompt": prompt}).json()["tokens"]
    assert len(prompt_ids) == len(prompt)
    named = client.completions.create(
        prompt=prompt,
        max_tokens=3,
        logprobs=2,
        echo=True,
        model=MODEL,
        temperature=0,
        extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True},
    )
    logprobs = named.choices[0].logprobs
    assert logprobs.tokens[: len(prompt)] == [f"token_id:{t}" for t in prompt_ids]
    assert len(logprobs.tokens) == len(prompt) + 3
    assert all(token.startswith("token_id:") for token in logprobs.tokens)
    assert all(key.startswith("token_id:") for row in logprobs.top_logprobs[1:] for key in row)
    plain = client.completions.create(prompt=prompt, max_tokens=3, logprobs=2, echo=True, **GREEDY)
    assert plain.choices[0].logprobs.tokens[: len(prompt)] == list(prompt)


def test_return_tokens_as_token_ids_server_flag(off_url):
    client = client_of(off_url)
    messages = [{"role": "user", "content": "Name a color."}]
    named = client.chat.completions.create(
        messages=messages, max_tokens=4, logprobs=True, top_logprobs=2, **GREEDY
    )
    content = named.choices[0].logprobs.content
    assert len(content) == 4
    for entry in content:
        assert entry.token.startswith("token_id:")
        assert entry.bytes == list(entry.token.encode())
        assert [top.token.startswith("token_id:") for top in entry.top_logprobs] == [True] * 2
    # The names are the sampled ids: together they decode to the reply.
    token_ids = [int(entry.token.removeprefix("token_id:")) for entry in content]
    assert detokenize(off_url, token_ids) == named.choices[0].message.content
    # The request's own field wins over the flag.
    plain = client.chat.completions.create(
        messages=messages,
        max_tokens=4,
        logprobs=True,
        model=MODEL,
        temperature=0,
        extra_body={"ignore_eos": True, "return_tokens_as_token_ids": False},
    )
    # Greedy: the same tokens, now named by their text one by one.
    assert [e.token for e in plain.choices[0].logprobs.content] == [
        detokenize(off_url, [token_id]) for token_id in token_ids
    ]


def check_prompt_logprobs(entries, prompt_ids: list[int], num_top: int) -> None:
    """vLLM's shape: per prompt position {token id: {logprob, rank, decoded_token}}: the
    prompt's own next token and the num_top best, null for the first position."""
    assert len(entries) == len(prompt_ids) and entries[0] is None
    for position, entry in enumerate(entries[1:], start=1):
        actual = entry[str(prompt_ids[position])]
        assert num_top <= len(entry) <= num_top + 1
        assert set(range(1, num_top + 1)) <= {lp["rank"] for lp in entry.values()}
        # The actual token adds an entry only when it is not among the best.
        assert (len(entry) == num_top) == (actual["rank"] <= num_top)
        assert max(entry.values(), key=lambda lp: lp["logprob"])["rank"] == 1
        assert all(
            lp["logprob"] <= 0 and isinstance(lp["decoded_token"], str) for lp in entry.values()
        )


def test_prompt_logprobs_shape(on_url):
    client = client_of(on_url)
    prompt = unique_prompt(12)
    prompt_ids = httpx.post(on_url + "/tokenize", json={"prompt": prompt}).json()["tokens"]
    response = client.completions.create(
        prompt=prompt, max_tokens=1, model=MODEL, extra_body={"prompt_logprobs": 2}
    )
    entries = response.choices[0].model_extra["prompt_logprobs"]
    check_prompt_logprobs(entries, prompt_ids, num_top=2)
    # The actual next character is named by the detokenizer, position by position.
    assert [entries[i][str(t)]["decoded_token"] for i, t in enumerate(prompt_ids) if i > 0] == list(
        prompt[1:]
    )

    chat = client.chat.completions.create(
        messages=[{"role": "user", "content": prompt}],
        max_tokens=1,
        model=MODEL,
        extra_body={"prompt_logprobs": 1},
    )
    check_prompt_logprobs(chat.model_extra["prompt_logprobs"], prompt_ids, num_top=1)
    plain = client.completions.create(prompt=prompt, max_tokens=1, **GREEDY)
    assert plain.choices[0].model_extra["prompt_logprobs"] is None

    with pytest.raises(openai.BadRequestError, match="not available when `stream=True`"):
        client.completions.create(
            prompt=prompt, max_tokens=1, stream=True, model=MODEL, extra_body={"prompt_logprobs": 1}
        )


def assert_over_limit(response: httpx.Response, param: str, limit: int) -> None:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert (error["code"], error["type"], error["param"]) == (400, "BadRequestError", param)
    assert f"greater than max allowed: {limit}" in error["message"]


def test_logprobs_above_max_logprobs_are_400(on_url, off_url):
    completions = {"model": MODEL, "prompt": "Hi", "max_tokens": 1}
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}
    post = lambda url, path, body: httpx.post(url + path, json=body, timeout=60)  # noqa: E731
    over = MAX_LOGPROBS + 1
    assert_over_limit(
        post(on_url, "/v1/completions", completions | {"logprobs": over}), "logprobs", MAX_LOGPROBS
    )
    assert_over_limit(
        post(on_url, "/v1/completions", completions | {"prompt_logprobs": over}),
        "prompt_logprobs",
        MAX_LOGPROBS,
    )
    assert_over_limit(
        post(on_url, "/v1/chat/completions", chat | {"logprobs": True, "top_logprobs": over}),
        "logprobs",
        MAX_LOGPROBS,
    )
    assert (
        post(on_url, "/v1/completions", completions | {"logprobs": MAX_LOGPROBS}).status_code == 200
    )
    # The limit is the configured one: the default server allows 20, not 5.
    assert post(off_url, "/v1/completions", completions | {"logprobs": over}).status_code == 200
    assert_over_limit(
        post(off_url, "/v1/completions", completions | {"logprobs": 21}), "logprobs", 20
    )
    with pytest.raises(openai.BadRequestError, match=f"max allowed: {MAX_LOGPROBS}"):
        client_of(on_url).completions.create(prompt="Hi", max_tokens=1, logprobs=over, model=MODEL)


# --------------------------------------------------------------------------- request logs


def test_each_request_is_logged_truncated(on_server):
    url, log_path = on_server
    prompt = "LOGGED-PROMPT-" + uuid.uuid4().hex
    prompt_ids = httpx.post(url + "/tokenize", json={"prompt": prompt}).json()["tokens"]
    client_of(url).completions.create(
        prompt=prompt, max_tokens=2, extra_headers={"X-Request-Id": "logged-1"}, **GREEDY
    )
    prefix = "Received request cmpl-logged-1-"

    def logged_line() -> str | None:
        return next((line for line in read_log(log_path).splitlines() if prefix in line), None)

    assert wait_until(logged_line, timeout_s=10), read_log(log_path)
    line = logged_line()
    assert f"prompt: {prompt[:MAX_LOG_LEN]!r}, params: SamplingParams(" in line
    assert "max_tokens=2" in line
    assert line.endswith(f"prompt_token_ids: {prompt_ids[:MAX_LOG_LEN]}.")
    assert prompt[: MAX_LOG_LEN + 1] not in line
