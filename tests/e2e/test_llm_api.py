"""The offline `LLM` API with the real default model: caching, sampling, logprobs, errors."""

from __future__ import annotations

import math

import pytest
import torch

from kvserve import LLM, SamplingParams
from tests.support.kv import assert_no_leaked_blocks
from tests.support.models import DEFAULT_MODEL_KV_CACHE_MEMORY

pytestmark = pytest.mark.slow

GREEDY = SamplingParams(temperature=0.0, max_tokens=16)


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(dtype="float32", seed=0, kv_cache_memory=DEFAULT_MODEL_KV_CACHE_MEMORY)


@pytest.fixture(autouse=True)
def no_leaks(llm):
    yield
    assert_no_leaked_blocks(llm.engine_core.scheduler)


@pytest.fixture(scope="module")
def hello_greedy(llm):
    """The greedy completion of "Hello": what a healthy engine answers, before any bad input."""
    [out] = llm.generate("Hello", GREEDY, use_tqdm=False)
    return out.outputs[0]


def assert_still_serving(llm: LLM, reference) -> None:
    """The engine answers "Hello" exactly as it did before (greedy is deterministic)."""
    [ok] = llm.generate("Hello", GREEDY, use_tqdm=False)
    assert ok.outputs[0].token_ids == reference.token_ids
    assert ok.outputs[0].finish_reason == reference.finish_reason


def _long_prefix(llm: LLM, num_tokens: int) -> list[int]:
    text = " ".join(
        f"Paragraph {i} talks about rivers, mountains and old cities." for i in range(60)
    )
    ids = llm.get_tokenizer().encode(text)
    assert len(ids) >= num_tokens
    return ids[:num_tokens]


def test_prefix_cache_hit_reports_cached_tokens_and_same_output(llm):
    prefix = _long_prefix(llm, 200)
    first = prefix + llm.get_tokenizer().encode(" First question: why?")
    second = prefix + llm.get_tokenizer().encode(" Second question: how?")
    llm.reset_prefix_cache()
    [cold] = llm.generate({"prompt_token_ids": second}, GREEDY, use_tqdm=False)
    assert cold.num_cached_tokens == 0
    llm.reset_prefix_cache()
    llm.generate({"prompt_token_ids": first}, GREEDY, use_tqdm=False)
    [warm] = llm.generate({"prompt_token_ids": second}, GREEDY, use_tqdm=False)
    assert warm.num_cached_tokens >= 192
    assert warm.outputs[0].token_ids == cold.outputs[0].token_ids


def test_seeded_sampling_is_batch_independent(llm):
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=24)
    other = SamplingParams(temperature=1.2, max_tokens=24)
    prompt = "Tell me a story about a dragon."
    [alone] = llm.generate(prompt, seeded, use_tqdm=False)
    prompts = [f"Random prompt number {i}." for i in range(7)] + [prompt]
    batch = llm.generate(prompts, [other] * 7 + [seeded], use_tqdm=False)
    assert batch[-1].outputs[0].token_ids == alone.outputs[0].token_ids
    [again] = llm.generate(prompt, seeded, use_tqdm=False)
    assert again.outputs[0].token_ids == alone.outputs[0].token_ids


def test_top_k_one_equals_greedy(llm):
    prompts = ["The quick brown fox", "In the beginning"]
    greedy = llm.generate(prompts, GREEDY, use_tqdm=False)
    top1 = llm.generate(
        prompts, SamplingParams(temperature=0.8, top_k=1, max_tokens=16), use_tqdm=False
    )
    assert [o.outputs[0].token_ids for o in greedy] == [o.outputs[0].token_ids for o in top1]


def test_logprobs_equal_log_softmax_of_our_logits(llm):
    from kvserve.services.worker.layers.attention import AttentionMetadata

    prompt_ids = llm.get_tokenizer().encode("The capital of France is")
    [out] = llm.generate(
        {"prompt_token_ids": prompt_ids},
        SamplingParams(temperature=0.0, max_tokens=1, logprobs=5),
        use_tqdm=False,
    )
    first = out.outputs[0].token_ids[0]
    entry = out.outputs[0].logprobs[0]

    # Our own model, run directly on the prompt (no paged cache: the prompt-only path of the
    # modules; the native decode stack, which reads the bound cache, is set aside meanwhile).
    model = llm.engine_core.executor.worker.runner.model
    stack, model.model.decode_stack = model.model.decode_stack, None
    n = len(prompt_ids)
    md = AttentionMetadata(
        torch.tensor([0, n], dtype=torch.int32),
        torch.tensor([n], dtype=torch.int32),
        torch.zeros(1, 1, dtype=torch.int32),
        torch.full((n,), -1, dtype=torch.int64),
        n,
        n,
    )
    saved = [layer.kv_cache for layer in llm.engine_core.executor.worker.runner.attention_layers]
    try:
        for layer in llm.engine_core.executor.worker.runner.attention_layers:
            layer.kv_cache = None
        with torch.inference_mode():
            hidden = model(torch.tensor(prompt_ids), torch.arange(n), md)
            expected = torch.log_softmax(model.compute_logits(hidden[-1:]), dim=-1)[0]
    finally:
        for layer, cache in zip(llm.engine_core.executor.worker.runner.attention_layers, saved):
            layer.kv_cache = cache
        model.model.decode_stack = stack
    assert first == int(expected.argmax())
    assert entry[first].rank == 1
    assert math.isclose(entry[first].logprob, float(expected[first]), abs_tol=1e-4)
    assert len(entry) == 5  # the sampled token is also the top-1
    top5 = expected.topk(5).indices.tolist()
    assert set(entry) == set(top5)
    assert out.outputs[0].cumulative_logprob == pytest.approx(entry[first].logprob)


