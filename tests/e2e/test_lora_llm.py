"""Offline LLM with LoRA adapters against PEFT's merged models (float32, tiny random Llama).

Adapters are random PEFT adapters (tests/support/lora.py): `full` targets all seven linears
at rank 8, `narrow` only q/v/down at rank 4 with rsLoRA scaling, so the fused layers see
slices with and without an adapter and ranks below the slot's padding.
"""

from __future__ import annotations

import pytest
import torch

from kvserve import LLM, LoRARequest, SamplingParams
from tests.support.kv import assert_no_leaked_blocks
from tests.support.lora import hf_greedy, hf_logprobs, make_peft_adapter, merged_model
from tests.support.models import TINY_KV_CACHE_MEMORY, build_tiny_llama

MAX_TOKENS = 12
PROMPTS = [list(b"hello world"), list(b"the quick brown fox jumps"), list(b"abc")]
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return build_tiny_llama(str(tmp_path_factory.mktemp("lora_model")))


@pytest.fixture(scope="module")
def adapters(model_dir, tmp_path_factory) -> dict[str, LoRARequest]:
    root = tmp_path_factory.mktemp("adapters")
    full = make_peft_adapter(model_dir, str(root / "full"), seed=1, rank=8, alpha=16)
    narrow = make_peft_adapter(
        model_dir,
        str(root / "narrow"),
        seed=2,
        rank=4,
        alpha=8,
        targets=["q_proj", "v_proj", "down_proj"],
        use_rslora=True,
    )
    return {"full": LoRARequest("full", 1, full), "narrow": LoRARequest("narrow", 2, narrow)}


@pytest.fixture(scope="module")
def references(model_dir, adapters) -> dict[str | None, list[list[int]]]:
    """PEFT merged model's greedy tokens per adapter name (None: the base model)."""
    out = {}
    for name in (None, *adapters):
        model = merged_model(model_dir, adapters[name].lora_path if name else None)
        out[name] = [hf_greedy(model, prompt, MAX_TOKENS) for prompt in PROMPTS]
    return out


def make_llm(model_dir: str, **kwargs) -> LLM:
    return LLM(
        model_dir,
        dtype="float32",
        kv_cache_memory=TINY_KV_CACHE_MEMORY,
        enable_lora=True,
        max_lora_rank=8,
        **kwargs,
    )


@pytest.fixture(scope="module")
def llm(model_dir) -> LLM:
    return make_llm(model_dir, max_loras=2)


def test_adapters_change_the_output(references):
    # Otherwise every comparison below would pass with LoRA ignored.
    assert references["full"] != references[None]
    assert references["narrow"] != references[None]
    assert references["full"] != references["narrow"]


@pytest.mark.parametrize("name", ["full", "narrow", None])
def test_greedy_matches_peft_merged(llm, adapters, references, name):
    lora = adapters[name] if name else None
    outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False, lora_request=lora)
    assert [o.outputs[0].token_ids for o in outputs] == references[name]
    assert_no_leaked_blocks(llm.engine_core.scheduler)


@pytest.mark.parametrize("name", ["full", "narrow"])
def test_prompt_logprobs_match_peft_merged(llm, model_dir, adapters, name):
    prompt = PROMPTS[1]
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
    (output,) = llm.generate([prompt], params, use_tqdm=False, lora_request=adapters[name])
    expected = hf_logprobs(merged_model(model_dir, adapters[name].lora_path), prompt)
    got = [row[token].logprob for row, token in zip(output.prompt_logprobs[1:], prompt[1:])]
    want = [float(expected[i, token]) for i, token in enumerate(prompt[1:])]
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), atol=1e-4, rtol=1e-4)


def test_mixed_batch_gives_each_request_its_adapter(llm, adapters, references):
    # Three requests per kind, interleaved: a slot's tokens are not contiguous (index path)
    # and, in the last three, contiguous (slice path).
    names = ["full", "narrow", None, "narrow", None, "full", None, "narrow", "narrow"]
    prompt_ids = [0, 1, 2, 0, 1, 2, 0, 1, 2]
    loras = [adapters[n] if n else None for n in names]
    outputs = llm.generate(
        [PROMPTS[i] for i in prompt_ids], GREEDY, use_tqdm=False, lora_request=loras
    )
    for output, name, i in zip(outputs, names, prompt_ids):
        assert output.outputs[0].token_ids == references[name][i], (name, i)
    assert_no_leaked_blocks(llm.engine_core.scheduler)


def test_more_adapters_than_slots_wait_their_turn(model_dir, adapters, references):
    # max_loras=1: the two adapters never share a batch, yet every request gets its own.
    llm = make_llm(model_dir, max_loras=1, max_cpu_loras=1)
    scheduler = llm.engine_core.scheduler
    distinct_per_step = []
    schedule = scheduler.schedule

    def recording_schedule():
        out = schedule()
        distinct_per_step.append(
            {r.lora_request.lora_name for r in scheduler.running if r.lora_request}
        )
        return out

    scheduler.schedule = recording_schedule
    names = ["full", "narrow", "full", "narrow", None]
    loras = [adapters[n] if n else None for n in names]
    outputs = llm.generate([PROMPTS[0]] * 5, GREEDY, use_tqdm=False, lora_request=loras)
    for output, name in zip(outputs, names):
        assert output.outputs[0].token_ids == references[name][0], name
    assert max(len(s) for s in distinct_per_step) == 1
    assert {"full"} in distinct_per_step and {"narrow"} in distinct_per_step
    assert_no_leaked_blocks(scheduler)


