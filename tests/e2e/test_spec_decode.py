"""Speculative decoding through the whole engine on the real default model (float32): greedy
output equals greedy without speculation, token for token, with each method, over prompts
whose drafts are both accepted and rejected; and under chunked prefill, preemption, n > 1,
logprobs, seeds and TP = 2. Every run ends with zero leaked KV blocks."""

from __future__ import annotations

import pytest

from kvserve import LLM, SamplingParams
from tests.support.kv import assert_no_leaked_blocks
from tests.support.models import DEFAULT_MODEL_KV_CACHE_MEMORY
from tests.support.prompts import chat_prompt_ids

pytestmark = pytest.mark.slow

MAX_TOKENS = 40
# Chat questions (drafts mostly rejected) and rewriting tasks (text repeats: drafts accepted).
QUESTIONS = [
    "What is the capital of France?",
    "Write a Python function that returns the square of a number.",
    "Repeat this sentence exactly, twice: The quick brown fox jumps over the lazy dog.",
    "Rewrite this sentence with 'cat' replaced by 'dog': The cat sat on the mat, and the cat "
    "looked at the hat while the cat purred.",
    "List the days of the week, one per line.",
]

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2,
         "prompt_lookup_max": 4}  # fmt: skip
SELF_DRAFT = {"method": "draft_model", "num_speculative_tokens": 3, "num_draft_layers": 10}


@pytest.fixture(scope="module")
def prompts(default_model_dir) -> list[list[int]]:
    return chat_prompt_ids(default_model_dir, QUESTIONS)


@pytest.fixture(scope="module")
def greedy_reference(prompts) -> list[list[int]]:
    llm = LLM(dtype="float32", kv_cache_memory=DEFAULT_MODEL_KV_CACHE_MEMORY)
    return _greedy(llm, prompts)


def _greedy(llm: LLM, prompts, max_tokens: int = MAX_TOKENS) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def _assert_equal(ours, reference) -> None:
    for i, (a, b) in enumerate(zip(ours, reference)):
        assert a == b, f"prompt {i} ({QUESTIONS[i]!r}) diverges:\nspec {a}\nref  {b}"


def _assert_accepted_and_rejected(llm: LLM) -> None:
    totals = llm.stats_totals
    assert totals.spec_num_drafts > 0, "no drafts were verified"
    assert 0 < totals.spec_num_accepted_tokens < totals.spec_num_draft_tokens, (
        f"{totals.spec_num_accepted_tokens} of {totals.spec_num_draft_tokens} drafts accepted"
    )


def _fixed(spec: dict) -> dict:
    """The config with adaptive length off: every step drafts, so rejections happen."""
    return {**spec, "adaptive": False}


@pytest.mark.parametrize(
    "spec, one_at_a_time",
    [
        pytest.param(_fixed(NGRAM), False, id="ngram"),
        # The adaptive rule drafts where a draft pays for its share of the step. At batch 1 it
        # pays while the draft's acceptance beats the verify step's extra time (about 10-30%
        # on a CPU), so drafts are taken, accepted and rejected on any machine. In a batch of
        # five the first draft must beat a ~12% step: whether it does depends on the
        # machine's thread count and load, and the rule may rightly keep to sure drafts.
        pytest.param(NGRAM, True, id="ngram-adaptive"),
        pytest.param(_fixed(SELF_DRAFT), False, id="self-draft"),
    ],
)
def test_greedy_equals_greedy_without_speculation(spec, one_at_a_time, prompts, greedy_reference):
    llm = LLM(
        dtype="float32", kv_cache_memory=DEFAULT_MODEL_KV_CACHE_MEMORY, speculative_config=spec
    )
    if one_at_a_time:
        ours = [_greedy(llm, [prompt])[0] for prompt in prompts]
    else:
        ours = _greedy(llm, prompts)
    _assert_equal(ours, greedy_reference)
    _assert_accepted_and_rejected(llm)
    assert_no_leaked_blocks(llm.engine_core.scheduler)


def test_a_separate_draft_model_with_its_own_kv_cache(default_model_dir, prompts, greedy_reference):
    # The default model loaded again as the draft, truncated: its own weights and KV cache,
    # caught up on every step (prefix-cache hits included: the prompts share the template).
    spec = {"method": "draft_model", "num_speculative_tokens": 3, "model": default_model_dir,
            "num_draft_layers": 6, "adaptive": False}  # fmt: skip
    llm = LLM(
        dtype="float32", kv_cache_memory=DEFAULT_MODEL_KV_CACHE_MEMORY, speculative_config=spec
    )
    assert llm.engine_core.executor.worker.runner.proposer.draft.owns_cache
    _assert_equal(_greedy(llm, prompts), greedy_reference)
    _assert_equal(_greedy(llm, prompts), greedy_reference)  # a second round from the cache
    _assert_accepted_and_rejected(llm)
    assert_no_leaked_blocks(llm.engine_core.scheduler)


