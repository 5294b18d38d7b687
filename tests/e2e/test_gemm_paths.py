"""The engine with each CPU GEMM path (--cpu-gemm): the same greedy tokens and logprobs, and
the chosen plan reaches the ready message."""

from __future__ import annotations

import pytest

from kvserve import LLM, SamplingParams
from tests.support.kv import assert_no_leaked_blocks
from tests.support.models import TINY_KV_CACHE_MEMORY


def _run(model_dir: str, cpu_gemm: str):
    llm = LLM(
        model_dir, kv_cache_memory_bytes=TINY_KV_CACHE_MEMORY, cpu_gemm=cpu_gemm, dtype="float32"
    )
    params = SamplingParams(
        temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=1, prompt_logprobs=1
    )
    prompts = [{"prompt_token_ids": list(range(10, 10 + n))} for n in (3, 17, 40)]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert_no_leaked_blocks(llm.engine_core.scheduler)
    return llm.engine_core.ready.gemm_plan, outputs


def test_onednn_and_torch_paths_agree(tiny_llama_dir):
    torch_plan, torch_out = _run(tiny_llama_dir, "torch")
    onednn_plan, onednn_out = _run(tiny_llama_dir, "onednn")
    assert set(torch_plan.values()) == {"torch"} and set(onednn_plan.values()) == {"onednn"}
    assert torch_plan.keys() == onednn_plan.keys() and len(torch_plan) >= 4  # 4 linears + head
    for a, b in zip(torch_out, onednn_out):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for la, lb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            for token_id in la:
                assert la[token_id].logprob == pytest.approx(lb[token_id].logprob, abs=1e-4)
