"""Prompt caching through the official `anthropic` SDK against `kvserve serve` of the tiny
model (one server for the module): cache_control breakpoints write and then read the prefix
up to them, a 5m pin outlives an LRU flood that evicts an unpinned prefix of the same size,
and is gone after its TTL; the 1h / 5m split, the automatic top-level breakpoint, the
max_tokens 0 pre-warm and the 400s; the pin series on /metrics.

The server runs with KVSERVE_PROMPT_CACHE_TTL_SCALE=0.05 (prompt_cache.py), so a "5m" pin
lives 15 s and a "1h" one 180 s. Its KV cache is 2 MiB (256 blocks of 16 tokens, half of them
the pin budget, which holds every pin of the module), so a flood of unique 480-token
prompts, sized from the engine's block count, cycles every unpinned block. The tiny model's
tokenizer is byte-level: one token per ASCII character.
"""

from __future__ import annotations

import re
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import anthropic
import pytest

from tests.support.metrics import metrics_text, read_metric
from tests.support.server import serving

pytestmark = pytest.mark.slow

MODEL = "tiny-pins"
TTL_SCALE = 0.05
FIVE_MINUTES_S = 300 * TTL_SCALE
BLOCK_SIZE = 16
CHAT_TEMPLATE = (
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}</{{ m['role'] }}>{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)
FIVE = {"type": "ephemeral"}
HOUR = {"type": "ephemeral", "ttl": "1h"}


@pytest.fixture(scope="module")
def url(tiny_llama_dir, tmp_path_factory, monkeypatch_module):
    monkeypatch_module.setenv("KVSERVE_PROMPT_CACHE_TTL_SCALE", str(TTL_SCALE))
    log_path = str(tmp_path_factory.mktemp("pins") / "serve.log")
    args = [
        tiny_llama_dir,
        "--served-model-name",
        MODEL,
        "--kv-cache-memory",
        "2M",
        "--block-size",
        str(BLOCK_SIZE),
        "--chat-template",
        CHAT_TEMPLATE,
        "--uvicorn-log-level",
        "warning",
    ]
    with serving(args, log_path) as url:
        yield url


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as patch:
        yield patch


@pytest.fixture(scope="module")
def client(url):
    return anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module", autouse=True)
def early_pin(client) -> tuple[str, float]:
    """A 5m pin written as the module starts, so the TTL test (the last) waits out its
    TTL while the others run: (its prefix, when it was written)."""
    prefix = _text(300)
    assert _turn(client, prefix, "q").usage.cache_creation_input_tokens == _prefix_len(prefix)
    return prefix, time.monotonic()


def _text(length: int) -> str:
    """`length` characters no other prompt of the run starts with."""
    seed = uuid.uuid4().hex
    return (seed * (length // len(seed) + 1))[:length]


def _turn(client, prefix: str, question: str, cache_control=FIVE, **extra):
    """One user turn: a marked block of `prefix`, then the question."""
    blocks = [{"type": "text", "text": prefix}]
    if cache_control is not None:
        blocks[0]["cache_control"] = cache_control
    blocks.append({"type": "text", "text": question})
    return client.messages.create(
        model=MODEL,
        max_tokens=extra.pop("max_tokens", 2),
        messages=[{"role": "user", "content": blocks}],
        **extra,
    )


def _prefix_len(prefix: str) -> int:
    # The prompt up to and including the marked block: "<user>" + the block's text.
    return len("<user>") + len(prefix)


def _num_blocks(url: str) -> int:
    match = re.search(r'num_gpu_blocks="(\d+)"', metrics_text(url))
    assert match, "cache_config_info has no num_gpu_blocks"
    return int(match.group(1))


def _flood(client, url: str) -> None:
    """Unique prompts whose blocks together outnumber the cache's: every unpinned block is
    evicted."""
    num_tokens = 480
    # Freed blocks join the queue's tail and new ones come from its head, so taking more
    # blocks than the cache holds pops every block that was free before.
    num_requests = _num_blocks(url) * BLOCK_SIZE // num_tokens + 2
    # Four at a time: a fresh request's blocks come from the free queue either way (pins
    # yield only to running requests that grow), and the flood ends well within a TTL.
    with ThreadPoolExecutor(4) as pool:
        replies = pool.map(
            lambda text: client.messages.create(
                model=MODEL, max_tokens=1, messages=[{"role": "user", "content": text}]
            ),
            [_text(num_tokens) for _ in range(num_requests)],
        )
        assert all(reply.usage.cache_read_input_tokens == 0 for reply in replies)


def _count(client, **request) -> int:
    return client.messages.count_tokens(model=MODEL, **request).input_tokens


def test_turn_one_writes_the_prefix_and_turn_two_reads_it(client):
    prefix = _text(200)
    first = _turn(client, prefix, "first?")
    expected = _prefix_len(prefix)
    assert first.usage.cache_creation_input_tokens == expected
    assert first.usage.cache_read_input_tokens == 0
    assert first.usage.cache_creation.ephemeral_5m_input_tokens == expected
    total = len("<user>" + prefix + "\nfirst?</user><assistant>")
    assert first.usage.input_tokens == total - expected
    second = _turn(client, prefix, "second, longer?")
    assert second.usage.cache_read_input_tokens == expected
    assert second.usage.cache_creation_input_tokens == 0


def test_a_pin_outlives_a_flood_that_evicts_an_unpinned_prefix(client, url):
    pinned, unpinned = _text(300), _text(300)
    assert _turn(client, pinned, "q").usage.cache_creation_input_tokens == _prefix_len(pinned)
    _turn(client, unpinned, "q", cache_control=None)
    assert _turn(client, unpinned, "q2", cache_control=None).usage.cache_read_input_tokens > 0
    _flood(client, url)
    assert _turn(client, pinned, "q3").usage.cache_read_input_tokens == _prefix_len(pinned)
    assert _turn(client, unpinned, "q3", cache_control=None).usage.cache_read_input_tokens == 0
    text = metrics_text(url)
    assert read_metric(text, "kvserve:prompt_pinned_blocks") > 0
    assert read_metric(text, "kvserve:prompt_pin_hits_total", ttl="5m") >= 1
    assert read_metric(text, "kvserve:prompt_pin_misses_total", ttl="5m") >= 1


def test_one_hour_and_five_minute_breakpoints_split_the_write(client):
    system, prefix = _text(100), _text(150)
    request = {
        "system": [{"type": "text", "text": system, "cache_control": HOUR}],
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": prefix, "cache_control": FIVE},
                    {"type": "text", "text": "q"},
                ],
            }
        ],
    }
    reply = client.messages.create(model=MODEL, max_tokens=2, **request)
    split = reply.usage.cache_creation
    # The system breakpoint ends where its cut rendering parts from the prompt: past
    # "</system><user>", which the cut (with an empty user turn) renders too.
    system_end = len("<system>" + system + "</system><user>")
    assert split.ephemeral_1h_input_tokens == system_end
    assert split.ephemeral_5m_input_tokens == len(prefix)
    assert reply.usage.cache_creation_input_tokens == system_end + len(prefix)
    usage = reply.usage
    assert usage.input_tokens + usage.cache_creation_input_tokens == _count(client, **request)


