"""Structured outputs and tool calling against a real `kvserve serve`, through the official
openai client: JSON schemas, regexes, choices, EBNF grammars, tools, logits processors.

The model is the tiny random Llama: it writes garbage, so whatever passes here passes because
the grammar forced it. Sampling is seeded, so each output is the same run after run. The
server compiles JSON without optional whitespace (--structured-outputs-config), which keeps
the random model's outputs short. The default model's tool calls are in
test_tool_calling.py.
"""

from __future__ import annotations

import ast
import asyncio
import json
import re

import httpx
import jsonschema
import openai
import pytest

from kvserve.llm import LLM
from kvserve.shared.sampling_params import SamplingParams
from kvserve.shared.structured_outputs import StructuredOutputsParams
from tests.support.kv import assert_no_leaked_blocks
from tests.support.metrics import engine_idle, metrics_text, read_metric
from tests.support.models import TINY_KV_CACHE_MEMORY
from tests.support.server import serving
from tests.support.streams import collect_stream
from tests.support.waiting import wait_until

MODEL = "tiny-structured"
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if tools %}tools: {{ tools | map(attribute='function.name') | join(', ') }}\n"
    "{% endif %}assistant:"
)
MESSAGES = [{"role": "user", "content": "Answer in JSON."}]
MAX_TOKENS = 400  # the tiny model holds 512 tokens

# A dozen schemas, each exercising one feature; strings are bounded so the random model's
# outputs end well inside MAX_TOKENS.
POINT = {
    "type": "object",
    "properties": {
        "x": {"type": "integer", "minimum": 0, "maximum": 9},
        "y": {"type": "integer", "minimum": 0, "maximum": 9},
    },
    "required": ["x", "y"],
}
SCHEMAS = {
    "nested_objects": {
        "type": "object",
        "properties": {
            "user": {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "maxLength": 12},
                    "address": {
                        "type": "object",
                        "properties": {
                            "city": {"type": "string", "minLength": 1, "maxLength": 10},
                            "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                        },
                        "required": ["city", "zip"],
                    },
                },
                "required": ["name", "address"],
            }
        },
        "required": ["user"],
    },
    "array_min_max_items": {
        "type": "array",
        "items": {"type": "integer", "minimum": 0, "maximum": 9},
        "minItems": 2,
        "maxItems": 4,
    },
    "enums": {
        "type": "object",
        "properties": {"color": {"enum": ["red", "green", "blue"]}, "size": {"enum": [1, 2, 3]}},
        "required": ["color", "size"],
    },
    "string_patterns": {
        "type": "object",
        "properties": {
            "phone": {"type": "string", "pattern": "^[0-9]{3}-[0-9]{4}$"},
            "code": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{2}$"},
        },
        "required": ["phone", "code"],
    },
    "integer_bounds": {
        "type": "object",
        "properties": {
            "age": {"type": "integer", "minimum": 18, "maximum": 99},
            "score": {"type": "integer", "exclusiveMinimum": 0, "exclusiveMaximum": 10},
        },
        "required": ["age", "score"],
    },
    "any_of": {
        "type": "object",
        "properties": {
            "value": {
                "anyOf": [
                    {"type": "integer", "minimum": 0, "maximum": 100},
                    {"type": "string", "maxLength": 5},
                    {"type": "null"},
                ]
            }
        },
        "required": ["value"],
    },
    "required_and_optional": {
        "type": "object",
        "properties": {
            "id": {"type": "integer", "minimum": 0, "maximum": 1000},
            "note": {"type": "string", "maxLength": 8},
            "flag": {"type": "boolean"},
        },
        "required": ["id"],
    },
    "additional_properties_false": {
        "type": "object",
        "properties": {"a": {"type": "boolean"}, "b": {"type": "null"}},
        "required": ["a", "b"],
        "additionalProperties": False,
    },
    "array_of_objects": {
        "type": "array",
        "items": {
            "type": "object",
            "properties": {
                "k": {"type": "string", "maxLength": 4},
                "v": {"type": "integer", "minimum": 0, "maximum": 9},
            },
            "required": ["k", "v"],
        },
        "minItems": 1,
        "maxItems": 3,
    },
    "refs": {
        "$defs": {"point": POINT},
        "type": "object",
        "properties": {"start": {"$ref": "#/$defs/point"}, "end": {"$ref": "#/$defs/point"}},
        "required": ["start", "end"],
    },
    "const_boolean_nullable": {
        "type": "object",
        "properties": {
            "version": {"const": 2},
            "ok": {"type": "boolean"},
            "tag": {"type": ["string", "null"], "maxLength": 3},
        },
        "required": ["version", "ok", "tag"],
    },
    "formats": {
        "type": "object",
        "properties": {
            "day": {"type": "string", "format": "date"},
            "id": {"type": "string", "format": "uuid"},
        },
        "required": ["day", "id"],
    },
}
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather at a place.",
        "parameters": {
            "type": "object",
            "properties": {
                "location": {"type": "string", "minLength": 1, "maxLength": 12},
                "unit": {"enum": ["celsius", "fahrenheit"]},
            },
            "required": ["location", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME_TOOL = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"enum": ["utc", "cet"]}},
            "required": ["zone"],
        },
    },
}
TOOLS = [WEATHER_TOOL, TIME_TOOL]
TOOL_SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


