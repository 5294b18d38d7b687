"""New model families through the whole offline engine (`kvserve.LLM`): scheduler, paged KV
cache with prefix caching, the model runner, TP = 2 worker processes; greedy tokens equal HF
transformers' (full forward each step, float32).

The prompts share a 40-token prefix, far longer than the 6-token sliding windows and Llama 4's
6-token attention chunks, so the second round is served from the prefix cache and its chunks
start mid-sequence.
"""

from __future__ import annotations

import pytest

from kvserve import LLM, SamplingParams
from tests.support.hf_models import NUM_TOKENS, PROMPTS, hf_greedy, make_tiny_family_model
from tests.support.kv import assert_no_leaked_blocks


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory):
    cache = {}

    def get(kind: str):
        if kind not in cache:
            model = make_tiny_family_model(kind, max_position_embeddings=256)
            model_dir = str(tmp_path_factory.mktemp(f"e2e-{kind}"))
            model.save_pretrained(model_dir)
            cache[kind] = (model_dir, model)
        return cache[kind]

    return get


def _generate_twice(model_dir: str, tokenizer: str, tp: int) -> tuple[list, list, list[int]]:
    llm = LLM(
        model_dir,
        tokenizer=tokenizer,
        dtype="float32",
        tensor_parallel_size=tp,
        kv_cache_memory=32 << 20,
        max_model_len=256,
        enable_prefix_caching=True,
    )
    params = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True)
    prompts = [{"prompt_token_ids": ids} for ids in PROMPTS]
    try:
        first = llm.generate(prompts, params, use_tqdm=False)
        second = llm.generate(prompts, params, use_tqdm=False)
        assert_no_leaked_blocks(llm.engine_core.scheduler)
    finally:
        llm.engine_core.shutdown()
    return (
        [o.outputs[0].token_ids for o in first],
        [o.outputs[0].token_ids for o in second],
        [o.num_cached_tokens for o in second],
    )


@pytest.mark.parametrize(
    "kind",
    [
        "mistral",
        "gemma2",
        "gemma3",
        "qwen3",
        "phi3",
        "mixtral",
        "llama4",
        "deepseek_v2",
        "deepseek_v3",
        "gpt_oss",
    ],
)
def test_llm_greedy_equals_hf_with_prefix_cache(family_dirs, default_model_dir, kind):
    model_dir, hf_model = family_dirs(kind)
    first, second, cached = _generate_twice(model_dir, default_model_dir, tp=1)
    assert first == [hf_greedy(hf_model, prompt) for prompt in PROMPTS]
    assert second == first
    assert all(n >= 16 for n in cached), cached  # the second round hit the prefix cache


# Llama 4's and gpt-oss's TP=2 is compared with HF in the unit tests (test_llama4.py,
# test_model_families.py); here the families whose split differs most run through LLM.
@pytest.mark.parametrize("kind", ["gemma2", "mixtral", "deepseek_v3"])
def test_llm_tensor_parallel_2_equals_hf(family_dirs, default_model_dir, kind):
    model_dir, hf_model = family_dirs(kind)
    first, second, _ = _generate_twice(model_dir, default_model_dir, tp=2)
    assert first == [hf_greedy(hf_model, prompt) for prompt in PROMPTS]
    assert second == first
