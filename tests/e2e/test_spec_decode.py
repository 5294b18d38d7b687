"""Speculative decoding through the whole engine on the real default model (float32): greedy
output equals greedy without speculation, token for token, with each method, over prompts
whose drafts are both accepted and rejected; and with n > 1, logprobs and seeds. A tiny
random Llama does the same with a separate draft model (its own KV cache), under chunked
prefill with preemption, and with TP = 2 and PP = 2: what they test needs no real text.
Every run ends with zero leaked KV blocks.

The default model's engines cost seconds each to start, so tests of one config share one
engine (`engines`, one alive at a time: they sit next to each other in this file), and the
reference outputs without speculation are computed once (`reference`; the tiny model's in
`tiny`)."""

from __future__ import annotations

import gc
import json
from dataclasses import dataclass

import pytest

from kvserve import LLM, SamplingParams
from kvserve.services.api.engine_client.client import StatsTotals
from tests.support.kv import assert_no_leaked_blocks
from tests.support.models import DEFAULT_MODEL_KV_CACHE_MEMORY
from tests.support.prompts import chat_prompt_ids

pytestmark = pytest.mark.slow

MAX_TOKENS = 40
# Tests that run the prompts again where a shorter run asserts the same thing compare this
# many tokens with the reference's first ones (greedy: the same tokens, cut sooner).
SHORT_MAX_TOKENS = 24
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
# Step costs for the adaptive rule (KVSERVE_SPEC_STEP_COSTS), in place of its start-up timing
# (over a dozen CPU seconds): the default model's float32 verify steps on one core, flat up
# to ~8 query tokens (a draft costs ~3-10% of a step at batch 1), then compute-bound.
STEP_COSTS = "1:0.020,2:0.0205,4:0.021,8:0.023,16:0.036,32:0.066,64:0.13,128:0.26,256:0.55"
# The draft heads' training text (`kvserve train-draft`'s options): a few prompts, so the
# heads are weak and their drafts are both accepted and rejected.
TRAIN_CORPUS = {"num_prompts": 12, "max_tokens": 48}
# The n > 1 and logprobs request of test_logprobs_n_and_max_tokens, on the last 3 prompts.
LOGPROBS_N = SamplingParams(temperature=0.0, max_tokens=17, logprobs=2, n=2)
# The tiny random Llama's prompts (ids of its 128-token vocabulary). TP_PROMPTS run over
# 2 ranks; TINY_PROMPTS are longer than a 32-token budget (chunked prefill), share a
# 24-token prefix (prefix-cache hits) and repeat n-grams the model may or may not continue.
TP_PROMPTS = ([5, 17, 99, 3, 42], [7] * 11, [20, 21, 22])
TINY_PREFIX = list(range(60, 84))
TINY_PROMPTS = [
    TINY_PREFIX + [5, 17, 99, 3, 42] * 3,
    TINY_PREFIX + [7] * 11,
    TINY_PREFIX + [20, 21, 22, 23] * 5,
    TINY_PREFIX + list(range(100, 128)),
]


class OneEngine:
    """The module's default-model engines, one alive at a time (each holds ~0.7 GB): asking
    for another config than the live one's shuts that one down first. Each `get` starts
    fresh stats totals, so a test's acceptance checks count its own drafts only."""

    def __init__(self) -> None:
        self.key: str | None = None
        self.llm: LLM | None = None

    def get(self, **engine_kwargs) -> LLM:
        """The engine of these LLM arguments (beyond dtype and the KV cache size)."""
        key = json.dumps(engine_kwargs, sort_keys=True)
        if key != self.key or self.llm is None:
            self.close()
            engine_kwargs.setdefault("kv_cache_memory", DEFAULT_MODEL_KV_CACHE_MEMORY)
            self.llm = LLM(dtype="float32", **engine_kwargs)
            self.key = key
        self.llm.stats_totals = StatsTotals()
        return self.llm

    def close(self) -> None:
        if self.llm is not None:
            self.llm.engine_core.shutdown()
            self.llm, self.key = None, None
            gc.collect()


@dataclass
class Reference:
    """Outputs without speculation: greedy over every prompt, and LOGPROBS_N's."""

    greedy: list[list[int]]
    logprobs_n: list


@pytest.fixture(scope="module")
def engines():
    one = OneEngine()
    yield one
    one.close()


@pytest.fixture(scope="module")
def prompts(default_model_dir) -> list[list[int]]:
    return chat_prompt_ids(default_model_dir, QUESTIONS)