@pytest.fixture(scope="module")
def url(tiny_llama_dir, tmp_path_factory):
    log_path = str(tmp_path_factory.mktemp("structured") / "serve.log")
    with serving(
        [
            tiny_llama_dir,
            "--served-model-name",
            MODEL,
            "--kv-cache-memory",
            str(TINY_KV_CACHE_MEMORY),
            "--structured-outputs-config",
            '{"disable_any_whitespace": true}',
            "--chat-template",
            CHAT_TEMPLATE,
            "--enable-auto-tool-choice",
            "--tool-call-parser",
            "hermes",
            "--uvicorn-log-level",
            "warning",
        ],
        log_path,
    ) as url:
        yield url
        # The module's leak check: every request gone, every KV block free.
        assert wait_until(lambda: engine_idle(url), timeout_s=20), metrics_text(url)


@pytest.fixture(scope="module")
def client(url) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def schema_outputs(url) -> dict[str, list[openai.types.chat.ChatCompletion]]:
    """Every schema's completion, two seeds each, sent at once (they batch together)."""

    async def run():
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        names = [name for name in SCHEMAS for _ in range(2)]
        responses = await asyncio.gather(
            *(
                client.chat.completions.create(
                    model=MODEL,
                    messages=MESSAGES,
                    max_tokens=MAX_TOKENS,
                    temperature=1.0,
                    seed=seed,
                    response_format={
                        "type": "json_schema",
                        "json_schema": {"name": name, "schema": SCHEMAS[name], "strict": True},
                    },
                )
                for seed, name in enumerate(names)
            )
        )
        outputs: dict[str, list] = {}
        for name, response in zip(names, responses):
            outputs.setdefault(name, []).append(response)
        return outputs

    return asyncio.run(run())


# --------------------------------------------------------------------------- JSON schemas


@pytest.mark.parametrize("name", list(SCHEMAS))
def test_json_schema_outputs_validate(schema_outputs, name):
    validator = jsonschema.Draft202012Validator(
        SCHEMAS[name], format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER
    )
    for response in schema_outputs[name]:
        choice = response.choices[0]
        assert choice.finish_reason == "stop", choice.message.content
        document = json.loads(choice.message.content)  # strict: no raw control characters
        errors = [e.message for e in validator.iter_errors(document)]
        assert not errors, (choice.message.content, errors)


def test_json_object_and_schema_through_completions(client):
    response = client.completions.create(
        model=MODEL,
        prompt="{",
        max_tokens=MAX_TOKENS,
        seed=3,
        n=2,
        extra_body={"structured_outputs": {"json": SCHEMAS["refs"]}},
    )
    for choice in response.choices:
        jsonschema.validate(json.loads(choice.text), SCHEMAS["refs"])
    response = client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        max_tokens=MAX_TOKENS + 60,
        seed=5,
        response_format={"type": "json_object"},
    )
    assert response.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(response.choices[0].message.content), dict)


# --------------------------------------------------------------------------- regex, choice, EBNF

REGEXES = [r"[a-z]{3,8}@[a-z]{2,5}\.(com|org)", r"\d{4}-\d{2}-\d{2}", r"(yes|no)!{1,3}"]