def test_chunked_prefill_and_preemption(prompts, greedy_reference):
    longest = max(len(p) for p in prompts) + MAX_TOKENS + 8
    num_blocks = -(-longest // 16) + 4  # one request always fits, two do not
    for spec in (_fixed(NGRAM), _fixed(SELF_DRAFT)):
        llm = LLM(
            dtype="float32",
            speculative_config=spec,
            max_num_batched_tokens=32,
            num_gpu_blocks_override=num_blocks,
        )
        _assert_equal(_greedy(llm, prompts), greedy_reference)
        assert llm.engine_core.scheduler.num_preemptions_total > 0
        _assert_accepted_and_rejected(llm)
        assert_no_leaked_blocks(llm.engine_core.scheduler)


def test_logprobs_n_and_max_tokens(prompts):
    params = SamplingParams(temperature=0.0, max_tokens=17, logprobs=2, n=2)
    inputs = [{"prompt_token_ids": p} for p in prompts[2:]]
    plain = LLM(dtype="float32", kv_cache_memory=DEFAULT_MODEL_KV_CACHE_MEMORY)
    want = plain.generate(inputs, params, use_tqdm=False)
    del plain
    spec = LLM(
        dtype="float32",
        kv_cache_memory=DEFAULT_MODEL_KV_CACHE_MEMORY,
        speculative_config=_fixed(NGRAM),
    )
    got = spec.generate(inputs, params, use_tqdm=False)
    assert any(len(o.outputs[0].token_ids) == 17 for o in got)  # max_tokens ended some
    for w, g in zip(want, got):
        assert len(g.outputs) == 2
        for wc, gc in zip(w.outputs, g.outputs):
            assert gc.token_ids == wc.token_ids
            assert len(gc.logprobs) == len(gc.token_ids)
            for wl, gl in zip(wc.logprobs, gc.logprobs):
                assert list(gl) == list(wl)  # the same top tokens at every position
                for token_id in wl:
                    assert gl[token_id].logprob == pytest.approx(wl[token_id].logprob, abs=1e-3)
                    assert gl[token_id].rank == wl[token_id].rank
    _assert_accepted_and_rejected(spec)
    assert_no_leaked_blocks(spec.engine_core.scheduler)


def test_structured_outputs_beside_speculating_requests(prompts, greedy_reference):
    import json

    from kvserve.shared.structured_outputs import StructuredOutputsParams

    llm = LLM(
        dtype="float32",
        kv_cache_memory=DEFAULT_MODEL_KV_CACHE_MEMORY,
        speculative_config=_fixed(NGRAM),
    )
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    constrained = SamplingParams(
        temperature=0.0,
        max_tokens=MAX_TOKENS,
        structured_outputs=StructuredOutputsParams(json=schema),
    )
    plain = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    inputs = [{"prompt_token_ids": p} for p in prompts]
    outs = llm.generate(inputs + inputs[:1], [plain] * len(inputs) + [constrained], use_tqdm=False)
    _assert_equal([o.outputs[0].token_ids for o in outs[:-1]], greedy_reference)
    assert set(json.loads(outs[-1].outputs[0].text)) == {"n"}
    _assert_accepted_and_rejected(llm)
    assert_no_leaked_blocks(llm.engine_core.scheduler)


def test_aborts_mid_speculation_free_every_block(prompts):
    llm = LLM(
        dtype="float32",
        kv_cache_memory=DEFAULT_MODEL_KV_CACHE_MEMORY,
        speculative_config=_fixed(SELF_DRAFT),
    )
    core = llm.engine_core
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    for i, ids in enumerate(prompts):
        llm._add_request(f"abort-{i}", None, ids, params, 0)
    num_drafts = 0
    for _ in range(4):  # prefill, then steps that verify drafts and hold lookahead slots
        num_drafts += core.step().scheduler_stats.spec_num_drafts
    assert num_drafts > 0
    manager = core.scheduler.kv_cache_manager
    assert manager.num_free_blocks < manager.num_total_blocks
    core.abort_requests(list(core.scheduler.requests))
    core.step()
    assert_no_leaked_blocks(core.scheduler)


def test_seeded_random_sampling_is_reproducible(prompts):
    llm = LLM(
        dtype="float32",
        kv_cache_memory=DEFAULT_MODEL_KV_CACHE_MEMORY,
        speculative_config=_fixed(NGRAM),
    )
    seeds = (1, 1, 2, 3, 4)
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=32) for s in seeds]
    outs = llm.generate([{"prompt_token_ids": prompts[3]}] * len(seeds), params, use_tqdm=False)
    first, again, *others = (o.outputs[0].token_ids for o in outs)
    assert first == again
    assert any(other != first for other in others)  # the seed matters
    alone = llm.generate([{"prompt_token_ids": prompts[3]}], params[0], use_tqdm=False)
    assert alone[0].outputs[0].token_ids == first  # whatever else is in the batch
    assert llm.stats_totals.spec_num_accepted_tokens > 0
    assert_no_leaked_blocks(llm.engine_core.scheduler)