def test_n_completions_share_the_prompt_blocks(llm):
    prompt_ids = _long_prefix(llm, 96)
    llm.reset_prefix_cache()
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=8)
    [out] = llm.generate({"prompt_token_ids": prompt_ids}, params, use_tqdm=False)
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert all(len(c.token_ids) == 8 for c in out.outputs)
    # Different seeds per completion: not all the same.
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    # Children 2 and 3 reuse the 5 full blocks (80 tokens) that child 1 computes.
    assert out.num_cached_tokens >= 80


def test_prompt_logprobs_cover_every_prompt_token(llm):
    prompt_ids = llm.get_tokenizer().encode("One two three four five six")
    [out] = llm.generate(
        {"prompt_token_ids": prompt_ids},
        SamplingParams(max_tokens=2, prompt_logprobs=2, temperature=0.0),
        use_tqdm=False,
    )
    assert out.prompt_logprobs[0] is None
    assert len(out.prompt_logprobs) == len(prompt_ids)
    for pos, entry in enumerate(out.prompt_logprobs[1:], start=1):
        assert prompt_ids[pos] in entry
        assert all(lp.logprob <= 0.0 for lp in entry.values())


def test_stop_string_min_tokens_and_stop_token_ids(llm):
    [greedy] = llm.generate(
        "Count: 1, 2, 3,", SamplingParams(temperature=0.0, max_tokens=20), use_tqdm=False
    )
    text = greedy.outputs[0].text
    assert len(text) > 6
    stop = text[3:6]
    [stopped] = llm.generate(
        "Count: 1, 2, 3,",
        SamplingParams(temperature=0.0, max_tokens=20, stop=[stop]),
        use_tqdm=False,
    )
    assert stopped.outputs[0].text == text[: text.index(stop)]
    assert stopped.outputs[0].finish_reason == "stop"
    assert stopped.outputs[0].stop_reason == stop

    second_token = greedy.outputs[0].token_ids[1]
    [by_id] = llm.generate(
        "Count: 1, 2, 3,",
        SamplingParams(temperature=0.0, max_tokens=20, stop_token_ids=[second_token]),
        use_tqdm=False,
    )
    assert by_id.outputs[0].token_ids == greedy.outputs[0].token_ids[:2]
    assert by_id.outputs[0].stop_reason == second_token

    [chat] = llm.chat(
        [{"role": "user", "content": "Say hi."}],
        SamplingParams(temperature=0.0, max_tokens=40),
        use_tqdm=False,
    )
    eos = llm.get_tokenizer().eos_token_id
    assert chat.outputs[0].finish_reason == "stop" and chat.outputs[0].token_ids[-1] == eos
    n = len(chat.outputs[0].token_ids)
    [longer] = llm.chat(
        [{"role": "user", "content": "Say hi."}],
        SamplingParams(temperature=0.0, max_tokens=n + 5, min_tokens=n + 5),
        use_tqdm=False,
    )
    assert len(longer.outputs[0].token_ids) == n + 5
    assert eos not in longer.outputs[0].token_ids[:-1]


@pytest.mark.parametrize(
    "prompt, kwargs, field",
    [
        ("", {}, "prompt"),
        ("hello", {"max_tokens": 0}, "max_tokens"),
        ("hello", {"max_tokens": -3}, "max_tokens"),
        ("hello", {"temperature": -1.0}, "temperature"),
        ("hello", {"top_p": 0.0}, "top_p"),
        ("hello", {"bogus_knob": 1}, "bogus_knob"),
    ],
)
def test_bad_input_is_a_value_error_naming_the_field(llm, hello_greedy, prompt, kwargs, field):
    with pytest.raises(ValueError, match=field):
        llm.generate(prompt, SamplingParams(**kwargs), use_tqdm=False)
    assert_still_serving(llm, hello_greedy)


def test_prompt_longer_than_max_model_len_is_rejected(llm, hello_greedy):
    too_long = [42] * (llm.max_model_len + 1)
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate({"prompt_token_ids": too_long}, GREEDY, use_tqdm=False)
    assert_still_serving(llm, hello_greedy)


def test_unknown_engine_argument_is_a_value_error():
    with pytest.raises(ValueError, match="max_num_sequences"):
        LLM(max_num_sequences=4)


def test_priority_policy_serves_all(llm):
    pri = LLM(
        dtype="float32",
        scheduling_policy="priority",
        max_num_seqs=2,
        kv_cache_memory=DEFAULT_MODEL_KV_CACHE_MEMORY,
    )
    outs = pri.generate(["a", "b", "c", "d"], GREEDY, use_tqdm=False, priority=[3, 2, 1, 0])
    assert all(o.finished for o in outs)
    assert_no_leaked_blocks(pri.engine_core.scheduler)
