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


class HFGreedy:
    """HF transformers' greedy decoding, checked against a continuation in one forward.

    `ours` is HF's greedy continuation exactly when every token of it is HF's argmax after
    the tokens before it, and it stops where HF's would: at its first stop token, or at
    MAX_TOKENS (by induction on the tokens, the same as running HF's generate). One forward
    over prompt + ours gives every one of those argmaxes at once, instead of MAX_TOKENS
    decode steps per prompt; a continuation already checked is not checked again.
    """

    def __init__(self, model_dir: str):
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        eos = self.model.generation_config.eos_token_id
        self.stop_ids = set(eos if isinstance(eos, list) else [eos])
        self.checked: set[tuple[int, ...]] = set()

    def assert_equal(self, prompts: list[list[int]], ours: list[list[int]]) -> None:
        for i, (prompt, tokens) in enumerate(zip(prompts, ours)):
            key = (*prompt, -1, *tokens)
            if key in self.checked:
                continue
            assert tokens, f"prompt {i} ({QUESTIONS[i]!r}): no tokens"
            with torch.inference_mode():
                logits = self.model(torch.tensor([prompt + tokens[:-1]])).logits[0]
            hf_next = logits[len(prompt) - 1 :].argmax(-1).tolist()
            for j, (a, b) in enumerate(zip(tokens, hf_next)):
                assert a == b, (
                    f"prompt {i} ({QUESTIONS[i]!r}) diverges at token {j}: ours {a}, hf {b}"
                    f"\nours {tokens}"
                )
            stops = [j for j, t in enumerate(tokens) if t in self.stop_ids]
            if stops:
                assert stops == [len(tokens) - 1], f"prompt {i}: tokens after a stop: {tokens}"
            else:
                assert len(tokens) == MAX_TOKENS, f"prompt {i}: ended early: {tokens}"
            self.checked.add(key)


@pytest.fixture(scope="module")
def hf_greedy(default_model_dir) -> HFGreedy:
    return HFGreedy(default_model_dir)


def _run(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


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
    hf_greedy.assert_equal(chat_prompts, _run(llm, chat_prompts))
    assert_no_leaked_blocks(llm.engine_core.scheduler)


def test_greedy_equals_hf_under_preemption(chat_prompts, hf_greedy):
    # Each request needs up to ceil((prompt + 64) / 16) blocks; 24 blocks hold only a few.
    longest = max(len(p) for p in chat_prompts) + MAX_TOKENS
    num_blocks = -(-longest // 16) * 3 + 1
    llm = LLM(dtype="float32", num_gpu_blocks_override=num_blocks)
    hf_greedy.assert_equal(chat_prompts, _run(llm, chat_prompts))
    assert llm.engine_core.scheduler.num_preemptions_total > 0
    assert_no_leaked_blocks(llm.engine_core.scheduler)
