"""Suffix decoding through the whole engine on the real default model (float32), one engine
with it and one without: greedy output equals greedy without speculation token for token,
drafts from a request's own prompt and from earlier outputs are accepted (the engine's
speculation counters), and JSON-schema and tool-call requests speculate under their grammar
with valid output equal to the unspeculated run. Zero leaked KV blocks after each test."""

from __future__ import annotations

import json

import pytest

from kvserve import LLM, SamplingParams
from kvserve.shared.structured_outputs import StructuredOutputsParams
from tests.support.kv import assert_no_leaked_blocks
from tests.support.models import DEFAULT_MODEL_KV_CACHE_MEMORY
from tests.support.prompts import chat_prompt_ids

pytestmark = pytest.mark.slow

MAX_TOKENS = 32
QUESTIONS = [
    "Repeat this sentence exactly, twice: The quick brown fox jumps over the lazy dog.",
    "Rewrite this sentence with 'cat' replaced by 'dog': The cat sat on the mat, and the cat "
    "looked at the hat while the cat purred.",
    "What is the capital of France?",
]
SUFFIX = {"method": "suffix", "num_speculative_tokens": 8, "adaptive": False}
# Bounded, so the small model's reply ends within max_tokens (an unbounded integer loops "111...").
RECORD = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 16}, "capital": {"type": "boolean"}},
    "required": ["city", "capital"],
}
# What the api's tool_choice "required" compiles to (parsers/tool_calls.required_calls_schema).
TOOL_CALLS = {
    "type": "array",
    "minItems": 1,
    "maxItems": 1,
    "items": {
        "anyOf": [
            {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "enum": ["get_weather"]},
                    "parameters": {
                        "type": "object",
                        "properties": {"city": {"type": "string", "maxLength": 16}},
                        "required": ["city"],
                    },
                },
                "required": ["name", "parameters"],
            }
        ]
    },
}


@pytest.fixture(scope="module")
def prompts(default_model_dir) -> list[list[int]]:
    return chat_prompt_ids(
        default_model_dir,
        [*QUESTIONS, "Describe Paris as JSON.", "What is the weather in Oslo? Call the tool."],
    )


@pytest.fixture(scope="module")
def reference() -> LLM:
    return LLM(dtype="float32", kv_cache_memory=DEFAULT_MODEL_KV_CACHE_MEMORY)


@pytest.fixture(scope="module")
def suffix_llm() -> LLM:
    return LLM(
        dtype="float32", kv_cache_memory=DEFAULT_MODEL_KV_CACHE_MEMORY, speculative_config=SUFFIX
    )


def _generate(llm: LLM, prompts, params) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def _accepted(llm: LLM) -> int:
    return llm.stats_totals.spec_num_accepted_tokens


def test_greedy_equals_greedy_without_speculation(prompts, reference, suffix_llm):
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    expected = _generate(reference, prompts[:3], params)
    before = _accepted(suffix_llm)
    assert _generate(suffix_llm, prompts[:3], params) == expected
    # The repeat and rewrite prompts copy their own text: drafts from the prompt accepted.
    num_first = _accepted(suffix_llm) - before
    assert num_first > 0
    totals = suffix_llm.stats_totals
    assert totals.spec_num_accepted_tokens < totals.spec_num_draft_tokens  # and some rejected
    # The same requests again draft from the first run's outputs as well.
    before = _accepted(suffix_llm)
    assert _generate(suffix_llm, prompts[:3], params) == expected
    assert _accepted(suffix_llm) - before > num_first
    assert_no_leaked_blocks(suffix_llm.engine_core.scheduler)


@pytest.mark.parametrize("schema", [RECORD, TOOL_CALLS], ids=["json-schema", "tool-call"])
def test_grammar_requests_speculate_and_equal_the_unspeculated_run(
    schema, prompts, reference, suffix_llm
):
    prompt = prompts[3] if schema is RECORD else prompts[4]
    params = SamplingParams(
        temperature=0.0,
        max_tokens=48,
        structured_outputs=StructuredOutputsParams(json=schema),
    )
    (expected,) = _generate(reference, [prompt], params)
    (first,) = _generate(suffix_llm, [prompt], params)
    before = _accepted(suffix_llm)
    # The second run drafts from the first one's output, position by position under the grammar.
    (second,) = _generate(suffix_llm, [prompt], params)
    assert first == second == expected
    assert _accepted(suffix_llm) - before >= len(expected) // 2
    text = suffix_llm.get_tokenizer().decode(expected, skip_special_tokens=True)
    json.loads(text)  # complete and valid (the grammar ended it, not max_tokens)
    assert_no_leaked_blocks(suffix_llm.engine_core.scheduler)
