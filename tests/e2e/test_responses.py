"""The OpenAI Responses API (/v1/responses) through the official `openai` SDK and the
openai-agents SDK's default (Responses) model, against a real `kvserve serve` of the default
model (hermes tool parser).

Greedy replies are checked against the same conversation through /v1/chat/completions: the
Responses surface is a translation of the chat path, so the text must be the same.
"""

from __future__ import annotations

import asyncio
import json

import httpx
import jsonschema
import openai
import pytest

from tests.support.server import serving_default_model

pytestmark = pytest.mark.slow

MODEL = "smollm2-responses"
WEATHER_PARAMETERS = {
    "type": "object",
    "properties": {
        "location": {"type": "string", "description": "City and country, e.g. Paris"},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    },
    "required": ["location", "unit"],
}
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "Get the current weather in a given location",
    "parameters": WEATHER_PARAMETERS,
}
QUESTION = "What is the weather like in Paris today?"
INSTRUCTIONS = "You are a terse assistant."
HELLO = "Name three colours of the rainbow."


@pytest.fixture(scope="module")
def url(tmp_path_factory):
    with serving_default_model(
        tmp_path_factory,
        MODEL,
        "--enable-auto-tool-choice",
        "--tool-call-parser",
        "hermes",
        "--responses-store-size",
        "4",
    ) as url:
        yield url


@pytest.fixture(scope="module")
def client(url):
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=300)


def chat_text(client: openai.OpenAI, messages: list[dict], max_tokens: int) -> str:
    reply = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=max_tokens, temperature=0
    )
    return reply.choices[0].message.content


def test_create_equals_chat_completions_and_is_stored(client):
    response = client.responses.create(
        model=MODEL, instructions=INSTRUCTIONS, input=HELLO, max_output_tokens=24, temperature=0
    )
    assert response.object == "response" and response.id.startswith("resp_")
    assert response.model == MODEL and response.status in ("completed", "incomplete")
    assert [item.type for item in response.output] == ["message"]
    expected = chat_text(
        client,
        [{"role": "system", "content": INSTRUCTIONS}, {"role": "user", "content": HELLO}],
        24,
    )
    assert response.output_text == expected
    usage = response.usage
    assert 0 < usage.output_tokens <= 24 and usage.input_tokens > 0
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens
    if response.status == "incomplete":
        assert response.incomplete_details.reason == "max_output_tokens"
    stored = client.responses.retrieve(response.id)
    assert stored.id == response.id and stored.output_text == response.output_text