@pytest.mark.parametrize("regex", REGEXES)
def test_regex_outputs_fullmatch(client, regex):
    response = client.completions.create(
        model=MODEL,
        prompt="x",
        max_tokens=50,
        n=3,
        seed=1,
        extra_body={"structured_outputs": {"regex": regex}},
    )
    for choice in response.choices:
        assert re.fullmatch(regex, choice.text), choice.text


def test_choice_outputs_are_in_the_list(client):
    choices = ["positive", "negative", "neutral", "mixed (both)"]
    response = client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        max_tokens=20,
        n=8,
        seed=2,
        extra_body={"structured_outputs": {"choice": choices}},
    )
    texts = [choice.message.content for choice in response.choices]
    assert all(text in choices for text in texts), texts
    assert len(set(texts)) > 1  # seeded children differ: the choice is really sampled


EXPRESSION_GRAMMAR = r"""
root ::= expr
expr ::= term (("+" | "-" | "*") term){0,3}
term ::= num | "(" num ("+" | "-") num ")"
num ::= [1-9] [0-9]{0,2}
"""


def test_ebnf_grammar_outputs_parse(client):
    response = client.completions.create(
        model=MODEL,
        prompt="x",
        max_tokens=60,
        n=4,
        seed=4,
        extra_body={"structured_outputs": {"grammar": EXPRESSION_GRAMMAR}},
    )
    for choice in response.choices:
        tree = ast.parse(choice.text, mode="eval")  # the grammar's language is Python's too
        allowed = (ast.Expression, ast.BinOp, ast.Constant, ast.Add, ast.Sub, ast.Mult)
        assert all(isinstance(node, allowed) for node in ast.walk(tree)), choice.text
        assert eval(compile(tree, "<grammar>", "eval")) is not None


# --------------------------------------------------------------------------- streaming


def test_streaming_equals_non_streaming_greedy(client):
    chat = dict(
        model=MODEL,
        messages=MESSAGES,
        max_tokens=MAX_TOKENS,
        temperature=0,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "point", "schema": SCHEMAS["refs"]},
        },
    )
    whole = client.chat.completions.create(**chat).choices[0]
    chunks = list(client.chat.completions.create(**chat, stream=True))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == whole.message.content
    assert chunks[-1].choices[0].finish_reason == whole.finish_reason == "stop"

    completion = dict(
        model=MODEL,
        prompt="x",
        max_tokens=40,
        temperature=0,
        extra_body={"structured_outputs": {"regex": REGEXES[1]}},
    )
    whole_text = client.completions.create(**completion).choices[0].text
    stream = client.completions.create(**completion, stream=True)
    assert "".join(c.choices[0].text for c in stream if c.choices) == whole_text


def test_max_tokens_cuts_a_constrained_output_with_length(client):
    response = client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        max_tokens=4,
        seed=0,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "n", "schema": SCHEMAS["nested_objects"]},
        },
    )
    choice = response.choices[0]
    assert choice.finish_reason == "length"
    assert '{"user":'.startswith(choice.message.content) and choice.message.content


def test_a_stop_string_inside_a_constrained_output(client):
    response = client.completions.create(
        model=MODEL,
        prompt="x",
        max_tokens=40,
        seed=0,
        stop=["-"],
        extra_body={"structured_outputs": {"regex": r"[a-c]{4}-[0-9]{4}"}},
    )
    choice = response.choices[0]
    assert re.fullmatch("[a-c]{4}", choice.text) and choice.finish_reason == "stop"
    assert choice.stop_reason == "-"


# --------------------------------------------------------------------------- tools


