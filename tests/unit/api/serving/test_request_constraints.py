"""A request's constraints as SamplingParams, checked in the api without the backend:
response_format and structured_outputs, logit_bias, allowed_token_ids, bad words, and the
OpenAI fields kvserve refuses instead of ignoring."""

from __future__ import annotations

import json

import pytest
from transformers import PreTrainedTokenizerFast

from kvserve.services.api.serving.errors import APIError
from kvserve.services.api.serving.protocol import ChatCompletionRequest, decode_request
from kvserve.services.api.serving.request_constraints import (
    bad_words_token_ids,
    logits_processor_kwargs,
    structured_outputs_of,
)
from kvserve.services.api.surfaces.openai_protocol import CompletionRequest
from kvserve.shared.sampling_params import SamplingParams
from kvserve.shared.structured_outputs import StructuredOutputsParams

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


def decode(body: dict, request_type=CompletionRequest):
    return decode_request(json.dumps({"prompt": "x", **body}).encode(), request_type)


@pytest.fixture(scope="module")
def tokenizer(tiny_llama_dir):
    return PreTrainedTokenizerFast.from_pretrained(tiny_llama_dir)


@pytest.mark.parametrize(
    "body, expected",
    [
        ({}, None),
        ({"response_format": {"type": "text"}}, None),
        ({"response_format": {"type": "json_object"}}, StructuredOutputsParams(json_object=True)),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "a", "schema": SCHEMA},
                }
            },
            StructuredOutputsParams(json=SCHEMA),
        ),
        ({"structured_outputs": {"regex": "[a-z]+"}}, StructuredOutputsParams(regex="[a-z]+")),
        (
            {"structured_outputs": {"choice": ["y", "n"]}},
            StructuredOutputsParams(choice=["y", "n"]),
        ),
        (
            {"structured_outputs": {"json": json.dumps(SCHEMA), "disable_any_whitespace": True}},
            StructuredOutputsParams(json=json.dumps(SCHEMA), disable_any_whitespace=True),
        ),
    ],
)
def test_constraint_of_a_request(body, expected):
    assert structured_outputs_of(decode(body)) == expected


def test_structural_tag_response_format_travels_whole():
    tag = {
        "type": "structural_tag",
        "structures": [{"begin": "<f>", "schema": SCHEMA, "end": "</f>"}],
        "triggers": ["<f>"],
    }
    params = structured_outputs_of(decode({"response_format": tag}))
    assert json.loads(params.structural_tag) == tag


@pytest.mark.parametrize(
    "body, param, message",
    [
        (
            {"structured_outputs": {"regex": "a", "choice": ["a"]}},
            "structured_outputs",
            "exactly one",
        ),
        ({"structured_outputs": {}}, "structured_outputs", "exactly one"),
        ({"structured_outputs": {"json": "{oops"}}, "structured_outputs", "not valid JSON"),
        ({"structured_outputs": {"choice": []}}, "structured_outputs", "at least one"),
        (
            {"structured_outputs": {"regex": "a", "whitespace_pattern": " "}},
            "structured_outputs",
            "whitespace_pattern",
        ),
        ({"suffix": "tail"}, "suffix", "suffix"),
        ({"best_of": 3}, "best_of", "best_of"),
        ({"guided_json": SCHEMA}, "guided_json", "structured_outputs.json"),
        ({"store": True}, "store", "not stored"),
        ({"service_tier": "priority"}, "service_tier", "one service tier"),
    ],
)
def test_malformed_or_unsupported_fields_are_400s(body, param, message):
    with pytest.raises(APIError) as info:
        structured_outputs_of(decode(body))
    assert info.value.status_code == 400 and info.value.param == param
    assert message in info.value.message


@pytest.mark.parametrize(
    "body, param",
    [
        ({"audio": {"voice": "alloy"}}, "audio"),
        ({"modalities": ["text", "audio"]}, "modalities"),
        ({"prediction": {"type": "content", "content": "x"}}, "prediction"),
        ({"functions": [{"name": "f"}]}, "functions"),
        ({"web_search_options": {}}, "web_search_options"),
    ],
)
def test_chat_fields_kvserve_cannot_honour_are_400s(body, param):
    body = {"messages": [{"role": "user", "content": "hi"}], **body}
    with pytest.raises(APIError) as info:
        decode_request(json.dumps(body).encode(), ChatCompletionRequest)
    assert (info.value.status_code, info.value.param) == (400, param)
    # Their harmless values pass.
    decode_request(
        json.dumps({**body, param: None, "modalities": ["text"], "store": False}).encode(),
        ChatCompletionRequest,
    )


def test_both_response_format_and_structured_outputs_is_a_400():
    request = decode(
        {"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}}
    )
    with pytest.raises(APIError, match="not both"):
        structured_outputs_of(request)


def test_logit_bias_allowed_ids_and_bad_words(tokenizer):
    request = decode(
        {"logit_bias": {"5": 10, "7": -100}, "allowed_token_ids": [1, 2], "bad_words": ["ab"]}
    )
    kwargs = logits_processor_kwargs(request, tokenizer)
    assert kwargs["logit_bias"] == {5: 10, 7: -100}
    assert kwargs["bad_words_token_ids"] == bad_words_token_ids(tokenizer, ["ab"])
    ab = tokenizer.encode("ab", add_special_tokens=False)
    assert kwargs["bad_words_token_ids"] == [ab, tokenizer.encode(" ab", add_special_tokens=False)]
    assert request.sampling_kwargs()["allowed_token_ids"] == [1, 2]
    SamplingParams(**request.sampling_kwargs(), **kwargs)  # all of it is valid


@pytest.mark.parametrize(
    "body, param",
    [
        ({"logit_bias": {"x": 1}}, "logit_bias"),
        ({"logit_bias": {"100000": 1}}, "logit_bias"),
        ({"allowed_token_ids": [100000]}, "allowed_token_ids"),
    ],
)
def test_token_ids_outside_the_vocabulary_are_400s(tokenizer, body, param):
    with pytest.raises(APIError) as info:
        logits_processor_kwargs(decode(body), tokenizer)
    assert (info.value.status_code, info.value.param) == (400, param)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"logit_bias": {1: 101.0}}, "logit_bias"),
        ({"allowed_token_ids": []}, "allowed_token_ids"),
        ({"bad_words": [" "]}, "bad_words"),
    ],
)
def test_sampling_params_check_the_new_fields(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)