def test_top_level_cache_control_marks_the_last_block(client):
    messages = [{"role": "user", "content": _text(120)}]
    first = client.messages.create(
        model=MODEL, max_tokens=2, messages=messages, extra_body={"cache_control": FIVE}
    )
    total = _count(client, messages=messages)
    assert first.usage.cache_creation_input_tokens == total - len("<assistant>")
    assert first.usage.input_tokens == len("<assistant>")
    second = client.messages.create(
        model=MODEL, max_tokens=2, messages=messages, extra_body={"cache_control": FIVE}
    )
    assert second.usage.cache_read_input_tokens == total - len("<assistant>")


def test_a_stream_reports_the_cache_usage_in_its_message_delta(client):
    prefix = _text(200)
    _turn(client, prefix, "q")
    blocks = [
        {"type": "text", "text": prefix, "cache_control": FIVE},
        {"type": "text", "text": "s"},
    ]
    events = client.messages.create(
        model=MODEL, max_tokens=2, messages=[{"role": "user", "content": blocks}], stream=True
    )
    (usage,) = [event.usage for event in events if event.type == "message_delta"]
    assert usage.cache_read_input_tokens == _prefix_len(prefix)
    assert usage.cache_creation_input_tokens == 0


def test_max_tokens_zero_prewarms_the_cache(client):
    prefix = _text(200)
    warm = _turn(client, prefix, "q", max_tokens=0)
    assert warm.content == [] or all(getattr(b, "text", "") == "" for b in warm.content)
    assert warm.usage.output_tokens == 0
    assert warm.usage.cache_creation_input_tokens == _prefix_len(prefix)
    assert _turn(client, prefix, "q2").usage.cache_read_input_tokens == _prefix_len(prefix)


@pytest.mark.parametrize(
    ("request_fields", "message"),
    [
        (
            {"system": [{"type": "text", "text": str(i), "cache_control": FIVE} for i in range(5)]},
            "A maximum of 4 blocks",
        ),
        (
            {
                "system": [
                    {"type": "text", "text": "a", "cache_control": FIVE},
                    {"type": "text", "text": "b", "cache_control": HOUR},
                ]
            },
            "ttl='1h'",
        ),
        (
            {
                "system": [
                    {
                        "type": "text",
                        "text": "a",
                        "cache_control": {"type": "ephemeral", "ttl": "2h"},
                    }
                ]
            },
            "ttl",
        ),
    ],
)
def test_invalid_placements_are_anthropic_400s(client, request_fields, message):
    with pytest.raises(anthropic.BadRequestError) as info:
        client.messages.create(
            model=MODEL,
            max_tokens=2,
            messages=[{"role": "user", "content": "hi"}],
            **request_fields,
        )
    body = info.value.body
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    assert message in body["error"]["message"]


def test_a_pin_is_gone_after_its_ttl(client, url, early_pin):
    prefix, written_at = early_pin
    time.sleep(max(0.0, written_at + FIVE_MINUTES_S + 1 - time.monotonic()))
    _flood(client, url)
    again = _turn(client, prefix, "q2")
    assert again.usage.cache_read_input_tokens == 0
    assert again.usage.cache_creation_input_tokens == _prefix_len(prefix)
    text = metrics_text(url)
    assert read_metric(text, "kvserve:prompt_pin_expirations_total") >= 1
    assert read_metric(text, "kvserve:prompt_pins_yielded_total") == 0  # none ended early
