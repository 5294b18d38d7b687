"""Reasoning output (--reasoning-parser deepseek_r1) against a real `kvserve serve` of the
default model, through the official `openai` and `anthropic` SDKs.

The default model never thinks on its own: under deepseek_r1 every reply starts thinking and
SmolLM2 never writes </think>, so a reply is all reasoning until the engine's thinking budget
forces the end tag; the answer then follows. That is the whole path: the api tells the engine
the end tag's tokens, the scheduler forces them at the budget, the sampler samples them, the
api splits the text.
"""

from __future__ import annotations

import json

import anthropic
import jsonschema
import openai
import pytest

from tests.support.server import serving_default_model

pytestmark = pytest.mark.slow

MODEL = "smollm2-reasoning"
QUESTION = [{"role": "user", "content": "Tell me about the history of Paris."}]
BUDGET = 4


@pytest.fixture(scope="module")
def url(tmp_path_factory):
    with serving_default_model(tmp_path_factory, MODEL, "--reasoning-parser", "deepseek_r1") as url:
        yield url


@pytest.fixture(scope="module")
def client(url):
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=300)


def ask(client, **extra):
    return client.chat.completions.create(
        model=MODEL, messages=QUESTION, temperature=0, **({"max_tokens": 48} | extra)
    )


def test_the_budget_ends_the_thinking_and_the_answer_follows(client):
    reply = ask(client, logprobs=True, extra_body={"thinking_token_budget": BUDGET}).choices[0]
    tokens = [entry.token for entry in reply.logprobs.content]
    # BUDGET thinking tokens, then the end tag the engine forced, token by token.
    end = next(i for i in range(len(tokens)) if "".join(tokens[BUDGET : i + 1]) == "</think>")
    assert end > BUDGET - 1 and "".join(tokens[:BUDGET]) == reply.message.reasoning_content
    assert reply.message.reasoning == reply.message.reasoning_content  # vLLM's newer name
    assert reply.message.content == "".join(tokens[end + 1 :]).lstrip("\n")
    assert reply.message.content.strip()


def test_without_a_budget_a_reply_that_never_ends_its_thinking_is_all_reasoning(client):
    reply = ask(client, max_tokens=12).choices[0]
    assert reply.finish_reason == "length"
    assert reply.message.reasoning_content and reply.message.content == ""


def test_streamed_deltas_add_up_to_the_whole_reply(client):
    body = {"thinking_token_budget": BUDGET}
    whole = ask(client, extra_body=body).choices[0].message
    reasoning, content, newer = "", "", ""
    for chunk in ask(client, extra_body=body, stream=True):
        delta = chunk.choices[0].delta if chunk.choices else None
        if delta is not None:
            reasoning += getattr(delta, "reasoning_content", None) or ""
            newer += getattr(delta, "reasoning", None) or ""
            content += delta.content or ""
    assert (reasoning, content) == (whole.reasoning_content, whole.content)
    assert newer == reasoning


def test_structured_output_constrains_the_answer_not_the_thinking(client):
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
        "additionalProperties": False,
    }
    reply = ask(
        client,
        max_tokens=60,
        response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": schema}},
        extra_body={"thinking_token_budget": BUDGET},
    ).choices[0]
    assert reply.message.reasoning_content  # free text, not JSON
    jsonschema.validate(json.loads(reply.message.content), schema)


def test_anthropic_thinking_blocks_with_a_budget(url):
    client = anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0, timeout=300)
    request = dict(
        model=MODEL,
        messages=QUESTION,
        max_tokens=48,
        temperature=0,
        thinking={"type": "enabled", "budget_tokens": BUDGET},
    )
    message = client.messages.create(**request)
    assert [block.type for block in message.content] == ["thinking", "text"]
    assert message.content[0].thinking and message.content[1].text.strip()
    with client.messages.stream(**request) as stream:
        kinds = {event.delta.type for event in stream if event.type == "content_block_delta"}
        final = stream.get_final_message()
    assert kinds == {"thinking_delta", "text_delta"}
    assert [block.type for block in final.content] == ["thinking", "text"]
    assert final.content[0].thinking == message.content[0].thinking
    assert final.content[1].text == message.content[1].text


def test_responses_reasoning_items(client):
    response = client.responses.create(
        model=MODEL,
        input=QUESTION[0]["content"],
        max_output_tokens=48,
        temperature=0,
        extra_body={"thinking_token_budget": BUDGET},
    )
    assert [item.type for item in response.output] == ["reasoning", "message"]
    assert response.output[0].content[0].text and response.output_text.strip()
    with client.responses.stream(
        model=MODEL,
        input=QUESTION[0]["content"],
        max_output_tokens=48,
        temperature=0,
        extra_body={"thinking_token_budget": BUDGET},
    ) as stream:
        events = list(stream)
    thinking = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert thinking == response.output[0].content[0].text
    assert events[-1].response.output_text == response.output_text