def test_prefix_cache_never_mixes_adapters(llm, adapters):
    # Four full blocks of 16 tokens: a hit would serve 48 or more of them.
    prompt = list(range(1, 70))
    params = SamplingParams(temperature=0.0, max_tokens=2)
    llm.reset_prefix_cache()

    def cached(lora):
        (output,) = llm.generate([prompt], params, use_tqdm=False, lora_request=lora)
        return output.num_cached_tokens

    assert cached(adapters["full"]) == 0
    assert cached(adapters["narrow"]) == 0  # same prompt, other adapter: no hit
    assert cached(None) == 0  # nor for the base model
    assert cached(adapters["full"]) >= 48  # the same adapter hits
    assert cached(adapters["narrow"]) >= 48
    assert cached(None) >= 48
    assert_no_leaked_blocks(llm.engine_core.scheduler)


def test_bad_adapters_are_refused(llm, adapters, tmp_path, model_dir):
    with pytest.raises(ValueError, match="adapter_config.json not found"):
        llm.generate([PROMPTS[0]], GREEDY, lora_request=LoRARequest("x", 9, str(tmp_path)))
    big = make_peft_adapter(model_dir, str(tmp_path / "big"), seed=3, rank=16)
    with pytest.raises(ValueError, match="more than --max-lora-rank 8"):
        llm.generate([PROMPTS[0]], GREEDY, lora_request=LoRARequest("big", 9, big))
    no_lora = LLM(model_dir, dtype="float32", kv_cache_memory=TINY_KV_CACHE_MEMORY)
    with pytest.raises(ValueError, match="enable_lora=True"):
        no_lora.generate([PROMPTS[0]], GREEDY, lora_request=adapters["full"])
    assert_no_leaked_blocks(llm.engine_core.scheduler)


@pytest.fixture(scope="module")
def parallel_setup(tmp_path_factory):
    """A tiny HF Llama whose vocabulary splits over two ranks (the numpy one's 257 does not),
    two adapters for it, and PEFT's greedy tokens per adapter."""
    from tests.support.models import make_tiny_hf_model

    root = tmp_path_factory.mktemp("lora_parallel")
    model_dir = str(root / "model")
    model = make_tiny_hf_model("llama", vocab_size=128, intermediate_size=128)
    model.save_pretrained(model_dir, safe_serialization=True)
    adapters = {
        "full": LoRARequest("full", 1, make_peft_adapter(model_dir, str(root / "f"), seed=4)),
        "narrow": LoRARequest(
            "narrow",
            2,
            make_peft_adapter(
                model_dir, str(root / "n"), seed=5, rank=4, targets=["k_proj", "o_proj", "up_proj"]
            ),
        ),
    }
    references = {}
    for name in (None, *adapters):
        merged = merged_model(model_dir, adapters[name].lora_path if name else None)
        references[name] = [hf_greedy(merged, prompt, MAX_TOKENS) for prompt in PROMPTS]
    return model_dir, adapters, references


@pytest.mark.parametrize("tp, pp", [(2, 1), (1, 2)])
def test_mixed_batch_under_tensor_and_pipeline_parallelism(
    parallel_setup, default_model_dir, tp, pp
):
    # TP: column-parallel layers slice B by output, row-parallel ones A by input (their
    # shrink all-reduced); PP: each stage loads its own layers' part of an adapter.
    from tests.support.processes import wait_gone

    model_dir, adapters, references = parallel_setup
    assert references["full"] != references[None] != references["narrow"]
    llm = make_llm(
        model_dir,
        tokenizer=default_model_dir,  # ids below 128 only: the tiny model has no tokenizer
        max_loras=2,
        tensor_parallel_size=tp,
        pipeline_parallel_size=pp,
    )
    pids = llm.engine_core.executor.worker_pids
    try:
        names = ["full", None, "narrow", "narrow", "full", None]
        loras = [adapters[n] if n else None for n in names]
        prompt_ids = [0, 1, 2, 1, 2, 0]
        outputs = llm.generate(
            [{"prompt_token_ids": PROMPTS[i]} for i in prompt_ids],
            GREEDY,
            use_tqdm=False,
            lora_request=loras,
        )
        for output, name, i in zip(outputs, names, prompt_ids):
            assert output.outputs[0].token_ids == references[name][i], (name, i)
        assert_no_leaked_blocks(llm.engine_core.scheduler)
    finally:
        llm.engine_core.shutdown()
    assert not wait_gone(pids, timeout_s=10)