def test_stream_events_add_up_to_the_whole_reply(client):
    whole = client.responses.create(model=MODEL, input=HELLO, max_output_tokens=24, temperature=0)
    with client.responses.stream(
        model=MODEL, input=HELLO, max_output_tokens=24, temperature=0
    ) as stream:
        events = list(stream)
    # The terminal event carries the response: response.completed, or response.incomplete
    # when max_output_tokens cut it (OpenAI's events; the SDK's get_final_response wants
    # the first).
    final = events[-1].response
    assert final.status == whole.status
    types = [event.type for event in events]
    assert types[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert types[-1] in ("response.completed", "response.incomplete")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == whole.output_text == final.output_text
    assert final.usage.output_tokens == whole.usage.output_tokens


def test_previous_response_id_continues_the_conversation(client):
    first = client.responses.create(
        model=MODEL, input="My name is Ada. Say hello.", max_output_tokens=16, temperature=0
    )
    second = client.responses.create(
        model=MODEL,
        previous_response_id=first.id,
        input="What is my name?",
        max_output_tokens=16,
        temperature=0,
    )
    expected = chat_text(
        client,
        [
            {"role": "user", "content": "My name is Ada. Say hello."},
            {"role": "assistant", "content": first.output_text},
            {"role": "user", "content": "What is my name?"},
        ],
        16,
    )
    assert second.output_text == expected and second.previous_response_id == first.id
    # The store holds 4: after four more responses the first is gone, a 404 in OpenAI's shape.
    for _ in range(4):
        client.responses.create(model=MODEL, input="Hi", max_output_tokens=1, store=True)
    with pytest.raises(openai.NotFoundError, match="no response"):
        client.responses.retrieve(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.create(
            model=MODEL, previous_response_id="resp_missing", input="Hi", max_output_tokens=1
        )
    unstored = client.responses.create(model=MODEL, input="Hi", max_output_tokens=1, store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_function_call_matches_the_schema_and_round_trips(client, stream):
    request = dict(
        model=MODEL,
        input=QUESTION,
        tools=[WEATHER],
        tool_choice={"type": "function", "name": "get_weather"},
        max_output_tokens=120,
    )
    if stream:
        with client.responses.stream(**request) as events:
            response = events.get_final_response()
    else:
        response = client.responses.create(**request)
    calls = [item for item in response.output if item.type == "function_call"]
    assert [call.name for call in calls] == ["get_weather"]
    jsonschema.validate(json.loads(calls[0].arguments), WEATHER_PARAMETERS)
    assert calls[0].call_id and calls[0].status == "completed"
    # The tool's result goes back as a function_call_output; the model answers in text.
    reply = client.responses.create(
        model=MODEL,
        tools=[WEATHER],
        tool_choice="none",
        max_output_tokens=40,
        input=[
            {"role": "user", "content": QUESTION},
            *[item.model_dump(exclude_none=True) for item in calls],
            {
                "type": "function_call_output",
                "call_id": calls[0].call_id,
                "output": '{"temperature": 21, "sky": "clear"}',
            },
        ],
    )
    assert [item.type for item in reply.output] == ["message"] and reply.output_text.strip()


def test_json_schema_text_format(client):
    schema = {
        "type": "object",
        "properties": {"colour": {"type": "string"}, "count": {"type": "integer"}},
        "required": ["colour", "count"],
        "additionalProperties": False,
    }
    response = client.responses.create(
        model=MODEL,
        input="Give a colour and a number as JSON.",
        text={"format": {"type": "json_schema", "name": "pick", "schema": schema, "strict": True}},
        max_output_tokens=60,
        temperature=0,
    )
    jsonschema.validate(json.loads(response.output_text), schema)


def test_unsupported_fields_are_refused_by_name(client, url):
    cases = [
        ({"reasoning": {"effort": "high"}}, "reasoning"),
        ({"include": ["message.output_text.logprobs"]}, "include"),
        ({"background": True}, "background"),
        ({"tools": [{"type": "web_search"}]}, "web_search"),
        ({"truncation": "auto"}, "truncation"),
    ]
    for extra, name in cases:
        with pytest.raises(openai.BadRequestError, match=name):
            client.responses.create(model=MODEL, input="Hi", max_output_tokens=1, **extra)
    image = {"type": "input_image", "image_url": "https://example.com/a.png"}
    with pytest.raises(openai.BadRequestError, match="input_image"):
        client.responses.create(
            model=MODEL, input=[{"role": "user", "content": [image]}], max_output_tokens=1
        )
    # A thinking budget needs a reasoning parser, which this server has not.
    with pytest.raises(openai.BadRequestError, match="reasoning parser"):
        client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Hi"}],
            max_tokens=1,
            extra_body={"thinking_token_budget": 4},
        )
    # A field the API does not have at all: a 400 naming it, never silently dropped.
    response = httpx.post(
        url + "/v1/responses", json={"model": MODEL, "input": "Hi", "max_tokenz": 3}
    )
    assert response.status_code == 400 and "max_tokenz" in response.json()["error"]["message"]
    assert httpx.get(url + "/health").status_code == 200


def test_openai_agents_sdk_runs_an_agent_with_a_tool(url):
    import agents

    agents.set_tracing_disabled(True)
    asked: list[str] = []

    @agents.function_tool
    def get_weather(location: str, unit: str) -> str:
        """Get the current weather in a given location."""
        asked.append(location)
        return "21 degrees and clear"

    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    agent = agents.Agent(
        name="weather",
        instructions=INSTRUCTIONS,
        tools=[get_weather],
        model=agents.OpenAIResponsesModel(model=MODEL, openai_client=client),
        model_settings=agents.ModelSettings(
            temperature=0, max_tokens=120, tool_choice="get_weather"
        ),
        # After the tool ran, answer in text (a forced tool choice would call it forever).
        reset_tool_choice=True,
    )
    result = asyncio.run(agents.Runner.run(agent, QUESTION, max_turns=3))
    assert asked, "the agent never called its tool"
    assert isinstance(result.final_output, str) and result.final_output.strip()