@pytest.fixture(scope="module")
def reference(engines, prompts) -> Reference:
    llm = engines.get()
    inputs = [{"prompt_token_ids": p} for p in prompts[2:]]
    logprobs_n = llm.generate(inputs, LOGPROBS_N, use_tqdm=False)
    return Reference(_greedy(llm, prompts), logprobs_n)


def _greedy(llm: LLM, prompts, max_tokens: int = MAX_TOKENS) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def _assert_equal(ours, reference, max_tokens: int = MAX_TOKENS, labels=QUESTIONS) -> None:
    """ours equals reference token for token; ours ran max_tokens, reference MAX_TOKENS."""
    for i, (a, b) in enumerate(zip(ours, reference)):
        b = b[:max_tokens]
        assert a == b, f"prompt {i} ({labels[i]!r}) diverges:\nspec {a}\nref  {b}"


def _assert_accepted_and_rejected(llm: LLM) -> None:
    totals = llm.stats_totals
    assert totals.spec_num_drafts > 0, "no drafts were verified"
    assert 0 < totals.spec_num_accepted_tokens < totals.spec_num_draft_tokens, (
        f"{totals.spec_num_accepted_tokens} of {totals.spec_num_draft_tokens} drafts accepted"
    )


def _fixed(spec: dict) -> dict:
    """The config with adaptive length off: every step drafts, so rejections happen."""
    return {**spec, "adaptive": False}


def test_ngram_greedy_equals_greedy_without_speculation(engines, prompts, reference):
    llm = engines.get(speculative_config=_fixed(NGRAM))
    _assert_equal(_greedy(llm, prompts), reference.greedy)
    _assert_accepted_and_rejected(llm)
    assert_no_leaked_blocks(llm.engine_core.scheduler)


def test_logprobs_n_and_max_tokens(engines, prompts, reference):
    spec = engines.get(speculative_config=_fixed(NGRAM))
    got = spec.generate([{"prompt_token_ids": p} for p in prompts[2:]], LOGPROBS_N, use_tqdm=False)
    assert any(len(o.outputs[0].token_ids) == 17 for o in got)  # max_tokens ended some
    for w, g in zip(reference.logprobs_n, got):
        assert len(g.outputs) == 2
        for wc, gc_ in zip(w.outputs, g.outputs):
            assert gc_.token_ids == wc.token_ids
            assert len(gc_.logprobs) == len(gc_.token_ids)
            for wl, gl in zip(wc.logprobs, gc_.logprobs):
                assert list(gl) == list(wl)  # the same top tokens at every position
                for token_id in wl:
                    assert gl[token_id].logprob == pytest.approx(wl[token_id].logprob, abs=1e-3)
                    assert gl[token_id].rank == wl[token_id].rank
    _assert_accepted_and_rejected(spec)
    assert_no_leaked_blocks(spec.engine_core.scheduler)


def test_structured_outputs_beside_speculating_requests(engines, prompts, reference):
    from kvserve.shared.structured_outputs import StructuredOutputsParams

    llm = engines.get(speculative_config=_fixed(NGRAM))
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    constrained = SamplingParams(
        temperature=0.0,
        max_tokens=MAX_TOKENS,
        structured_outputs=StructuredOutputsParams(json=schema),
    )
    plain = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    inputs = [{"prompt_token_ids": p} for p in prompts]
    outs = llm.generate(inputs + inputs[:1], [plain] * len(inputs) + [constrained], use_tqdm=False)
    _assert_equal([o.outputs[0].token_ids for o in outs[:-1]], reference.greedy)
    assert set(json.loads(outs[-1].outputs[0].text)) == {"n"}
    _assert_accepted_and_rejected(llm)
    assert_no_leaked_blocks(llm.engine_core.scheduler)


def test_seeded_random_sampling_is_reproducible(engines, prompts):
    llm = engines.get(speculative_config=_fixed(NGRAM))
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


