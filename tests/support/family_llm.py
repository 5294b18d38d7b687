"""The tiny family models (tests/support/hf_models.py) saved as folders and served through
`LLM`, shared by the family e2e modules."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kvserve import LLM, SamplingParams
from tests.support.hf_models import NUM_TOKENS, PROMPTS, make_tiny_family_model
from tests.support.kv import assert_no_leaked_blocks

MAX_MODEL_LEN = 256


def family_dirs(tmp_path_factory) -> Callable[[str], tuple[str, Any]]:
    """kind -> (its folder, the HF model saved there), each built once."""
    cache: dict[str, tuple[str, Any]] = {}

    def get(kind: str) -> tuple[str, Any]:
        if kind not in cache:
            model = make_tiny_family_model(kind, max_position_embeddings=MAX_MODEL_LEN)
            model_dir = str(tmp_path_factory.mktemp(f"e2e-{kind}"))
            model.save_pretrained(model_dir)
            cache[kind] = (model_dir, model)
        return cache[kind]

    return get


def generate_twice(model_dir: str, tokenizer: str, **parallel) -> tuple[list, list, list[int]]:
    """PROMPTS greedily twice through one LLM with the prefix cache (`parallel`: its
    tensor/pipeline sizes): both rounds' tokens and the second round's cached tokens; no KV
    block is left held."""
    llm = LLM(
        model_dir,
        tokenizer=tokenizer,
        dtype="float32",
        kv_cache_memory=32 << 20,
        max_model_len=MAX_MODEL_LEN,
        enable_prefix_caching=True,
        **parallel,
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
