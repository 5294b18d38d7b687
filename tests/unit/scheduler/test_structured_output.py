"""Structured outputs in the scheduler: grammars compile off the loop and are cached, a request
waits for its grammar in its own state, each step carries the bitmask of the grammars that
sample, matchers advance on sampled tokens, and every failure costs only its request.

The fake model samples what the test says (tests/support/scheduler.py); the grammars are real
xgrammar grammars over the tiny byte-level tokenizer, so each token id is one character.
"""

from __future__ import annotations

import numpy as np
import pytest

from kvserve.services.scheduler.core.request import RequestStatus
from kvserve.services.scheduler.core.step_plan import StepPlan
from kvserve.services.scheduler.structured_output.manager import StructuredOutputManager
from kvserve.shared.config import StructuredOutputsConfig
from kvserve.shared.messages import FinishReason
from kvserve.shared.structured_outputs import StructuredOutputsParams
from tests.support.kv import assert_no_leaked_blocks
from tests.support.models import TINY_EOS_TOKEN_ID, TINY_VOCAB_SIZE
from tests.support.scheduler import create_request, create_scheduler, step, submit

CHOICE = StructuredOutputsParams(choice=["ab", "cd"])


@pytest.fixture(scope="module")
def manager(tiny_llama_dir):
    """One manager for the module (its backend loads xgrammar once)."""
    manager = StructuredOutputManager(
        tiny_llama_dir, tiny_llama_dir, StructuredOutputsConfig(), max_num_seqs=16
    )
    yield manager
    manager.shutdown()


@pytest.fixture(scope="module")
def token_id(tiny_llama_dir):
    """The tiny tokenizer's id of one character."""
    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast.from_pretrained(tiny_llama_dir)
    return lambda char: tokenizer.encode(char)[0]


def grammar_scheduler(manager, **knobs):
    scheduler = create_scheduler(**knobs)
    scheduler.structured_output_manager = manager
    return scheduler


def structured_request(req_id, params=CHOICE, **kwargs):
    kwargs.setdefault("eos_token_id", TINY_EOS_TOKEN_ID)
    return create_request(req_id, structured_outputs=params, **kwargs)


def wait_compiled(scheduler) -> None:
    for future in scheduler.pending_grammar_futures():
        future.exception(timeout=30)


def allowed_ids(output, row: int = 0) -> set[int]:
    words = np.frombuffer(output.grammar_bitmask, dtype=np.int32).reshape(
        len(output.grammar_req_ids), -1
    )
    bits = np.unpackbits(words[row : row + 1].view(np.uint8), bitorder="little")
    return set(np.flatnonzero(bits[:TINY_VOCAB_SIZE]).tolist())