def test_adaptive_ngram_greedy_equals_greedy_without_speculation(
    engines, prompts, reference, monkeypatch
):
    # The adaptive rule drafts where a draft pays for its share of the step. At batch 1 it
    # pays while the draft's acceptance beats the verify step's extra time (STEP_COSTS: a few
    # percent), so drafts are taken, accepted and rejected. In a batch of five the first
    # draft must beat a larger share of the step, and the rule may rightly keep to sure
    # drafts: the prompts go one at a time.
    monkeypatch.setenv("KVSERVE_SPEC_STEP_COSTS", STEP_COSTS)
    llm = engines.get(speculative_config=NGRAM)
    costs = llm.engine_core.scheduler.spec_decode.policy.step_cost_model
    assert costs.num_tokens[:2] == [1, 2] and costs.seconds[0] == 0.020  # the table, untimed
    n = SHORT_MAX_TOKENS  # five requests one at a time: five times the steps of a batch
    _assert_equal([_greedy(llm, [p], n)[0] for p in prompts], reference.greedy, n)
    _assert_accepted_and_rejected(llm)
    assert_no_leaked_blocks(llm.engine_core.scheduler)


def test_self_draft_greedy_equals_greedy_without_speculation(engines, prompts, reference):
    llm = engines.get(speculative_config=_fixed(SELF_DRAFT))
    _assert_equal(_greedy(llm, prompts), reference.greedy)
    _assert_accepted_and_rejected(llm)
    assert_no_leaked_blocks(llm.engine_core.scheduler)


def test_aborts_mid_speculation_free_every_block(engines, prompts):
    llm = engines.get(speculative_config=_fixed(SELF_DRAFT))
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


def test_a_separate_draft_model_with_its_own_kv_cache(tiny):
    # The tiny model loaded again as the draft, truncated: its own weights and KV cache,
    # caught up on every step (prefix-cache hits included: the prompts share a prefix).
    spec = {"method": "draft_model", "num_speculative_tokens": 3, "model": tiny.model,
            "num_draft_layers": 2, "adaptive": False}  # fmt: skip
    llm = LLM(tiny.model, speculative_config=spec, **tiny.engine_kwargs)
    try:
        assert llm.engine_core.executor.worker.runner.proposer.draft.owns_cache
        _assert_equal(_greedy(llm, TINY_PROMPTS), tiny.reference, labels=TINY_PROMPTS)
        # A second round from the cache: the prompts hit, the draft catches up on them.
        n = SHORT_MAX_TOKENS
        _assert_equal(_greedy(llm, TINY_PROMPTS, n), tiny.reference, n, labels=TINY_PROMPTS)
        _assert_accepted_and_rejected(llm)
        assert_no_leaked_blocks(llm.engine_core.scheduler)
    finally:
        llm.engine_core.shutdown()


def test_chunked_prefill_and_preemption(tiny):
    longest = max(len(p) for p in TINY_PROMPTS) + MAX_TOKENS + 8
    num_blocks = -(-longest // 16) + 4  # one request always fits, two do not
    kwargs = {**tiny.engine_kwargs, "kv_cache_memory": None}
    for spec in (_fixed(NGRAM), {**_fixed(SELF_DRAFT), "num_draft_layers": 2}):
        llm = LLM(
            tiny.model,
            speculative_config=spec,
            max_num_batched_tokens=32,
            num_gpu_blocks_override=num_blocks,
            **kwargs,
        )
        try:
            _assert_equal(_greedy(llm, TINY_PROMPTS), tiny.reference, labels=TINY_PROMPTS)
            assert llm.engine_core.scheduler.num_preemptions_total > 0
            _assert_accepted_and_rejected(llm)
            assert_no_leaked_blocks(llm.engine_core.scheduler)
        finally:
            llm.engine_core.shutdown()


def test_tensor_and_pipeline_parallel(tiny):
    # The default model's 9 heads do not split over 2 ranks: a tiny random Llama does
    # (its greedy text loops, so n-gram drafts are accepted too).
    inputs = [{"prompt_token_ids": p} for p in TP_PROMPTS]
    params = SamplingParams(temperature=0.0, max_tokens=24)
    runs = [
        (_fixed(NGRAM), {"tensor_parallel_size": 2}),
        ({**_fixed(SELF_DRAFT), "num_draft_layers": 2}, {"tensor_parallel_size": 2}),
        (_fixed(NGRAM), {"pipeline_parallel_size": 2}),
    ]
    for spec, parallel in runs:
        llm = LLM(tiny.model, speculative_config=spec, **parallel, **tiny.engine_kwargs)
        try:
            outs = llm.generate(inputs, params, use_tqdm=False)
            assert [o.outputs[0].token_ids for o in outs] == tiny.tp_reference
            assert llm.stats_totals.spec_num_accepted_tokens > 0
            assert_no_leaked_blocks(llm.engine_core.scheduler)
        finally:
            llm.engine_core.shutdown()


@dataclass
class Tiny:
    """The tiny random Llama of the tests that need no real text, its engine arguments, and
    its greedy outputs without speculation: TP_PROMPTS' (24 tokens) and TINY_PROMPTS'
    (MAX_TOKENS)."""

    model: str
    engine_kwargs: dict
    tp_reference: list[list[int]]
    reference: list[list[int]]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, default_model_dir, engines) -> Tiny:
    """A tiny random Llama that splits over 2 TP ranks and 2 PP stages, and what it
    generates without speculation (one engine, each prompt set in its own batch)."""
    from tests.support.models import save_tiny_parallel_llama

    engines.close()  # no default-model engine is needed beside the tiny ones
    model = save_tiny_parallel_llama(str(tmp_path_factory.mktemp("tiny-spec-llama")))
    kwargs = {"tokenizer": default_model_dir, "dtype": "float32", "max_model_len": 256,
              "kv_cache_memory": 64 << 20}  # fmt: skip
    llm = LLM(model, **kwargs)
    try:
        inputs = [{"prompt_token_ids": p} for p in TP_PROMPTS]
        params = SamplingParams(temperature=0.0, max_tokens=24)
        outs = llm.generate(inputs, params, use_tqdm=False)
        return Tiny(
            model, kwargs, [o.outputs[0].token_ids for o in outs], _greedy(llm, TINY_PROMPTS)
        )
    finally:
        llm.engine_core.shutdown()