def tool_call_arguments(message) -> list[tuple[str, dict]]:
    calls = [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls]
    for name, arguments in calls:
        jsonschema.validate(arguments, TOOL_SCHEMAS[name])
    return calls


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize(
    "tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}]
)
def test_forced_tool_calls_parse_and_match_their_schema(client, tool_choice, stream):
    request = dict(
        model=MODEL,
        messages=[{"role": "user", "content": "What is the weather in Paris?"}],
        tools=TOOLS,
        tool_choice=tool_choice,
        max_tokens=MAX_TOKENS,
        seed=7,
    )
    if not stream:
        choice = client.chat.completions.create(**request).choices[0]
        message, finish_reason = choice.message, choice.finish_reason
    else:
        message, finish_reason = collect_stream(
            client.chat.completions.create(**request, stream=True)
        )
    # A named choice ends "stop" (OpenAI's and vLLM's answer), "required" "tool_calls"; a
    # whole reply of calls has content "" (vLLM's), a stream sends no content delta.
    assert finish_reason == ("stop" if isinstance(tool_choice, dict) else "tool_calls")
    assert message.content == (None if stream else "")
    calls = tool_call_arguments(message)
    assert calls and all(c.id.startswith("chatcmpl-tool-") for c in message.tool_calls)
    if isinstance(tool_choice, dict):
        assert [name for name, _ in calls] == ["get_weather"]


def test_a_history_with_tool_results_renders_and_continues(client):
    first = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Weather in Oslo?"}],
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        max_tokens=MAX_TOKENS,
        seed=8,
    ).choices[0]
    call = first.message.tool_calls[0]
    history = [
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": -3}'},
    ]
    reply = client.chat.completions.create(
        model=MODEL, messages=history, tools=TOOLS, tool_choice="none", max_tokens=8
    ).choices[0]
    assert reply.finish_reason == "length" and reply.message.content
    assert reply.message.tool_calls in (None, [])
    # The template rendered the tool result where the model continues from it.
    base = str(client.base_url).removesuffix("/v1/")
    tokens = httpx.post(base + "/tokenize", json={"messages": history}).json()["tokens"]
    prompt = httpx.post(base + "/detokenize", json={"tokens": tokens}).json()["prompt"]
    assert 'tool: {"temperature": -3}\nassistant:' in prompt


def test_auto_tool_choice_without_a_call_is_content(client):
    response = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, tools=TOOLS, max_tokens=8, seed=1
    )
    choice = response.choices[0]
    assert choice.finish_reason == "length" and choice.message.content
    assert not choice.message.tool_calls


# --------------------------------------------------------------------------- logits processors


def test_allowed_token_ids_logit_bias_and_bad_words(client):
    tokenize = lambda text: httpx.post(  # noqa: E731
        str(client.base_url).replace("/v1/", "/tokenize"), json={"prompt": text}
    ).json()["tokens"]
    a, b, z = tokenize("a")[-1], tokenize("b")[-1], tokenize("z")[-1]
    common = dict(model=MODEL, prompt="x", max_tokens=12, seed=0, extra_body={"ignore_eos": True})
    allowed = (
        client.completions.create(
            **common | {"extra_body": {"allowed_token_ids": [a, b], "ignore_eos": True}}
        )
        .choices[0]
        .text
    )
    assert set(allowed) <= {"a", "b"} and len(allowed) == 12
    biased = client.completions.create(**common, logit_bias={str(z): 100}).choices[0].text
    assert biased == "z" * 12
    banned = (
        client.completions.create(
            **common | {"extra_body": {"bad_words": ["z"], "ignore_eos": True}},
            logit_bias={str(z): 100},
        )
        .choices[0]
        .text
    )
    assert banned and "z" not in banned


# --------------------------------------------------------------------------- bad input

BAD_STRUCTURED = [
    ({"json": {"type": "objekt"}}, "invalid JSON schema"),
    ({"json": {"type": "array", "uniqueItems": True}}, "uniqueItems is not supported"),
    ({"regex": "(a"}, "invalid regex"),
    ({"grammar": "root ::= missing"}, "invalid grammar"),
]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("structured, message", BAD_STRUCTURED, ids=[m for _, m in BAD_STRUCTURED])
def test_a_constraint_that_does_not_compile_is_a_400(client, structured, message, stream):
    with pytest.raises(openai.BadRequestError) as info:
        response = client.completions.create(
            model=MODEL,
            prompt="x",
            max_tokens=5,
            stream=stream,
            extra_body={"structured_outputs": structured},
        )
        list(response) if stream else None
    assert message in info.value.message
    assert_still_serving(client)