def test_tensor_and_pipeline_parallel(tiny_llama_for_tp, default_model_dir):
    # The default model's 9 heads do not split over 2 ranks: a tiny random Llama does
    # (its greedy text loops, so n-gram drafts are accepted too).
    inputs = [{"prompt_token_ids": p} for p in ([5, 17, 99, 3, 42], [7] * 11, [20, 21, 22])]
    params = SamplingParams(temperature=0.0, max_tokens=24)
    tiny = {"tokenizer": default_model_dir, "dtype": "float32", "max_model_len": 256,
            "kv_cache_memory": 64 << 20}  # fmt: skip
    reference = [o.outputs[0].token_ids for o in LLM(tiny_llama_for_tp, **tiny).generate(
        inputs, params, use_tqdm=False)]  # fmt: skip
    runs = [
        (_fixed(NGRAM), {"tensor_parallel_size": 2}),
        ({**_fixed(SELF_DRAFT), "num_draft_layers": 2}, {"tensor_parallel_size": 2}),
        (_fixed(NGRAM), {"pipeline_parallel_size": 2}),
    ]
    for spec, parallel in runs:
        llm = LLM(tiny_llama_for_tp, speculative_config=spec, **parallel, **tiny)
        try:
            outs = llm.generate(inputs, params, use_tqdm=False)
            assert [o.outputs[0].token_ids for o in outs] == reference
            assert llm.stats_totals.spec_num_accepted_tokens > 0
            assert_no_leaked_blocks(llm.engine_core.scheduler)
        finally:
            llm.engine_core.shutdown()


@pytest.fixture(scope="module")
def tiny_llama_for_tp(tmp_path_factory) -> str:
    from tests.support.models import save_tiny_parallel_llama

    return save_tiny_parallel_llama(str(tmp_path_factory.mktemp("tiny-spec-llama")))


@pytest.fixture(scope="module")
def medusa_heads(tmp_path_factory) -> str:
    """Medusa heads for the default model from a short `train-draft` run (the real
    training path; a few prompts, so the heads are weak: some drafts pass, most do not)."""
    from kvserve.shared.launch_options import TrainDraftOptions
    from kvserve.training.train_draft import train_draft

    folder = str(tmp_path_factory.mktemp("medusa"))
    options = TrainDraftOptions(
        output=folder, num_heads=3, num_prompts=12, max_tokens=48, epochs=2, batch_size=32
    )
    train_draft(options, kv_cache_memory=DEFAULT_MODEL_KV_CACHE_MEMORY)
    return folder


def test_medusa_heads(medusa_heads, prompts, greedy_reference):
    spec = {"method": "medusa", "model": medusa_heads, "num_speculative_tokens": 3,
            "adaptive": False}  # fmt: skip
    llm = LLM(
        dtype="float32", kv_cache_memory=DEFAULT_MODEL_KV_CACHE_MEMORY, speculative_config=spec
    )
    _assert_equal(_greedy(llm, prompts), greedy_reference)
    _assert_accepted_and_rejected(llm)
    assert_no_leaked_blocks(llm.engine_core.scheduler)
    with pytest.raises(ValueError, match="exceeds the 3 Medusa heads"):
        LLM(
            dtype="float32",
            kv_cache_memory=DEFAULT_MODEL_KV_CACHE_MEMORY,
            speculative_config={**spec, "num_speculative_tokens": 4},
        )


@pytest.fixture(scope="module")
def eagle_head(tmp_path_factory) -> str:
    """An EAGLE-1 head for the default model from a short `train-draft --method eagle` run
    (the real training path; few prompts, so its guesses are weak)."""
    from kvserve.shared.launch_options import TrainDraftOptions
    from kvserve.training.train_eagle import train_eagle

    folder = str(tmp_path_factory.mktemp("eagle"))
    options = TrainDraftOptions(
        output=folder, method="eagle", num_prompts=12, max_tokens=48, epochs=1, batch_size=2
    )
    train_eagle(options, kv_cache_memory=DEFAULT_MODEL_KV_CACHE_MEMORY)
    return folder


def test_eagle_head(eagle_head, prompts, greedy_reference):
    spec = {"method": "eagle", "model": eagle_head, "num_speculative_tokens": 3,
            "adaptive": False}  # fmt: skip
    llm = LLM(
        dtype="float32",
        kv_cache_memory=DEFAULT_MODEL_KV_CACHE_MEMORY,
        speculative_config=spec,
        max_num_batched_tokens=64,
    )
    _assert_equal(_greedy(llm, prompts), greedy_reference)  # chunked prompts too
    _assert_accepted_and_rejected(llm)
    assert_no_leaked_blocks(llm.engine_core.scheduler)
