"""Per-tenant quotas against a real `kvserve serve` of the tiny model, through the official
openai SDK: max_concurrent, requests_per_minute and tokens_per_minute from an
--api-key-file, each tenant under its own key; and a SIGHUP that reloads the file.

Streams are held open by freezing the engine core (SIGSTOP): the api has answered 200 and
the stream waits for its first token, its quota slot taken, for as long as the test needs
(the heartbeat timeout is raised so the frozen engine stays "serving").
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
from collections.abc import Iterator

import httpx
import openai
import pytest

from tests.support.metrics import metrics_text, read_metric
from tests.support.server import DP_MODEL_NAME, ServeProcess, start_tiny_server
from tests.support.waiting import wait_until

KEY_FILE = """\
conc:sk-conc max_concurrent=2
rpm:sk-rpm requests_per_minute=3
tpm:sk-tpm tokens_per_minute=200
reload:sk-reload max_concurrent=1
"""
PROMPT_IDS = [5] * 10  # a prompt of exactly 10 tokens
CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}"  # the tiny model has none


@pytest.fixture(scope="module")
def server(tiny_llama_dir, tmp_path_factory) -> Iterator[tuple[ServeProcess, str]]:
    """The server and its key file's path."""
    folder = tmp_path_factory.mktemp("quotas")
    key_file = folder / "keys.txt"
    key_file.write_text(KEY_FILE)
    env = {"KVSERVE_ENGINE_HEARTBEAT_TIMEOUT_S": "30"}
    flags = ["--api-key-file", str(key_file), "--chat-template", CHAT_TEMPLATE]
    server = start_tiny_server(tiny_llama_dir, folder, *flags, env=env)
    try:
        server.wait_healthy()
        yield server, str(key_file)
    finally:
        server.stop()


def client(server: ServeProcess, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0, timeout=60)


def complete(server: ServeProcess, key: str, max_tokens: int = 2, **kwargs):
    """A completion of PROMPT_IDS that ignores EOS (it uses max_tokens); kwargs win."""
    body = {"prompt": PROMPT_IDS, "temperature": 0, "extra_body": {"ignore_eos": True}}
    return client(server, key).completions.create(
        model=DP_MODEL_NAME, max_tokens=max_tokens, **(body | kwargs)
    )


def rate_limited(call, *args, **kwargs) -> openai.RateLimitError:
    with pytest.raises(openai.RateLimitError) as info:
        call(*args, **kwargs)
    return info.value


def retry_after(exc: openai.RateLimitError) -> int:
    return int(exc.response.headers["retry-after"])


def message(exc: openai.APIStatusError) -> str:
    return exc.response.json()["error"]["message"]


@contextlib.contextmanager
def engine_frozen(server: ServeProcess) -> Iterator[None]:
    """The engine core stopped (SIGSTOP) for the block: streams stay open, waiting."""
    pid = server.health()[1]["engines"][0]["pid"]
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(pid, signal.SIGCONT)


def read_to_end(stream) -> str | None:
    """A stream's last finish_reason (it was read to the end)."""
    finish_reason = None
    for chunk in stream:
        for choice in chunk.choices:
            finish_reason = choice.finish_reason or finish_reason
    return finish_reason


def test_max_concurrent_refuses_the_request_past_it(server):
    server, _ = server
    with engine_frozen(server):
        # One HTTP request is one slot, whatever its prompts x n.
        first = complete(
            server, "sk-conc", stream=True, n=2, prompt=[PROMPT_IDS, [6] * 4], temperature=1.0
        )
        second = complete(server, "sk-conc", stream=True)
        exc = rate_limited(complete, server, "sk-conc", stream=True)
        assert retry_after(exc) == 1
        assert "'conc'" in message(exc) and "max_concurrent limit 2" in message(exc)
        assert exc.response.json()["error"]["type"] == "RateLimitError"
        # The chat and Anthropic surfaces count the same slots.
        chat = client(server, "sk-conc").chat.completions
        rate_limited(
            chat.create,
            model=DP_MODEL_NAME,
            messages=[{"role": "user", "content": "hi"}],
            stream=True,
        )
        response = httpx.post(
            server.url + "/v1/messages",
            headers={"x-api-key": "sk-conc"},
            json={
                "model": DP_MODEL_NAME,
                "max_tokens": 2,
                "messages": [{"role": "user", "content": "hi"}],
            },
            timeout=30,
        )
        assert response.status_code == 429 and response.headers["retry-after"] == "1"
        body = response.json()
        assert body["type"] == "error" and body["error"]["type"] == "rate_limit_error"
    assert read_to_end(first) == "length" and read_to_end(second) == "length"
    # The three refusals (completions, chat, messages) are counted for the tenant's limit.
    refusals = read_metric(
        metrics_text(server.url),
        "kvserve:tenant_quota_refusals_total",
        tenant="conc",
        limit="max_concurrent",
    )
    assert refusals == 3
    # Both slots were freed when the streams ended.
    assert complete(server, "sk-conc").choices[0].finish_reason == "length"
    assert complete(server, "sk-conc").choices[0].finish_reason == "length"