def test_request_waits_for_its_grammar_then_samples_under_its_bitmask(manager, token_id):
    scheduler = grammar_scheduler(manager)
    scheduler.add_request(structured_request("s"))
    scheduler.add_request(create_request("plain", max_tokens=2))
    request = scheduler.requests["s"]
    assert request.status == RequestStatus.WAITING_FOR_GRAMMAR
    assert "s" in scheduler.waiting_for_grammar and request not in list(scheduler.waiting)
    stats = scheduler.make_stats()
    assert (stats.num_waiting_reqs, stats.num_waiting_for_grammar) == (2, 1)

    wait_compiled(scheduler)
    first, _ = step(scheduler, sampled={"s": [token_id("a")]})
    assert set(first.num_scheduled_tokens) == {"s", "plain"}
    # Only the structured request gets a row: "a" or "c" may start "ab" | "cd".
    assert first.grammar_req_ids == ["s"]
    assert len(first.grammar_bitmask) == 4 * ((TINY_VOCAB_SIZE + 31) // 32)
    assert allowed_ids(first) == {token_id("a"), token_id("c")}

    second, _ = step(scheduler, sampled={"s": [token_id("b")]})
    assert allowed_ids(second) == {token_id("b")}
    # The grammar is complete: only its stop token (EOS) may follow, and it ends the request.
    third, outputs = step(scheduler, sampled={"s": [TINY_EOS_TOKEN_ID]})
    assert allowed_ids(third) == {TINY_EOS_TOKEN_ID}
    final = next(o for o in outputs if o.request_id == "s")
    assert final.finish_reason == FinishReason.STOP and "s" not in scheduler.requests
    while scheduler.has_requests():
        step(scheduler)
    assert_no_leaked_blocks(scheduler)


def test_bitmask_rows_only_for_the_chunk_that_samples(manager, token_id):
    scheduler = grammar_scheduler(
        manager, max_num_batched_tokens=16, long_prefill_token_threshold=8
    )
    scheduler.add_request(structured_request("s", num_tokens=20))
    wait_compiled(scheduler)
    chunks = [step(scheduler, sampled={"s": [token_id("c")]})[0] for _ in range(3)]
    assert [c.num_scheduled_tokens["s"] for c in chunks] == [8, 8, 4]
    assert [c.grammar_req_ids for c in chunks] == [[], [], ["s"]]
    scheduler.finish_requests("s", RequestStatus.FINISHED_ABORTED)
    step(scheduler)
    assert_no_leaked_blocks(scheduler)


def test_a_grammar_compiles_once_and_later_requests_hit_the_cache(manager):
    scheduler = grammar_scheduler(manager)
    params = StructuredOutputsParams(regex="[0-9]{2}x")
    manager.take_stats()
    for req_id in ("a", "b", "c"):
        scheduler.add_request(structured_request(req_id, params))
    queries, hits, compile_times = manager.take_stats()
    assert (queries, hits) == (3, 2)
    wait_compiled(scheduler)
    assert len({id(r.structured_output.future) for r in scheduler.requests.values()}) == 1
    step(scheduler)
    assert len(manager.take_stats()[2]) == 1  # one compile, timed
    stats = scheduler.make_stats()
    assert stats.num_waiting_for_grammar == 0
    scheduler.finish_requests(["a", "b", "c"], RequestStatus.FINISHED_ABORTED)
    step(scheduler)
    assert_no_leaked_blocks(scheduler)


@pytest.mark.parametrize(
    "params, message",
    [
        (StructuredOutputsParams(json={"type": "objekt"}), "invalid JSON schema"),
        (StructuredOutputsParams(json={"type": "array", "uniqueItems": True}), "uniqueItems"),
        (StructuredOutputsParams(regex="(?=a)b"), "Lookahead is not supported"),
        (StructuredOutputsParams(grammar="root ::= undefined_rule"), "is not defined"),
        (
            StructuredOutputsParams(json={"type": "string", "pattern": "(?=a)b"}),
            "#/pattern: regex",
        ),
    ],
)
def test_a_bad_constraint_fails_its_request_only(manager, params, message):
    scheduler = grammar_scheduler(manager)
    scheduler.add_request(structured_request("bad", params))
    scheduler.add_request(create_request("ok", max_tokens=1))
    wait_compiled(scheduler)
    _, outputs = step(scheduler)
    bad = next(o for o in outputs if o.request_id == "bad")
    assert bad.finish_reason == FinishReason.ERROR and message in bad.error
    assert "bad" not in scheduler.requests
    # The failure is cached: the same constraint fails again without a compile.
    scheduler.add_request(structured_request("again", params))
    wait_compiled(scheduler)
    _, outputs = step(scheduler)
    assert any(o.request_id == "again" and o.finish_reason == FinishReason.ERROR for o in outputs)
    while scheduler.has_requests():
        step(scheduler)
    assert_no_leaked_blocks(scheduler)


def test_a_token_the_grammar_forbids_fails_the_request(manager, token_id):
    scheduler = grammar_scheduler(manager)
    scheduler.add_request(structured_request("s"))
    wait_compiled(scheduler)
    _, outputs = step(scheduler, sampled={"s": [token_id("z")]})
    assert outputs[0].finish_reason == FinishReason.ERROR
    assert "not allowed by the request's grammar" in outputs[0].error
    step(scheduler)
    assert_no_leaked_blocks(scheduler)


def test_a_complete_grammar_ends_the_request_even_with_ignore_eos(manager, token_id):
    scheduler = grammar_scheduler(manager)
    scheduler.add_request(structured_request("s", ignore_eos=True))
    wait_compiled(scheduler)
    step(scheduler, sampled={"s": [token_id("c")]})
    step(scheduler, sampled={"s": [token_id("d")]})
    _, outputs = step(scheduler, sampled={"s": [TINY_EOS_TOKEN_ID]})
    assert outputs[0].finish_reason == FinishReason.STOP
    step(scheduler)
    assert_no_leaked_blocks(scheduler)


def test_abort_while_waiting_for_the_grammar(manager):
    scheduler = grammar_scheduler(manager)
    scheduler.add_request(structured_request("s", StructuredOutputsParams(regex="[a-z]{1,40}")))
    scheduler.finish_requests("s", RequestStatus.FINISHED_ABORTED)
    assert not scheduler.waiting_for_grammar and not scheduler.has_unfinished_requests()
    step(scheduler)
    assert_no_leaked_blocks(scheduler)


def test_preemption_keeps_the_matcher_where_it_was(manager, token_id):
    scheduler = grammar_scheduler(manager)
    scheduler.add_request(structured_request("s"))
    wait_compiled(scheduler)
    step(scheduler, sampled={"s": [token_id("c")]})
    request = scheduler.requests["s"]
    # Preempted as when the cache is full: its blocks go, it recomputes from scratch.
    scheduler._preempt(request, StepPlan(token_budget=0))
    assert request.status == RequestStatus.PREEMPTED
    resumed, _ = step(scheduler, sampled={"s": [token_id("d")]})
    assert resumed.scheduled_new_reqs[0].output_token_ids == [token_id("c")]
    assert allowed_ids(resumed) == {token_id("d")}
    _, outputs = step(scheduler, sampled={"s": [TINY_EOS_TOKEN_ID]})
    assert outputs[0].finish_reason == FinishReason.STOP
    step(scheduler)
    assert_no_leaked_blocks(scheduler)


def test_without_a_manager_structured_requests_are_refused():
    scheduler = create_scheduler()
    submit(scheduler, structured_request("s"))
    _, outputs = step(scheduler)
    assert outputs[0].finish_reason == FinishReason.ERROR
    assert "structured outputs are not enabled" in outputs[0].error
