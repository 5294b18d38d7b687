"""OpenAI prompt caching across engines, through the official `openai` SDK against one
`kvserve serve` of the tiny model: two DP engine cores sharing a real `kvserve kv-store`
(KvStoreConnector, kv_both), --restart-dead-engines.

- `prompt_cache_key`: every request of a key lands on the same engine core (an idle
  server's plain routing alternates them).
- `prompt_cache_retention: "24h"`: the prompt is pinned and written through to the store;
  after its engine core is SIGKILLed and restarted, the next turn's cached_tokens covers
  the pinned prefix, loaded from the store, and the greedy reply equals the first (uncached)
  one.
"""

from __future__ import annotations

import os
import signal
import uuid

import openai
import pytest

from tests.support.kv_store import StoreProcess
from tests.support.metrics import metrics_text, read_metric
from tests.support.server import DP_MODEL_NAME, start_dp_front_end
from tests.support.waiting import wait_until

pytestmark = pytest.mark.slow

BLOCK_SIZE = 16
CHAT_TEMPLATE = (
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}</{{ m['role'] }}>{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)


@pytest.fixture(scope="module")
def server(tiny_llama_dir, tmp_path_factory):
    store = StoreProcess("--size", "64M")
    transfer = (
        '{"kv_connector": "KvStoreConnector", "kv_role": "kv_both", '
        f'"kv_connector_extra_config": {{"store_address": "{store.ipc}"}}}}'
    )
    server = start_dp_front_end(
        tiny_llama_dir,
        tmp_path_factory.mktemp("pin-engines"),
        "--kv-transfer-config",
        transfer,
        "--restart-dead-engines",
        "--enable-prompt-tokens-details",
        "--chat-template",
        CHAT_TEMPLATE,
    )
    try:
        server.wait_healthy()
        yield server
    finally:
        server.stop()
        store.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def _chat(client, content: str, **extra):
    return client.chat.completions.create(
        model=DP_MODEL_NAME,
        messages=[{"role": "user", "content": content}],
        max_tokens=4,
        temperature=0,
        extra_body={"ignore_eos": True, **extra.pop("extra_body", {})},
        **extra,
    )


def _served_by_engine(server) -> list[float]:
    text = metrics_text(server.url)
    return [
        read_metric(
            text, "kvserve:request_success_total", 0.0, engine=str(i), finished_reason="length"
        )
        for i in range(2)
    ]


def test_the_same_prompt_cache_key_lands_on_the_same_engine(server, client):
    for key in ("agent-a", "agent-b"):
        before = _served_by_engine(server)
        for turn in range(3):
            _chat(client, f"{key} turn {turn} {uuid.uuid4().hex}", prompt_cache_key=key)
        after = _served_by_engine(server)
        assert sorted(a - b for a, b in zip(after, before)) == [0, 3], (before, after)


def test_a_24h_prefix_is_loaded_from_the_store_by_a_restarted_engine(server, client):
    prompt = "Pin me for a day. " + uuid.uuid4().hex * 8
    before = _served_by_engine(server)
    first = _chat(client, prompt, prompt_cache_key="restart", prompt_cache_retention="24h")
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    after = _served_by_engine(server)
    engine = next(i for i in range(2) if after[i] > before[i])  # the engine that served it
    engines = server.health()[1]["engines"]
    old_pid = next(e["pid"] for e in engines if e["engine"] == engine)
    os.kill(old_pid, signal.SIGKILL)

    def restarted() -> bool:
        status, body = server.health()
        pids = {e["engine"]: e.get("pid") for e in body["engines"]}
        return status == 200 and pids.get(engine) not in (None, old_pid)

    assert wait_until(restarted, timeout_s=180, interval_s=0.5), server.log()
    second = _chat(client, prompt, prompt_cache_key="restart")
    num_prompt_tokens = first.usage.prompt_tokens
    # Every full block of the prompt but the one holding its last token (always recomputed).
    expected = (num_prompt_tokens - 1) // BLOCK_SIZE * BLOCK_SIZE
    assert second.usage.prompt_tokens_details.cached_tokens >= expected
    assert second.choices[0].message.content == first.choices[0].message.content
    text = metrics_text(server.url)
    assert (
        sum(
            read_metric(text, "kvserve:external_prefix_cache_hits_total", 0.0, engine=str(i))
            for i in range(2)
        )
        >= expected
    )
