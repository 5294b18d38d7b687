"""Qwen3-Coder's XML tool calls through `kvserve serve` with the default `auto` parsers: a
tiny random Qwen3 whose chat template writes Qwen3-Coder's format (QWEN3_CODER_TEMPLATE,
condensed from Qwen/Qwen3-Coder-30B-A3B-Instruct's chat_template.jinja: its tools block, its
<tool_call><function=...><parameter=...> calls and <tool_response> results).

`auto` picks qwen3_coder from the template's markers. A regex (structured_outputs) forces the
model's text into one call under tool_choice "auto", so the parser, not a grammar of calls,
finds it, its values typed by the schema; the tool result goes back through the template and
the next turn renders (its prompt counted exactly in usage); the anthropic SDK sees a
tool_use block.
"""

from __future__ import annotations

import json

import anthropic
import httpx
import openai
import pytest

from tests.support.chat_formats import QWEN_TOKENS, save_tiny_chat_model
from tests.support.server import serving

pytestmark = pytest.mark.slow

MODEL = "qwen3-coder-tiny"
QWEN3_CODER_TEMPLATE = """
{%- if tools %}<|im_start|>system
You have access to the following functions:

<tools>
{%- for tool in tools %}
<function>
<name>{{ tool.function.name }}</name>
<parameters>{{ tool.function.parameters | tojson }}</parameters>
</function>
{%- endfor %}
</tools>

If you choose to call a function ONLY reply in the following format with NO suffix:

<tool_call>
<function=example_function_name>
<parameter=example_parameter_1>
value_1
</parameter>
</function>
</tool_call><|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == "assistant" %}<|im_start|>assistant
{{ message.content or "" }}
{%- for call in message.tool_calls or [] %}
<tool_call>
<function={{ call.function.name }}>
{%- for key, value in call.function.arguments.items() %}
<parameter={{ key }}>
{{ value if value is string else value | tojson }}
</parameter>
{%- endfor %}
</function>
</tool_call>
{%- endfor %}<|im_end|>
{% elif message.role == "tool" %}<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""
PARAMETERS = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
    "required": ["city", "days"],
}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": PARAMETERS}}
QUESTION = [{"role": "user", "content": "Weather in Paris for 3 days?"}]
CALL_TEXT = (
    "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
    "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>"
)
FORCED = {"structured_outputs": {"regex": CALL_TEXT.replace("\n", "\\n")}}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    folder = tmp_path_factory.mktemp("qwen3-coder")
    model_dir = save_tiny_chat_model(
        "qwen3", str(folder / "model"), QWEN_TOKENS, "<|im_end|>", QWEN3_CODER_TEMPLATE
    )
    args = [model_dir, "--dtype", "float32", "--max-model-len", "1024"]
    args += ["--kv-cache-memory", str(64 << 20), "--served-model-name", MODEL]
    args += ["--enable-auto-tool-choice", "--uvicorn-log-level", "warning"]
    # Compact JSON: a named call's arguments fit max_tokens whatever the random model prefers.
    args += ["--structured-outputs-config", '{"disable_any_whitespace": true}']
    with serving(args, str(folder / "serve.log")) as url:
        yield url, model_dir


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server[0] + "/v1", api_key="unused", max_retries=0, timeout=120)


def prompt_tokens(model_dir: str, messages: list[dict]) -> int:
    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast.from_pretrained(model_dir)
    ids = tokenizer.apply_chat_template(
        messages, tools=[WEATHER], add_generation_prompt=True, tokenize=True
    )
    return len(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "input_ids") else ids)


def test_auto_picks_qwen3_coder(server):
    card = httpx.get(server[0] + "/v1/models").json()["data"][0]
    assert (card["tool_call_parser"], card["reasoning_parser"]) == ("qwen3_coder", None)


@pytest.mark.parametrize("stream", [False, True])
def test_openai_tool_loop(client, server, stream):
    reply = client.chat.completions.create(
        model=MODEL, messages=QUESTION, tools=[WEATHER], max_tokens=200, stream=stream,
        extra_body=FORCED,
    )  # fmt: skip
    if stream:
        name, arguments, finish = None, "", None
        for chunk in reply:
            for delta in chunk.choices[0].delta.tool_calls or []:
                name = delta.function.name or name
                arguments += delta.function.arguments or ""
            finish = chunk.choices[0].finish_reason or finish
        calls = [(name, arguments)]
    else:
        finish = reply.choices[0].finish_reason
        assert reply.choices[0].message.tool_calls, reply.choices[0].message
        calls = [
            (c.function.name, c.function.arguments) for c in reply.choices[0].message.tool_calls
        ]
    assert [(n, json.loads(a)) for n, a in calls] == [("get_weather", {"city": "Paris", "days": 3})]
    assert finish == "tool_calls"
    history = QUESTION + [
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"id": "call_1", "type": "function",
                 "function": {"name": "get_weather", "arguments": calls[0][1]}}
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21}'},
    ]  # fmt: skip
    second = client.chat.completions.create(
        model=MODEL, messages=history, tools=[WEATHER], max_tokens=4
    )
    as_objects = [
        *history[:1],
        {**history[1], "tool_calls": [{"function": {"name": "get_weather",
                                                    "arguments": json.loads(calls[0][1])}}]},
        history[2],
    ]  # fmt: skip
    assert second.usage.prompt_tokens == prompt_tokens(server[1], as_objects)


def test_a_call_to_an_unknown_function_is_content(client):
    broken = "<tool_call>\n<function=nope>\n</function>\n</tool_call>"
    reply = client.chat.completions.create(
        model=MODEL, messages=QUESTION, tools=[WEATHER], max_tokens=80,
        extra_body={"structured_outputs": {"regex": broken.replace("\n", "\\n")}},
    )  # fmt: skip
    assert reply.choices[0].message.tool_calls in (None, [])
    assert reply.choices[0].message.content == broken


def test_anthropic_tool_use(server):
    client = anthropic.Anthropic(base_url=server[0], api_key="unused", max_retries=0)
    # Bounded values: the random model's forced arguments always close within max_tokens.
    bounded = {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 8},
            "days": {"type": "integer", "minimum": 0, "maximum": 9},
        },
        "required": ["city", "days"],
        "additionalProperties": False,
    }
    tool = {"name": "get_weather", "input_schema": bounded}
    reply = client.messages.create(
        model=MODEL, max_tokens=200, messages=QUESTION, tools=[tool],
        tool_choice={"type": "tool", "name": "get_weather"},
    )  # fmt: skip
    use = next(b for b in reply.content if b.type == "tool_use")
    assert use.name == "get_weather" and set(use.input) >= {"city", "days"}
