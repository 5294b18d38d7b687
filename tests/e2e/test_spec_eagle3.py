"""EAGLE-3 speculation (`method: "eagle3"`) through the whole engine on tiny float32 Llamas.

Greedy output equals greedy without speculation, token for token. The draft of
`build_tiny_eagle3` is built to guess a `successor` target's next token
(tests/support/models.py), so its drafts are accepted, through the full vocabulary and through
a smaller draft vocabulary mapped to target ids by d2t; over a random (context-dependent)
target it still proposes and output is unchanged. A bad draft folder fails at start-up with
a message naming it. Every run ends with zero leaked KV blocks.
"""

from __future__ import annotations

import gc
import json
import os

import pytest

from kvserve import LLM, SamplingParams
from tests.support.kv import assert_no_leaked_blocks
from tests.support.models import (
    TINY_KV_CACHE_MEMORY,
    build_tiny_eagle3,
    build_tiny_llama,
    tiny_successor,
)

PROMPTS = [
    list(b"hello world"),
    list(b"the quick brown fox jumps over the lazy dog"),
    list(b"abc"),
    list(b"Rewrite: the cat sat on the mat, the cat sat on the hat."),
]
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def successor_model(tmp_path_factory) -> str:
    return build_tiny_llama(str(tmp_path_factory.mktemp("successor")), successor=True)


@pytest.fixture(scope="module")
def random_model(tmp_path_factory) -> str:
    return build_tiny_llama(str(tmp_path_factory.mktemp("random")), seed=3)


def _spec(draft: str, k: int = 3) -> dict:
    return {"method": "eagle3", "model": draft, "num_speculative_tokens": k, "adaptive": False}


def _greedy(
    model_dir: str, spec: dict | None = None, prompts: list | None = None
) -> tuple[list[list[int]], LLM]:
    llm = LLM(
        model_dir,
        dtype="float32",
        kv_cache_memory=TINY_KV_CACHE_MEMORY,
        speculative_config=spec,
    )
    prompts = prompts or [{"prompt_token_ids": p} for p in PROMPTS]
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert_no_leaked_blocks(llm.engine_core.scheduler)
    return [list(o.outputs[0].token_ids) for o in outs], llm


def _close(llm: LLM) -> None:
    llm.engine_core.shutdown()
    gc.collect()


def test_drafts_of_a_built_head_are_accepted_and_output_unchanged(successor_model, tmp_path):
    reference, llm = _greedy(successor_model)
    _close(llm)
    successor = tiny_successor()
    # The target says what the draft is built to guess: each token's successor.
    assert all(out[0] == successor[prompt[-1]] for out, prompt in zip(reference, PROMPTS))
    full = build_tiny_eagle3(str(tmp_path / "full"), successor_model)
    # Half the vocabulary: a random half of the successors can be guessed.
    small = build_tiny_eagle3(str(tmp_path / "small"), successor_model, draft_vocab_size=128)
    for draft in (full, small):
        out, llm = _greedy(successor_model, _spec(draft))
        totals = llm.stats_totals
        _close(llm)
        assert out == reference, f"{draft}: greedy with eagle3 diverges"
        assert totals.spec_num_draft_tokens > 0, f"{draft}: no drafts"
        accepted, drafted = totals.spec_num_accepted_tokens, totals.spec_num_draft_tokens
        if draft == full:  # every guess is the successor
            assert accepted >= 0.8 * drafted, f"{accepted} of {drafted} drafts accepted"
        else:  # guesses only in the 128 ids kept, mapped through d2t (draft ids as target
            # ids: 1 of 225 accepted)
            assert 0.2 * drafted <= accepted < drafted, f"{accepted} of {drafted} accepted"


def test_a_context_dependent_target_keeps_its_output(random_model, tmp_path):
    reference, llm = _greedy(random_model)
    _close(llm)
    draft = build_tiny_eagle3(str(tmp_path / "draft"), random_model, draft_vocab_size=128)
    out, llm = _greedy(random_model, _spec(draft, k=4))
    totals = llm.stats_totals
    _close(llm)
    assert out == reference
    assert totals.spec_num_draft_tokens > 0


def _broken(folder: str, how: str) -> str:
    if how == "no config":
        os.remove(os.path.join(folder, "config.json"))
    elif how == "eagle-1 config":
        with open(os.path.join(folder, "config.json")) as f:
            config = json.load(f)
        config["architectures"] = ["LlamaForCausalLM"]
        with open(os.path.join(folder, "config.json"), "w") as f:
            json.dump(config, f)
    elif how == "bad layer ids":
        with open(os.path.join(folder, "config.json")) as f:
            config = json.load(f)
        config["eagle_aux_hidden_state_layer_ids"] = [2, 5, 9]
        with open(os.path.join(folder, "config.json"), "w") as f:
            json.dump(config, f)
    return folder


@pytest.mark.parametrize(
    ("how", "message"),
    [
        ("no config", "no config.json"),
        ("eagle-1 config", "an EAGLE-3 head is one of"),
        ("bad layer ids", r"aux hidden state layers \[2, 5, 9\] for a target of 2 layers"),
    ],
)
def test_a_bad_draft_folder_fails_at_start_up(successor_model, tmp_path, how, message):
    folder = _broken(build_tiny_eagle3(str(tmp_path / "draft"), successor_model), how)
    with pytest.raises(ValueError, match=f"eagle3 checkpoint {folder}: .*{message}"):
        LLM(
            successor_model,
            dtype="float32",
            kv_cache_memory=TINY_KV_CACHE_MEMORY,
            speculative_config=_spec(folder),
        )


def test_a_head_trained_by_train_draft_serves_the_same_output(successor_model, tmp_path):
    """`train-draft --method eagle3`'s code end to end (generation, the target's aux states,
    training-time test, the published layout) on the successor target, whose next token
    is a function of the current one: served on its training prompts, the trained head's
    drafts are accepted and output stays the same. (Its successors are learned per token:
    PROMPTS' chains, through tokens it never saw, are mostly rejected.)"""
    from kvserve.shared.launch_options import TrainDraftOptions
    from kvserve.training.train_draft import load_prompts
    from kvserve.training.train_eagle3 import train_eagle3

    options = TrainDraftOptions(
        model=successor_model,
        output=str(tmp_path / "eagle3"),
        method="eagle3",
        num_prompts=12,
        max_tokens=24,
        epochs=10,
        lr=1e-2,
        batch_size=2,
        num_spec_tokens=3,
    )
    run = train_eagle3(options, kv_cache_memory=TINY_KV_CACHE_MEMORY)
    assert run.score.mean_acceptance_length > run.untrained_score.mean_acceptance_length
    prompts = load_prompts(None, options.num_prompts, options.seed)
    reference, llm = _greedy(successor_model, prompts=prompts)
    _close(llm)
    out, llm = _greedy(successor_model, _spec(options.output), prompts)
    totals = llm.stats_totals
    _close(llm)
    assert out == reference
    accepted, drafted = totals.spec_num_accepted_tokens, totals.spec_num_draft_tokens
    # Measured: every draft accepted (an untrained head: none).
    assert drafted > 0 and accepted >= 0.5 * drafted, f"{accepted} of {drafted} accepted"
