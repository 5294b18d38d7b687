"""The Anthropic Messages API (/v1/messages) through the official `anthropic` SDK, against a
real `kvserve serve` of the default model (hermes tool parser, an API key).

Greedy replies are checked against the same conversation through /v1/chat/completions: the
Messages surface is a translation of the chat path, so the text must be the same.
"""

from __future__ import annotations

import anthropic
import httpx
import jsonschema
import openai
import pytest

from tests.support.server import serving_default_model

pytestmark = pytest.mark.slow

MODEL = "smollm2-messages"
KEY = "sk-messages-test"
WEATHER = {
    "name": "get_weather",
    "description": "Get the current weather in a given location",
    "input_schema": {
        "type": "object",
        "properties": {
            "location": {"type": "string", "description": "City and country, e.g. Paris"},
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        },
        "required": ["location", "unit"],
    },
}
QUESTION = [{"role": "user", "content": "What is the weather like in Paris today?"}]
SYSTEM = "You are a terse assistant."
HELLO = [{"role": "user", "content": "Name three colours of the rainbow."}]


@pytest.fixture(scope="module")
def url(tmp_path_factory):
    with serving_default_model(
        tmp_path_factory,
        MODEL,
        "--enable-auto-tool-choice",
        "--tool-call-parser",
        "hermes",
        "--api-key",
        KEY,
    ) as url:
        yield url


@pytest.fixture(scope="module")
def client(url):
    return anthropic.Anthropic(base_url=url, api_key=KEY, max_retries=0, timeout=300)


def chat_text(url: str, messages: list[dict], max_tokens: int, **extra) -> str:
    chat = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=300)
    reply = chat.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=max_tokens, temperature=0, **extra
    )
    return reply.choices[0].message.content


def test_create_equals_chat_completions(client, url):
    message = client.messages.create(
        model=MODEL, system=SYSTEM, messages=HELLO, max_tokens=24, temperature=0
    )
    assert message.type == "message" and message.role == "assistant" and message.model == MODEL
    assert message.id.startswith("msg_")
    assert [block.type for block in message.content] == ["text"]
    expected = chat_text(url, [{"role": "system", "content": SYSTEM}, *HELLO], 24)
    assert message.content[0].text == expected
    assert message.stop_reason in ("end_turn", "max_tokens")
    assert message.stop_sequence is None
    usage = message.usage
    assert 0 < usage.output_tokens <= 24
    count = client.messages.count_tokens(model=MODEL, system=SYSTEM, messages=HELLO)
    # input_tokens leaves out what the prefix cache served (cache_read_input_tokens).
    assert usage.input_tokens + usage.cache_read_input_tokens == count.input_tokens > 0


def test_stop_sequence_ends_the_reply_and_is_named(client):
    whole = client.messages.create(model=MODEL, messages=HELLO, max_tokens=24, temperature=0)
    text = whole.content[0].text
    words = text.split()
    assert len(words) >= 3, text
    stop = words[2]
    cut = client.messages.create(
        model=MODEL, messages=HELLO, max_tokens=24, temperature=0, stop_sequences=[stop]
    )
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == stop
    assert cut.content[0].text == text[: text.index(stop)]


def test_stream_events_add_up_to_the_whole_reply(client):
    whole = client.messages.create(model=MODEL, messages=HELLO, max_tokens=24, temperature=0)
    events = []
    with client.messages.stream(
        model=MODEL, messages=HELLO, max_tokens=24, temperature=0
    ) as stream:
        for event in stream:
            events.append(event.type)
        final = stream.get_final_message()
    assert events[0] == "message_start" and events[-1] == "message_stop"
    assert "content_block_start" in events and "content_block_stop" in events
    assert final.content[0].text == whole.content[0].text
    assert final.stop_reason == whole.stop_reason
    assert final.usage.output_tokens == whole.usage.output_tokens


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize(
    "tool_choice",
    [
        {"type": "tool", "name": "get_weather"},
        # One call: "any" alone lets the grammar go on to more calls, past max_tokens here.
        {"type": "any", "disable_parallel_tool_use": True},
    ],
    ids=["tool", "any"],
)
def test_tool_use_matches_the_schema_and_round_trips(client, tool_choice, stream):
    request = dict(
        model=MODEL, messages=QUESTION, tools=[WEATHER], tool_choice=tool_choice, max_tokens=120
    )
    if stream:
        with client.messages.stream(**request) as events:
            message = events.get_final_message()
    else:
        message = client.messages.create(**request)
    assert message.stop_reason == "tool_use"
    uses = [block for block in message.content if block.type == "tool_use"]
    assert [use.name for use in uses] == ["get_weather"]
    jsonschema.validate(uses[0].input, WEATHER["input_schema"])
    # The tool's result goes back; the model answers in text.
    reply = client.messages.create(
        model=MODEL,
        tools=[WEATHER],
        tool_choice={"type": "none"},
        max_tokens=40,
        messages=[
            *QUESTION,
            {"role": "assistant", "content": message.content},
            {
                "role": "user",
                "content": [
                    {
                        "type": "tool_result",
                        "tool_use_id": uses[0].id,
                        "content": '{"temperature": 21, "sky": "clear"}',
                    }
                ],
            },
        ],
    )
    assert reply.stop_reason in ("end_turn", "max_tokens")
    assert [block.type for block in reply.content] == ["text"] and reply.content[0].text.strip()


def test_auth_and_bad_requests_answer_anthropic_errors(client, url):
    bad_key = anthropic.Anthropic(base_url=url, api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as info:
        bad_key.messages.create(model=MODEL, messages=HELLO, max_tokens=4)
    assert info.value.body["type"] == "error"
    assert info.value.body["error"]["type"] == "authentication_error"
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": ""}}
    with pytest.raises(anthropic.BadRequestError, match="vision model"):
        client.messages.create(
            model=MODEL, messages=[{"role": "user", "content": [image]}], max_tokens=4
        )
    with pytest.raises(anthropic.BadRequestError, match="reasoning parser"):
        client.messages.create(
            model=MODEL,
            messages=HELLO,
            max_tokens=64,
            thinking={"type": "enabled", "budget_tokens": 32},
        )
    with pytest.raises(anthropic.NotFoundError):
        client.messages.create(model="claude-sonnet-4", messages=HELLO, max_tokens=4)
    # Not through the SDK: the raw body of a malformed request.
    response = httpx.post(
        url + "/v1/messages", headers={"x-api-key": KEY}, json={"model": MODEL, "max_tokens": 4}
    )
    assert response.status_code == 400
    body = response.json()
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    assert "messages" in body["error"]["message"]
    assert httpx.get(url + "/health").status_code == 200
