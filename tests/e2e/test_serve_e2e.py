"""The OpenAI API against `kvserve serve` as a user runs it: real api and engine processes.

The same checks as test_openai_api.py, fewer of them, through the multi-process path
(MPEngineClient, ZeroMQ, the engine-core process) and with --api-key set.
"""

from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest

from tests.support.metrics import metrics_text, read_metric
from tests.support.server import serving
from tests.support.waiting import wait_until

pytestmark = pytest.mark.slow

MODEL_NAME = "smollm2-serve"
API_KEY = "e2e-key"
MAX_MODEL_LEN = 512
PROMPT = "The capital of France is"
AUTH = {"Authorization": f"Bearer {API_KEY}"}


@pytest.fixture(scope="module", params=["uni", "mp"])
def url(request, tmp_path_factory):
    """A real `kvserve serve`, once per executor: both must pass every test here."""
    log_path = str(tmp_path_factory.mktemp("serve") / "serve.log")
    with serving(
        [
            "--max-model-len",
            str(MAX_MODEL_LEN),
            "--kv-cache-memory",
            "256M",
            "--served-model-name",
            MODEL_NAME,
            "--api-key",
            API_KEY,
            "--uvicorn-log-level",
            "warning",
            "--executor",
            request.param,
        ],
        log_path,
    ) as url:
        yield url


@pytest.fixture(scope="module")
def client(url) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)


def metric(url: str, name: str) -> float:
    return read_metric(metrics_text(url), name)


def test_completion_and_chat_stream_equal_non_stream(client):
    kwargs = dict(model=MODEL_NAME, prompt=PROMPT, max_tokens=10, temperature=0)
    full = client.completions.create(**kwargs)
    chunks = list(
        client.completions.create(**kwargs, stream=True, stream_options={"include_usage": True})
    )
    assert "".join(c.choices[0].text for c in chunks[:-1]) == full.choices[0].text
    assert chunks[-1].usage == full.usage

    messages = [{"role": "user", "content": "Name three colors."}]
    chat = client.chat.completions.create(
        model=MODEL_NAME, messages=messages, max_tokens=12, temperature=0
    )
    streamed = "".join(
        c.choices[0].delta.content or ""
        for c in client.chat.completions.create(
            model=MODEL_NAME, messages=messages, max_tokens=12, temperature=0, stream=True
        )
        if c.choices
    )
    assert streamed == chat.choices[0].message.content


def test_n2_logprobs_and_usage(client):
    response = client.completions.create(
        model=MODEL_NAME,
        prompt=PROMPT,
        max_tokens=5,
        n=2,
        temperature=1.0,
        seed=5,
        logprobs=2,
        extra_body={"ignore_eos": True},
    )
    assert sorted(c.index for c in response.choices) == [0, 1]
    assert response.usage.completion_tokens == 10
    for choice in response.choices:
        assert len(choice.logprobs.tokens) == 5
        assert all(v <= 0 for v in choice.logprobs.token_logprobs)


def test_concurrent_streams_finish(url):
    async def one(client: openai.AsyncOpenAI, i: int) -> int:
        stream = await client.completions.create(
            model=MODEL_NAME,
            prompt=f"{i} {PROMPT}",
            max_tokens=4,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        usage = None
        async for chunk in stream:
            usage = chunk.usage or usage
        return usage.completion_tokens

    async def run_all():
        async with openai.AsyncOpenAI(
            base_url=url + "/v1", api_key=API_KEY, max_retries=0, timeout=300
        ) as client:
            return await asyncio.gather(*(one(client, i) for i in range(32)))

    assert asyncio.run(run_all()) == [4] * 32


def test_disconnect_mid_stream_aborts_in_the_engine(url):
    body = {
        "model": MODEL_NAME,
        "prompt": PROMPT,
        "stream": True,
        "temperature": 0,
        "max_tokens": MAX_MODEL_LEN - 8,
        "ignore_eos": True,
    }
    with httpx.Client(timeout=60, headers=AUTH) as http:
        with http.stream("POST", url + "/v1/completions", json=body) as response:
            assert response.status_code == 200
            # Keep the line iterator referenced: a dropped one is closed, and closing it
            # closes the response (a disconnect) before the running check below.
            lines = response.iter_lines()
            first = next(line for line in lines if line.startswith("data: "))
            assert "choices" in json.loads(first[len("data: ") :])
            assert wait_until(lambda: metric(url, "kvserve:num_requests_running") == 1)
    assert wait_until(
        lambda: (
            metric(url, "kvserve:num_requests_running") == 0
            and metric(url, "kvserve:kv_cache_usage_perc") == 0
        ),
        timeout_s=10,
    )


def test_errors_and_health_after(url, client):
    assert httpx.post(url + "/v1/completions", json={"prompt": PROMPT}).status_code == 401
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-9", prompt=PROMPT)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=0)
    bad = httpx.post(url + "/v1/completions", content=b"{oops", headers=AUTH)
    assert bad.status_code == 400 and bad.json()["error"]["code"] == 400
    assert httpx.get(url + "/health").status_code == 200
    response = client.completions.create(
        model=MODEL_NAME, prompt=PROMPT, max_tokens=2, extra_body={"ignore_eos": True}
    )
    assert response.usage.completion_tokens == 2
    assert response.choices[0].finish_reason == "length"