def test_requests_per_minute_refuses_the_fourth(server):
    server, _ = server
    for _ in range(3):
        complete(server, "sk-rpm")
    exc = rate_limited(complete, server, "sk-rpm")
    assert 1 <= retry_after(exc) <= 60
    assert "requests_per_minute limit 3" in message(exc)
    assert "--tenant-requests-per-minute" in message(exc)
    assert f"retry in {retry_after(exc)} s" in message(exc)
    # Another tenant is not held back by this one.
    assert complete(server, "sk-conc").choices[0].finish_reason == "length"


def window_tokens(server: ServeProcess) -> int:
    """The tpm tenant's tokens in the window, as a refused request's message says: the
    probe reserves the whole limit (10 + 190), so any token in the window refuses it."""
    exc = rate_limited(complete, server, "sk-tpm", max_tokens=190)
    match = re.search(r"(\d+) tokens in the last 60 s", message(exc))
    assert match is not None, message(exc)
    return int(match.group(1))


def test_tokens_per_minute_reserves_then_returns_the_unused_part(server):
    server, _ = server
    complete(server, "sk-tpm", max_tokens=20)  # 10 + 20 used
    assert window_tokens(server) == 30
    with engine_frozen(server):
        stream = complete(server, "sk-tpm", max_tokens=150, stream=True)  # reserves 160
        exc = rate_limited(complete, server, "sk-tpm", max_tokens=10)  # 190 + 20 > 200
        assert "tokens_per_minute limit 200" in message(exc) and "190 tokens" in message(exc)
        assert "--tenant-tokens-per-minute" in message(exc)
        assert 40 <= retry_after(exc) <= 60  # when the first request's 30 tokens leave
        stream.close()  # the client goes away before a token came
    # The stream's unused reservation comes back once the server has aborted it; its
    # prompt (and any token generated before the abort) stays counted.
    assert wait_until(lambda: window_tokens(server) < 190, timeout_s=20)
    assert 40 <= window_tokens(server) <= 60
    # Larger than the whole limit: a 400 that says so, never a 429 to retry.
    with pytest.raises(openai.BadRequestError) as info:
        complete(server, "sk-tpm", max_tokens=191)
    assert "can never be admitted" in message(info.value)


def test_sighup_reloads_quotas_without_dropping_a_stream(server):
    server, key_file = server
    log_marker = "reloaded the key file"
    with engine_frozen(server):
        held = complete(server, "sk-reload", stream=True)
        rate_limited(complete, server, "sk-reload", stream=True)
        # A file that does not parse keeps the old one in force.
        with open(key_file, "w") as f:
            f.write(KEY_FILE + "broken line\n")
        os.kill(server.process.pid, signal.SIGHUP)
        assert wait_until(lambda: "the key file was not reloaded" in server.log(), 10)
        rate_limited(complete, server, "sk-reload", stream=True)
        with open(key_file, "w") as f:
            f.write(KEY_FILE.replace("max_concurrent=1", "max_concurrent=3"))
        os.kill(server.process.pid, signal.SIGHUP)
        assert wait_until(lambda: log_marker in server.log(), 10), server.log()
        assert f"{log_marker}: 4 keys" in server.log()
        second = complete(server, "sk-reload", stream=True)
    assert read_to_end(held) == "length" and read_to_end(second) == "length"
    assert server.process.poll() is None
