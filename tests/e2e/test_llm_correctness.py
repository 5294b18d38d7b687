"""Greedy output of the real default model equals HF transformers', token for token (fp32).

Also under the configurations that change the engine's path through a request: no prefix
caching, a token budget that chunks every prompt, and a KV pool small enough to preempt.
"""

from __future__ import annotations

import pytest
import torch

from kvserve import LLM, SamplingParams
from tests.support.kv import assert_no_leaked_blocks
from tests.support.models import DEFAULT_MODEL_KV_CACHE_MEMORY
from tests.support.prompts import MAX_TOKENS, QUESTIONS, chat_prompt_ids

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def chat_prompts(default_model_dir) -> list[list[int]]:
    return chat_prompt_ids(default_model_dir)


@pytest.fixture(scope="module")
def hf_greedy(default_model_dir, chat_prompts) -> list[list[int]]:
    """HF transformers' greedy continuations, one prompt at a time (no padding)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32)
    model.eval()
    outs = []
    with torch.inference_mode():
        for ids in chat_prompts:
            x = torch.tensor([ids])
            y = model.generate(
                x,
                attention_mask=torch.ones_like(x),
                max_new_tokens=MAX_TOKENS,
                do_sample=False,
                pad_token_id=model.config.eos_token_id,
            )
            outs.append(y[0, len(ids) :].tolist())
    return outs


def _run(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def _assert_equal(ours: list[list[int]], theirs: list[list[int]]) -> None:
    for i, (a, b) in enumerate(zip(ours, theirs)):
        assert a == b, f"prompt {i} ({QUESTIONS[i]!r}) diverges:\nours {a}\nhf   {b}"


@pytest.mark.parametrize(
    "knobs",
    [
        pytest.param({}, id="default"),
        pytest.param({"enable_prefix_caching": False}, id="no-prefix-caching"),
        pytest.param({"max_num_batched_tokens": 32}, id="chunked-budget-32"),
    ],
)
def test_greedy_equals_hf(knobs, chat_prompts, hf_greedy):
    llm = LLM(dtype="float32", kv_cache_memory=DEFAULT_MODEL_KV_CACHE_MEMORY, **knobs)
    _assert_equal(_run(llm, chat_prompts), hf_greedy)
    assert_no_leaked_blocks(llm.engine_core.scheduler)


def test_greedy_equals_hf_under_preemption(chat_prompts, hf_greedy):
    # Each request needs up to ceil((prompt + 64) / 16) blocks; 24 blocks hold only a few.
    longest = max(len(p) for p in chat_prompts) + MAX_TOKENS
    num_blocks = -(-longest // 16) * 3 + 1
    llm = LLM(dtype="float32", num_gpu_blocks_override=num_blocks)
    _assert_equal(_run(llm, chat_prompts), hf_greedy)
    assert llm.engine_core.scheduler.num_preemptions_total > 0
    assert_no_leaked_blocks(llm.engine_core.scheduler)
