"""StructuredOutputsParams: one constraint, checked where it is built, and a cache key that
names the compiled grammar; it crosses process boundaries inside SamplingParams."""

from __future__ import annotations

import msgspec
import pytest

from kvserve.shared.messages import EngineCoreRequest
from kvserve.shared.sampling_params import SamplingParams
from kvserve.shared.structured_outputs import StructuredOutputsParams


@pytest.mark.parametrize(
    "params, kind, spec",
    [
        (
            StructuredOutputsParams(json={"type": "object", "b": 1, "a": 2}),
            "json",
            '{"type":"object","b":1,"a":2}',
        ),  # key order kept: xgrammar follows it
        (StructuredOutputsParams(json='{"type": "string"}'), "json", '{"type": "string"}'),
        (StructuredOutputsParams(regex="[0-9]+"), "regex", "[0-9]+"),
        (StructuredOutputsParams(choice=["a", "b"]), "choice", '["a","b"]'),
        (StructuredOutputsParams(grammar='root ::= "x"'), "grammar", 'root ::= "x"'),
        (StructuredOutputsParams(json_object=True), "json_object", ""),
        (
            StructuredOutputsParams(structural_tag='{"type": "structural_tag"}'),
            "structural_tag",
            '{"type": "structural_tag"}',
        ),
    ],
)
def test_kind_and_spec(params, kind, spec):
    assert (params.kind, params.spec) == (kind, spec)
    assert params.cache_key() == (kind, spec, False)
    assert params.cache_key(disable_any_whitespace=True)[2] is True


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({}, "exactly one"),
        ({"json_object": False}, "exactly one"),
        ({"regex": "a", "grammar": "root ::= a"}, "exactly one"),
        ({"json": "{"}, "not valid JSON"),
        ({"json": "[1]"}, "must be a JSON schema"),
        ({"choice": []}, "at least one"),
        ({"regex": "a", "whitespace_pattern": r"\s"}, "whitespace_pattern"),
    ],
)
def test_malformed_constraints_are_value_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        StructuredOutputsParams(**kwargs)


def test_travels_inside_an_engine_core_request():
    params = SamplingParams(
        structured_outputs=StructuredOutputsParams(json={"type": "integer"}),
        logit_bias={3: 1.5},
        allowed_token_ids=[1, 2],
        bad_words_token_ids=[[4, 5]],
    )
    request = EngineCoreRequest("r", [1, 2], params)
    decoded = msgspec.msgpack.decode(msgspec.msgpack.encode(request), type=EngineCoreRequest)
    assert decoded.sampling_params == params
    assert decoded.sampling_params.has_logits_processors
