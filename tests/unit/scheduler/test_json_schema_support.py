"""The JSON-schema keywords kvserve refuses are exactly ones xgrammar would not enforce, the
ones it accepts are enforced, and the string-length rewrite keeps outputs valid JSON.

Each case holds a document that breaks the schema: the backend must either refuse the schema
or never produce that document (its matcher rejects it).
"""

from __future__ import annotations

import json

import pytest
import xgrammar as xgr

from kvserve.services.scheduler.structured_output.grammar import (
    XgrammarBackend,
    checked_json_schema,
)
from kvserve.services.scheduler.structured_output.json_schema_support import (
    unsupported_features,
    with_length_patterns,
)
from kvserve.shared.structured_outputs import StructuredOutputsParams
from tests.support.models import TINY_EOS_TOKEN_ID


@pytest.fixture(scope="module")
def backend(tiny_llama_dir):
    return XgrammarBackend(tiny_llama_dir, tiny_llama_dir)


def matches(backend, schema, document: str, compact: bool = False) -> bool:
    compiled = backend.compile(StructuredOutputsParams(json=schema), compact)
    matcher = xgr.GrammarMatcher(compiled)
    return matcher.accept_string(document) and matcher.accept_token(TINY_EOS_TOKEN_ID)


# (schema, a document that violates it): refused by kvserve, and not enforced by xgrammar.
REFUSED = [
    ({"type": "array", "uniqueItems": True}, "[1, 1]"),
    ({"type": "array", "contains": {"type": "integer"}}, '["a"]'),
    ({"not": {"type": "string"}}, '"a"'),
    ({"if": {"type": "string"}, "then": {"minLength": 2}}, '"a"'),
    (
        {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "dependentRequired": {"a": ["b"]},
        },
        '{"a": 1}',
    ),
    ({"allOf": [{"type": "integer"}, {"minimum": 2}]}, "1"),
    ({"type": "number", "multipleOf": 0.5}, "0.3"),
    ({"oneOf": [{"type": "integer"}, {"type": "number"}]}, "1"),
    ({"type": "object", "required": ["x"]}, "{}"),
    ({"type": "string", "pattern": "^[a-z]+$", "maxLength": 2}, '"abc"'),
]


@pytest.mark.parametrize("schema, violation", REFUSED, ids=[json.dumps(s) for s, _ in REFUSED])
def test_refused_keywords_are_ones_xgrammar_ignores(backend, schema, violation):
    assert unsupported_features(schema)
    with pytest.raises(ValueError, match="not supported"):
        checked_json_schema(schema)
    # xgrammar itself would let the violation through (if this fails, xgrammar enforces the
    # keyword now and the refusal can go).
    raw = backend.compiler.compile_json_schema(json.dumps(schema), strict_mode=False)
    matcher = xgr.GrammarMatcher(raw)
    assert matcher.accept_string(violation) and matcher.accept_token(TINY_EOS_TOKEN_ID)


# (schema, a document that violates it): accepted by kvserve, enforced by the grammar.
ENFORCED = [
    ({"type": "integer", "multipleOf": 3}, "4"),
    ({"allOf": [{"type": "integer"}]}, '"a"'),
    (
        {
            "oneOf": [
                {"type": "object", "properties": {"k": {"const": "a"}}, "required": ["k"]},
                {"type": "object", "properties": {"k": {"const": "b"}}, "required": ["k"]},
            ]
        },
        '{"k": "c"}',
    ),
    ({"oneOf": [{"type": "string"}, {"type": "integer"}]}, "true"),
    ({"type": "string", "maxLength": 3}, '"abcd"'),
    ({"type": "string", "minLength": 2}, '"a"'),
    ({"type": "string", "maxLength": 3}, '"a\x0cb"'),  # a raw control character
    ({"type": "object", "additionalProperties": {"type": "string", "maxLength": 2}}, '{"a": "\t"}'),
    ({"type": "string", "pattern": "^[0-9]{3}$"}, '"12"'),
    ({"type": "object", "properties": {"a": {"type": "integer"}}}, '{"b": 1}'),
]


@pytest.mark.parametrize("schema, violation", ENFORCED, ids=[json.dumps(s) for s, _ in ENFORCED])
def test_accepted_keywords_are_enforced(backend, schema, violation):
    assert not unsupported_features(schema)
    assert not matches(backend, schema, violation)


def test_string_lengths_become_patterns_of_printable_characters(backend):
    schema = {
        "type": "object",
        "properties": {"s": {"type": "string", "minLength": 1, "maxLength": 4}},
    }
    rewritten = with_length_patterns(schema)
    assert rewritten["properties"]["s"]["pattern"] == "^[^\\x00-\\x1f]{1,4}$"
    assert "pattern" not in schema["properties"]["s"]  # the caller's schema is left alone
    assert matches(backend, schema, '{"s": "abcd"}')
    assert not matches(backend, schema, '{"s": ""}')
    assert matches(backend, schema, '{"s": "é"}', compact=True)


def test_unreadable_patterns_are_refused(backend):
    with pytest.raises(ValueError, match=r"#/properties/a/pattern: regex '\(\?=x\)y'"):
        checked_json_schema(
            {"type": "object", "properties": {"a": {"type": "string", "pattern": "(?=x)y"}}}
        )


def test_choices_match_exactly_whatever_their_characters(backend):
    choices = ["😀 yes", 'say "no"', "back\\slash", "tab\there"]
    compiled = backend.compile(StructuredOutputsParams(choice=choices), False)
    for text in choices:
        matcher = xgr.GrammarMatcher(compiled)
        assert matcher.accept_string(text) and matcher.accept_token(TINY_EOS_TOKEN_ID), text
    assert not xgr.GrammarMatcher(compiled).accept_string("😀 no")


def test_length_bounded_strings_take_the_fast_fix(backend, monkeypatch):
    """The printed grammar is patched; the slow pattern rewrite is never needed (if this
    fails, xgrammar prints its string rule differently now: update grammar.py's patch)."""
    import kvserve.services.scheduler.structured_output.grammar as grammar

    def not_expected(schema):
        raise AssertionError("the fallback ran")

    monkeypatch.setattr(grammar, "with_length_patterns", not_expected)
    schema = {"type": "object", "properties": {"s": {"type": "string", "maxLength": 3}}}
    assert not matches(backend, schema, '{"s": "a\x0cb"}')
    assert matches(backend, schema, '{"s": "abc"}')
