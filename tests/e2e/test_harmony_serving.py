"""gpt-oss's harmony through `kvserve serve` with the default `auto` parsers: a tiny random
gpt-oss whose tokenizer holds harmony's special tokens (tests/support/chat_formats.py).

`auto` picks openai / openai_gptoss from model_type gpt_oss (the card says so). A named
tool_choice opens the call's header in the prompt and its grammar writes the arguments, so
the call is forced: through the openai SDK's tool loop and the anthropic SDK the call is
parsed, the tool result goes back as a harmony tool message, and the next turn renders
(its prompt is exactly harmony's rendering, counted in usage). A free-running "auto" turn of
random tokens parses without a 500.
"""

from __future__ import annotations

import json

import anthropic
import httpx
import msgspec
import openai
import pytest

from kvserve.services.api.harmony.prompt import HarmonyPrompt
from kvserve.services.api.serving.protocol import ChatCompletionRequest
from kvserve.services.api.surfaces.chat_messages import messages_to_dicts
from tests.support.chat_formats import HARMONY_TOKENS, save_tiny_chat_model
from tests.support.server import read_log, serving

pytestmark = pytest.mark.slow

MODEL = "gpt-oss-tiny"
PARAMETERS = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 8}},
    "required": ["city"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Gets the weather.",
        "parameters": PARAMETERS,
    },
}
NAMED = {"type": "function", "function": {"name": "get_weather"}}
QUESTION = [{"role": "user", "content": "Weather in Paris?"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    folder = tmp_path_factory.mktemp("harmony")
    model_dir = save_tiny_chat_model("gpt_oss", str(folder / "model"), HARMONY_TOKENS, "<|return|>")
    log_path = str(folder / "serve.log")
    args = [model_dir, "--dtype", "float32", "--max-model-len", "1024"]
    args += ["--kv-cache-memory", str(64 << 20), "--served-model-name", MODEL]
    args += ["--enable-auto-tool-choice", "--uvicorn-log-level", "warning"]
    # Compact JSON: the forced arguments fit max_tokens whatever the random model prefers.
    args += ["--structured-outputs-config", '{"disable_any_whitespace": true}']
    with serving(args, log_path) as url:
        yield url, model_dir, log_path


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server[0] + "/v1", api_key="unused", max_retries=0, timeout=120)


def test_auto_picks_harmony_and_says_so(server):
    url, _, log_path = server
    card = httpx.get(url + "/v1/models").json()["data"][0]
    assert (card["tool_call_parser"], card["reasoning_parser"]) == ("openai", "openai_gptoss")
    assert "--tool-call-parser auto: openai (from gpt_oss" in read_log(log_path)


def expected_prompt_tokens(model_dir: str, messages: list[dict], choice: str) -> int:
    from transformers import PreTrainedTokenizerFast

    request = msgspec.convert({"messages": messages, "tools": [WEATHER]}, ChatCompletionRequest)
    prompt = HarmonyPrompt(PreTrainedTokenizerFast.from_pretrained(model_dir))
    return len(prompt.token_ids(request, messages_to_dicts(request.messages), choice))


def test_openai_tool_loop(client, server):
    first = client.chat.completions.create(
        model=MODEL, messages=QUESTION, tools=[WEATHER], tool_choice=NAMED, max_tokens=60
    )
    call = first.choices[0].message.tool_calls[0]
    assert call.function.name == "get_weather" and "city" in json.loads(call.function.arguments)
    assert first.usage.prompt_tokens == expected_prompt_tokens(server[1], QUESTION, "get_weather")
    history = QUESTION + [
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": call.id,
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": call.function.arguments},
                }
            ],
        },
        {"role": "tool", "tool_call_id": call.id, "content": '{"temp": 21}'},
    ]
    second = client.chat.completions.create(
        model=MODEL, messages=history, tools=[WEATHER], tool_choice="auto", max_tokens=12
    )
    assert second.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert second.usage.prompt_tokens == expected_prompt_tokens(server[1], history, "auto")


def test_a_streamed_named_call_adds_up(client):
    stream = client.chat.completions.create(
        model=MODEL, messages=QUESTION, tools=[WEATHER], tool_choice=NAMED, max_tokens=60,
        stream=True,
    )  # fmt: skip
    name, arguments = None, ""
    for chunk in stream:
        for delta in chunk.choices[0].delta.tool_calls or []:
            name = delta.function.name or name
            arguments += delta.function.arguments or ""
    assert name == "get_weather" and "city" in json.loads(arguments)


@pytest.mark.parametrize("stream", [False, True])
def test_a_free_auto_turn_parses_without_error(client, stream):
    reply = client.chat.completions.create(
        model=MODEL, messages=QUESTION, tools=[WEATHER], max_tokens=24, stream=stream,
        reasoning_effort="low",
    )  # fmt: skip
    if stream:
        reply = list(reply)
        assert reply[-1].choices[0].finish_reason in ("stop", "length", "tool_calls")
    else:
        assert reply.choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_anthropic_tool_use_and_result(server):
    client = anthropic.Anthropic(base_url=server[0], api_key="unused", max_retries=0)
    tool = {"name": "get_weather", "description": "Gets the weather.", "input_schema": PARAMETERS}
    first = client.messages.create(
        model=MODEL, max_tokens=60, messages=QUESTION, tools=[tool],
        tool_choice={"type": "tool", "name": "get_weather"},
    )  # fmt: skip
    use = next(b for b in first.content if b.type == "tool_use")
    assert use.name == "get_weather" and "city" in use.input
    history = QUESTION + [
        {"role": "assistant", "content": [b.model_dump() for b in first.content]},
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "21 C"}],
        },
    ]
    second = client.messages.create(model=MODEL, max_tokens=8, messages=history, tools=[tool])
    assert second.stop_reason in ("end_turn", "max_tokens", "tool_use")


def test_responses_function_call_item(client):
    tool = {"type": "function", "name": "get_weather", "parameters": PARAMETERS}
    response = client.responses.create(
        model=MODEL, input="Weather in Paris?", tools=[tool],
        tool_choice={"type": "function", "name": "get_weather"}, max_output_tokens=60,
    )  # fmt: skip
    calls = [item for item in response.output if item.type == "function_call"]
    assert calls and calls[0].name == "get_weather" and "city" in json.loads(calls[0].arguments)