@pytest.mark.parametrize(
    "request_fields, param",
    [
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice",
        ),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"response_format": {"type": "xml"}}, "response_format"),
        (
            {
                "response_format": {"type": "json_object"},
                "extra_body": {"structured_outputs": {"regex": "a"}},
            },
            "structured_outputs",
        ),
        (
            {"extra_body": {"structured_outputs": {"regex": "a", "choice": ["a"]}}},
            "structured_outputs",
        ),
        ({"logit_bias": {"999999": 1}}, "logit_bias"),
        ({"extra_body": {"prediction": {"type": "content", "content": "x"}}}, "prediction"),
    ],
)
def test_malformed_requests_are_400s_naming_the_field(client, request_fields, param):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=5, **request_fields
        )
    assert info.value.body["param"] == param
    assert_still_serving(client)


def assert_still_serving(client) -> None:
    response = client.completions.create(model=MODEL, prompt="x", max_tokens=2)
    assert response.choices[0].text is not None


# --------------------------------------------------------------------------- metrics


def test_grammar_metrics(client, url):
    schema = {"type": "object", "properties": {"metric_probe": {"type": "boolean"}}}
    for _ in range(2):
        client.chat.completions.create(
            model=MODEL,
            messages=MESSAGES,
            max_tokens=30,
            response_format={"type": "json_schema", "json_schema": {"name": "m", "schema": schema}},
        )
    text = metrics_text(url)
    assert read_metric(text, "kvserve:structured_output_compile_time_seconds_count") >= 1
    hits = read_metric(text, "kvserve:structured_output_cache_hits_total")
    queries = read_metric(text, "kvserve:structured_output_cache_queries_total")
    assert 1 <= hits < queries
    assert read_metric(text, "kvserve:num_requests_waiting_for_grammar") == 0


# --------------------------------------------------------------------------- offline


def test_offline_llm_structured_outputs(tiny_llama_dir):
    llm = LLM(tiny_llama_dir, kv_cache_memory=TINY_KV_CACHE_MEMORY)
    try:
        schema = SCHEMAS["enums"]
        params = SamplingParams(
            max_tokens=MAX_TOKENS,
            seed=0,
            structured_outputs=StructuredOutputsParams(json=schema, disable_any_whitespace=True),
        )
        outputs = llm.generate(["a", "b", "c"], params, use_tqdm=False)
        for output in outputs:
            jsonschema.validate(json.loads(output.outputs[0].text), schema)
        with pytest.raises(ValueError, match="structured_outputs: invalid regex"):
            llm.generate("a", SamplingParams(structured_outputs=StructuredOutputsParams(regex="(")))
        assert_no_leaked_blocks(llm.engine_core.scheduler)
    finally:
        llm.engine_core.shutdown()


# --------------------------------------------------------------------------- executors, DP


@pytest.mark.slow
@pytest.mark.parametrize(
    "flags",
    [["--executor", "mp"], ["--data-parallel-size", "2"]],
    ids=["mp-executor", "data-parallel"],
)
def test_constraints_hold_with_the_mp_executor_and_data_parallelism(
    tiny_llama_dir, tmp_path, flags
):
    """The bitmask reaches workers through the shared-memory ring, and each engine core of a
    data-parallel server compiles its own grammars."""
    args = [tiny_llama_dir, "--served-model-name", MODEL, "--kv-cache-memory"]
    args += [str(TINY_KV_CACHE_MEMORY), "--uvicorn-log-level", "warning", *flags]
    with serving(args, str(tmp_path / "serve.log")) as url:

        async def run():
            client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
            return await asyncio.gather(
                *(
                    client.completions.create(
                        model=MODEL,
                        prompt=f"request {i}",
                        max_tokens=MAX_TOKENS,
                        seed=i,
                        extra_body={
                            "structured_outputs": {
                                "json": SCHEMAS["array_of_objects"],
                                "disable_any_whitespace": True,
                            }
                        },
                    )
                    for i in range(6)
                )
            )

        for response in asyncio.run(run()):
            jsonschema.validate(json.loads(response.choices[0].text), SCHEMAS["array_of_objects"])
        assert wait_until(lambda: engine_idle(url), timeout_s=20), metrics_text(url)
        if "--data-parallel-size" in flags:
            text = metrics_text(url)
            for engine in ("0", "1"):  # both engines served (and compiled for) requests
                name = "kvserve:structured_output_cache_queries_total"
                assert read_metric(text, name, engine=engine) > 0
