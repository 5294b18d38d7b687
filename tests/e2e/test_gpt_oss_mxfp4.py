"""gpt-oss with MXFP4 experts through the offline engine (`kvserve.LLM`): the checkpoint's
quantization_config picks the held path, prefix caching serves a second round, and the
greedy tokens equal HF's over the dequantized experts (float32 activations in the kernel);
with the default int8 activations, teacher-forced agreement with `quantization="none"`."""

from __future__ import annotations

import numpy as np
import pytest

from kvserve import LLM, SamplingParams
from tests.support.hf_models import NUM_TOKENS, PROMPTS, hf_greedy
from tests.support.kv import assert_no_leaked_blocks
from tests.support.mxfp4 import make_mxfp4_gpt_oss


@pytest.fixture(scope="module")
def mxfp4_dir(tmp_path_factory):
    model_dir = str(tmp_path_factory.mktemp("e2e-gpt-oss-mxfp4"))
    return model_dir, make_mxfp4_gpt_oss(model_dir, max_position_embeddings=256)


def _llm(model_dir: str, tokenizer: str, **kwargs) -> LLM:
    return LLM(model_dir, tokenizer=tokenizer, dtype="float32", kv_cache_memory=32 << 20,
               max_model_len=256, enable_prefix_caching=True, **kwargs)  # fmt: skip


def test_llm_holds_mxfp4_and_greedy_equals_hf(mxfp4_dir, default_model_dir, monkeypatch):
    monkeypatch.setenv("KVSERVE_QUANT_ACTIVATIONS", "float32")
    model_dir, hf_model = mxfp4_dir
    llm = _llm(model_dir, default_model_dir)
    params = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True)
    prompts = [{"prompt_token_ids": ids} for ids in PROMPTS]
    try:
        model = llm.engine_core.executor.worker.runner.model
        assert model.model.layers[0].mlp.experts.quantized
        first = llm.generate(prompts, params, use_tqdm=False)
        second = llm.generate(prompts, params, use_tqdm=False)
        assert_no_leaked_blocks(llm.engine_core.scheduler)
    finally:
        llm.engine_core.shutdown()
    expected = [hf_greedy(hf_model, prompt) for prompt in PROMPTS]
    assert [o.outputs[0].token_ids for o in first] == expected
    assert [o.outputs[0].token_ids for o in second] == expected
    assert all(o.num_cached_tokens >= 16 for o in second)


def _teacher_forced(llm: LLM, sequences: list[list[int]], starts: list[int]):
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
    outs = llm.generate([{"prompt_token_ids": s} for s in sequences], params, use_tqdm=False)
    lps, ranks = [], []
    for out, seq, start in zip(outs, sequences, starts):
        for entry, tid in zip(out.prompt_logprobs[start:], seq[start:]):
            lps.append(entry[tid].logprob)
            ranks.append(entry[tid].rank)
    llm.engine_core.shutdown()
    return np.array(lps), np.array(ranks)


def test_llm_int8_activations_agree_with_quantization_none(mxfp4_dir, default_model_dir):
    # The expansion's greedy continuations, scored teacher-forced by both paths.
    model_dir, hf_model = mxfp4_dir
    sequences = [prompt + hf_greedy(hf_model, prompt) for prompt in PROMPTS]
    starts = [len(p) for p in PROMPTS]
    ref_lps, ref_ranks = _teacher_forced(
        _llm(model_dir, default_model_dir, quantization="none"), sequences, starts
    )
    lps, ranks = _teacher_forced(_llm(model_dir, default_model_dir), sequences, starts)
    assert np.mean(ref_ranks == 1) == 1.0  # the tokens are the expansion's greedy picks
    # as tests/unit/worker/test_gpt_oss_mxfp4.py measures per position
    assert np.mean(ranks == ref_ranks) >= 0.9, np.mean(ranks == ref_ranks)
    assert np.mean(np.abs(lps - ref_lps)) <= 0.05, np.mean(np.abs(lps - ref_lps))
