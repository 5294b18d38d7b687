"""A resumed request (`EngineCoreRequest.resumed_output_token_ids`: a request migrated from
an engine core that died) goes on exactly as the uninterrupted one, in a real engine core of
the tiny random Llama: greedy, seeded sampling (its generator past the draws already made),
penalties over the output, a grammar and a thinking budget replayed over the resumed tokens.
"""

from __future__ import annotations

import msgspec
import pytest

from kvserve.llm import LLM
from kvserve.shared.messages import EngineCoreRequest
from kvserve.shared.sampling_params import SamplingParams
from kvserve.shared.structured_outputs import StructuredOutputsParams
from tests.support.kv import assert_no_leaked_blocks
from tests.support.models import TINY_EOS_TOKEN_ID, TINY_KV_CACHE_MEMORY

PROMPT = [ord(c) for c in "once upon a time"]
JSON_TEXT = {
    "type": "object",
    "properties": {"text": {"type": "string", "pattern": "^[a-z]{20,40}$"}},
    "required": ["text"],
}
# Sampled kinds keep the top 8 tokens: the random model's distribution is flat, so a draw
# would otherwise sit near one of 257 boundaries that float32 rounding between the original
# decode and the recompute moves (~1e-7).
PARAMS = {
    "greedy": SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True),
    "seeded": SamplingParams(max_tokens=60, temperature=1.0, top_k=8, seed=7, ignore_eos=True),
    "penalties": SamplingParams(
        max_tokens=60, temperature=0.8, top_k=8, seed=3, frequency_penalty=1.5, ignore_eos=True
    ),
    "json": SamplingParams(
        max_tokens=200,
        temperature=1.0,
        seed=11,
        structured_outputs=StructuredOutputsParams(json=JSON_TEXT, disable_any_whitespace=True),
    ),
    # Thinks until the byte "!" (or until 12 thinking tokens force it), then answers.
    "thinking": SamplingParams(
        max_tokens=40,
        temperature=1.0,
        top_k=8,
        seed=5,
        ignore_eos=True,
        reasoning_end_token_ids=[ord("!")],
        thinking_token_budget=12,
    ),
}


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    return LLM(tiny_llama_dir, kv_cache_memory=TINY_KV_CACHE_MEMORY)


def _run(llm: LLM, request: EngineCoreRequest) -> tuple[list[int], str | None]:
    """The request's new tokens and finish reason, stepped alone in the engine core."""
    core = llm.engine_core
    core.add_request(request)
    tokens, finish_reason = [], None
    while core.has_work():
        for output in core.step().outputs:
            assert output.request_id == request.request_id and output.error is None, output
            tokens += output.new_token_ids
            if output.finish_reason is not None:
                finish_reason = str(output.finish_reason)
    return tokens, finish_reason


@pytest.mark.parametrize("kind", sorted(PARAMS))
def test_a_resumed_request_goes_on_as_the_uninterrupted_one(llm, kind):
    request = EngineCoreRequest(f"{kind}-whole", PROMPT, PARAMS[kind], TINY_EOS_TOKEN_ID)
    whole, finish_reason = _run(llm, request)
    assert len(whole) > 30 and finish_reason is not None
    for cut in (1, 13, len(whole) - 1):
        resumed = msgspec.structs.replace(
            request, request_id=f"{kind}-from-{cut}", resumed_output_token_ids=whole[:cut]
        )
        rest, resumed_finish = _run(llm, resumed)
        assert whole[:cut] + rest == whole, f"resumed after {cut} tokens"
        assert resumed_finish == finish_reason
        llm.reset_prefix_cache()  # the next cut recomputes (no hit from this one)
    assert_no_leaked_blocks(llm.engine_core.scheduler)


def test_resumed_tokens_count_against_max_model_len(llm):
    request = EngineCoreRequest(
        "too-long",
        PROMPT,
        PARAMS["greedy"],
        TINY_EOS_TOKEN_ID,
        resumed_output_token_ids=[65] * (llm.max_model_len - len(PROMPT)),
    )
    llm.engine_core.add_request(request)
    (output,) = llm.engine_core.step().outputs
    assert output.finish_reason is not None and "max_model_len" in (output.error or "")