@pytest.fixture(scope="module")
def draft_corpus(engines):
    """The default model's greedy continuations of the training prompts, generated once for
    the Medusa heads and the EAGLE head (both train on TRAIN_CORPUS's prompts)."""
    from kvserve.shared.launch_options import TrainDraftOptions
    from kvserve.training.train_draft import generate_corpus

    engines.close()  # the generation starts its own engine
    options = TrainDraftOptions(output="", **TRAIN_CORPUS)
    return generate_corpus(options, kv_cache_memory=DEFAULT_MODEL_KV_CACHE_MEMORY)


@pytest.fixture(scope="module")
def medusa_heads(tmp_path_factory, engines, draft_corpus) -> str:
    """Medusa heads for the default model from a short `train-draft` run (the real
    training path; a few prompts, so the heads are weak: some drafts pass, most do not)."""
    from kvserve.shared.launch_options import TrainDraftOptions
    from kvserve.training.train_draft import train_draft

    engines.close()  # the training's HF model needs the memory
    folder = str(tmp_path_factory.mktemp("medusa"))
    options = TrainDraftOptions(output=folder, num_heads=3, epochs=2, batch_size=32, **TRAIN_CORPUS)
    train_draft(options, corpus=draft_corpus)
    return folder


def test_medusa_heads(engines, medusa_heads, prompts, reference):
    spec = {"method": "medusa", "model": medusa_heads, "num_speculative_tokens": 3,
            "adaptive": False}  # fmt: skip
    llm = engines.get(speculative_config=spec)
    _assert_equal(_greedy(llm, prompts), reference.greedy)
    _assert_accepted_and_rejected(llm)
    assert_no_leaked_blocks(llm.engine_core.scheduler)
    with pytest.raises(ValueError, match="exceeds the 3 Medusa heads"):
        engines.get(speculative_config={**spec, "num_speculative_tokens": 4})


@pytest.fixture(scope="module")
def eagle_head(tmp_path_factory, engines, draft_corpus) -> str:
    """An EAGLE-1 head for the default model from a short `train-draft --method eagle` run
    (the real training path; few prompts, so its guesses are weak)."""
    from kvserve.shared.launch_options import TrainDraftOptions
    from kvserve.training.train_eagle import train_eagle

    engines.close()  # the training's HF model needs the memory
    folder = str(tmp_path_factory.mktemp("eagle"))
    options = TrainDraftOptions(
        output=folder, method="eagle", epochs=1, batch_size=2, **TRAIN_CORPUS
    )
    train_eagle(options, corpus=draft_corpus)
    return folder


def test_eagle_head(engines, eagle_head, prompts, reference):
    spec = {"method": "eagle", "model": eagle_head, "num_speculative_tokens": 3,
            "adaptive": False}  # fmt: skip
    llm = engines.get(speculative_config=spec, max_num_batched_tokens=64)
    _assert_equal(_greedy(llm, prompts), reference.greedy)  # chunked prompts too
    _assert_accepted_and_rejected(llm)
    assert_no_leaked_blocks(llm.engine_core.scheduler)
