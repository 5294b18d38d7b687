"""Speculation under a grammar (structured_output/draft_masks.py): drafts are cut at the
first token the grammar forbids, and the step's bitmask has one row per verified position,
each the grammar's state after the drafts before it; the matcher ends where it started.

Real xgrammar grammars over the tiny byte-level tokenizer (one token per character)."""

from __future__ import annotations

import numpy as np
import pytest

from kvserve.services.scheduler.core.request import RequestStatus
from kvserve.services.scheduler.structured_output.manager import StructuredOutputManager
from kvserve.shared.config import SpeculativeConfig, StructuredOutputsConfig
from kvserve.shared.structured_outputs import StructuredOutputsParams
from tests.support.kv import assert_no_leaked_blocks
from tests.support.models import TINY_EOS_TOKEN_ID, TINY_VOCAB_SIZE
from tests.support.scheduler import create_request, create_scheduler, step

NGRAM = SpeculativeConfig(method="ngram", num_speculative_tokens=4, adaptive=False)
CHOICE = StructuredOutputsParams(choice=["abcd", "abxy"])


@pytest.fixture(scope="module")
def manager(tiny_llama_dir):
    manager = StructuredOutputManager(
        tiny_llama_dir, tiny_llama_dir, StructuredOutputsConfig(), max_num_seqs=4
    )
    yield manager
    manager.shutdown()


@pytest.fixture(scope="module")
def ids(tiny_llama_dir):
    """The tiny tokenizer's ids of a string's characters."""
    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast.from_pretrained(tiny_llama_dir)
    return lambda text: [tokenizer.encode(c)[0] for c in text]


def allowed_rows(output) -> list[set[int]]:
    words = np.frombuffer(output.grammar_bitmask, dtype=np.int32).reshape(
        len(output.grammar_req_ids), -1
    )
    bits = np.unpackbits(words.view(np.uint8), axis=1, bitorder="little")[:, :TINY_VOCAB_SIZE]
    return [set(np.flatnonzero(row).tolist()) for row in bits]


def started(manager):
    """A scheduler holding one grammar request, its grammar compiled (fake model)."""
    scheduler = create_scheduler(speculative_config=NGRAM)
    scheduler.structured_output_manager = manager
    scheduler.add_request(
        create_request(
            "s", structured_outputs=CHOICE, eos_token_id=TINY_EOS_TOKEN_ID, max_tokens=10
        )
    )
    for future in scheduler.pending_grammar_futures():
        future.exception(timeout=30)
    return scheduler


def test_drafts_stop_at_the_first_forbidden_token_and_each_position_gets_its_row(manager, ids):
    scheduler = started(manager)
    # The prefill samples "a"; the worker proposes "b c z z": "z" breaks the grammar.
    step(scheduler, sampled={"s": ids("a")}, spec_token_ids={"s": ids("bczz")})
    so = scheduler.schedule()
    assert so.spec_decode.draft_token_ids == {"s": ids("bc")}
    assert so.num_scheduled_tokens == {"s": 3}
    assert so.grammar_req_ids == ["s"] * 3
    b, c, x, d = ids("bcxd")
    assert allowed_rows(so) == [{b}, {c, x}, {d}]
    # The matcher is where it was: after "a", so "b" is next.
    grammar = scheduler.requests["s"].structured_output.grammar
    assert grammar.accept_tokens([b])
    grammar.rollback(1)
    out = scheduler.update_from_output(
        so, _runner_output(scheduler, so, {"s": ids("bcd")}, {"s": [TINY_EOS_TOKEN_ID]})
    )
    assert out[0].new_token_ids == ids("bcd")


def test_a_draft_that_would_complete_the_grammar_is_cut_before_it(manager, ids):
    scheduler = started(manager)
    step(scheduler, sampled={"s": ids("a")}, spec_token_ids={"s": ids("bcd") + [TINY_EOS_TOKEN_ID]})
    so = scheduler.schedule()
    # "bcd" completes "abcd"; its stop token is left for the target to sample.
    assert so.spec_decode.draft_token_ids == {"s": ids("bcd")}
    assert allowed_rows(so)[-1] == {TINY_EOS_TOKEN_ID}
    scheduler.update_from_output(
        so, _runner_output(scheduler, so, {"s": ids("bcd") + [TINY_EOS_TOKEN_ID]})
    )
    assert "s" not in scheduler.requests
    assert_no_leaked_blocks(scheduler)


def test_a_grammar_request_with_a_forbidden_first_draft_verifies_none(manager, ids):
    scheduler = started(manager)
    step(scheduler, sampled={"s": ids("a")}, spec_token_ids={"s": ids("zz")})
    so = scheduler.schedule()
    assert so.spec_decode.draft_token_ids == {}
    assert so.grammar_req_ids == ["s"] and so.num_scheduled_tokens == {"s": 1}
    scheduler.finish_requests("s", RequestStatus.FINISHED_ABORTED)
    step(scheduler)
    assert_no_leaked_blocks(scheduler)


def _runner_output(scheduler, so, sampled, spec=None):
    from tests.support.scheduler import make_runner_output

    return make_runner_output(scheduler, so, sampled, spec)
