"""The offline `LLM` with the tiny model: num_cached_tokens on RequestOutput, --max-logprobs."""

from __future__ import annotations

import pytest

from kvserve import LLM, SamplingParams
from tests.support.kv import assert_no_leaked_blocks
from tests.support.models import TINY_KV_CACHE_MEMORY

BLOCK_SIZE = 16


@pytest.fixture(scope="module")
def llm(tiny_llama_dir) -> LLM:
    return LLM(
        tiny_llama_dir,
        kv_cache_memory_bytes=TINY_KV_CACHE_MEMORY,
        block_size=BLOCK_SIZE,
        max_logprobs=3,
    )


def test_num_cached_tokens_counts_full_blocks_before_the_last_token(llm):
    prompt_ids = list(range(40, 90))  # 50 tokens: 3 full blocks, the last one partial
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    llm.reset_prefix_cache()
    [cold] = llm.generate({"prompt_token_ids": prompt_ids}, params, use_tqdm=False)
    [warm] = llm.generate({"prompt_token_ids": prompt_ids}, params, use_tqdm=False)
    [exact] = llm.generate({"prompt_token_ids": prompt_ids[:48]}, params, use_tqdm=False)
    assert (cold.num_cached_tokens, warm.num_cached_tokens) == (0, 48)
    # 48 tokens are 3 full blocks, but the last token is recomputed: 2 blocks hit.
    assert exact.num_cached_tokens == 32
    assert warm.outputs[0].token_ids == cold.outputs[0].token_ids
    assert_no_leaked_blocks(llm.engine_core.scheduler)


def test_logprobs_above_max_logprobs_are_refused(llm):
    ok = SamplingParams(max_tokens=1, logprobs=3, prompt_logprobs=3)
    [out] = llm.generate("Hello", ok, use_tqdm=False)
    assert len(out.outputs[0].logprobs[0]) >= 3
    for field in ("logprobs", "prompt_logprobs"):
        with pytest.raises(ValueError, match=f"{field}: .*greater than max allowed: 3"):
            llm.generate("Hello", SamplingParams(max_tokens=1, **{field: 4}), use_tqdm=False)
    assert_no_leaked_blocks(llm.engine_core.scheduler)
