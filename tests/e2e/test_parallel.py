"""Tensor and pipeline parallelism through `kvserve.LLM`: real worker processes meeting over
torch.distributed (gloo), giving the tokens of the single-process engine.

A tiny random Llama (4 layers, 4 heads, 2 KV heads, tied embeddings) covers TP = 2, PP = 2
and TP = 2 x PP = 2; the default model (9 heads, 3 KV heads) covers TP = 3 and the start-up
error of a TP size that does not divide its heads.
"""

from __future__ import annotations

import time

import pytest

from kvserve import LLM, SamplingParams
from tests.support.kv import assert_no_leaked_blocks
from tests.support.models import save_tiny_parallel_llama
from tests.support.processes import wait_gone

NUM_TOKENS = 16
# Token-id prompts: the tiny model has no tokenizer of its own (it borrows the default
# model's, whose first 128 ids are the tiny vocabulary).
TINY_PROMPTS = [[5, 17, 99, 3, 42], [7] * 11, list(range(20, 60)), [100, 101]]
CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Write a haiku about the sea."}],
    [{"role": "user", "content": "Count from 1 to 10."}],
]


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory) -> str:
    return save_tiny_parallel_llama(str(tmp_path_factory.mktemp("tiny-parallel-llama")))


def _run(model: str, tokenizer: str | None, tp: int, pp: int, run) -> object:
    """Start an LLM with TP x PP, return run(llm), check leaks, shut down, check orphans."""
    llm = LLM(
        model,
        tokenizer=tokenizer,
        dtype="float32",
        tensor_parallel_size=tp,
        pipeline_parallel_size=pp,
        kv_cache_memory=64 << 20,
        max_model_len=256,
    )
    pids = llm.engine_core.executor.worker_pids
    assert len(pids) == (tp * pp if tp * pp > 1 else 0)
    try:
        result = run(llm)
        assert_no_leaked_blocks(llm.engine_core.scheduler)
    finally:
        llm.engine_core.shutdown()
    assert not wait_gone(pids, timeout_s=10), f"worker processes {pids} outlived shutdown"
    return result


def _tiny_outputs(llm: LLM) -> dict[str, list[list[int]]]:
    prompts = [{"prompt_token_ids": ids} for ids in TINY_PROMPTS]
    greedy = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True)
    seeded = [
        SamplingParams(temperature=1.0, seed=100 + i, max_tokens=NUM_TOKENS, ignore_eos=True)
        for i in range(len(prompts))
    ]
    return {
        "greedy": [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)],
        "seeded": [o.outputs[0].token_ids for o in llm.generate(prompts, seeded, use_tqdm=False)],
    }


@pytest.fixture(scope="module")
def tiny_reference(tiny_llama, default_model_dir) -> dict[str, list[list[int]]]:
    outputs = _run(tiny_llama, default_model_dir, 1, 1, _tiny_outputs)
    assert all(len(ids) == NUM_TOKENS for ids in outputs["greedy"])
    # Distinct prompts give distinct continuations: the model is not degenerate.
    assert len({tuple(ids) for ids in outputs["greedy"]}) == len(TINY_PROMPTS)
    return outputs


@pytest.mark.parametrize("tp, pp", [(2, 1), (1, 2), (2, 2)])
def test_tiny_llama_parallel_equals_single_rank(
    tiny_llama, default_model_dir, tiny_reference, tp, pp
):
    outputs = _run(tiny_llama, default_model_dir, tp, pp, _tiny_outputs)
    assert outputs["greedy"] == tiny_reference["greedy"]
    assert outputs["seeded"] == tiny_reference["seeded"]


def test_tp_size_that_does_not_divide_the_heads_fails_at_start(default_model_dir):
    start = time.monotonic()
    with pytest.raises(
        ValueError,
        match=r"tensor_parallel_size=2 does not divide the "
        r"model's num_attention_heads=9, "
        r"num_key_value_heads=3",
    ):
        LLM(default_model_dir, tensor_parallel_size=2)
    assert time.monotonic() - start < 30


def test_pp_size_above_the_layer_count_fails_at_start(tiny_llama, default_model_dir):
    with pytest.raises(
        ValueError, match="pipeline_parallel_size=5 exceeds the model's num_hidden_layers=4"
    ):
        LLM(tiny_llama, tokenizer=default_model_dir, pipeline_parallel_size=5)


def _chat_tokens(llm: LLM) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS)
    return [o.outputs[0].token_ids for o in llm.chat(CHATS, params, use_tqdm=False)]


@pytest.mark.slow
def test_default_model_tp3_equals_tp1(default_model_dir):
    expected = _run(default_model_dir, None, 1, 1, _chat_tokens)
    assert _run(default_model_dir, None, 3, 1, _chat_tokens) == expected
