"""Thinking before the answer in the scheduler (core/thinking.py): the budget forces the end
tokens one step at a time, from wherever the model had got to in them; the grammar of a
structured request waits for the answer; speculative decoding refuses a budget.

The fake model samples what the test says (tests/support/scheduler.py); the forced token is
what the scheduler tells the worker's sampler, checked here in each step's output.
"""

from __future__ import annotations

import pytest

from kvserve.services.scheduler.core.thinking import ThinkingState
from kvserve.services.scheduler.engine.request_checks import RequestChecker
from kvserve.services.scheduler.structured_output.manager import StructuredOutputManager
from kvserve.shared.config import StructuredOutputsConfig
from kvserve.shared.structured_outputs import StructuredOutputsParams
from tests.support.kv import assert_no_leaked_blocks
from tests.support.models import TINY_EOS_TOKEN_ID
from tests.support.scheduler import create_request, create_scheduler, step

END = [7, 8, 9]  # the end-of-thinking tokens


def test_the_state_counts_thinking_and_forces_the_rest_of_the_end():
    state = ThinkingState(END, budget=3)
    assert [state.take(t) for t in (1, 2)] == [True, True] and state.forced_token() is None
    assert state.take(7) and state.forced_token() is None  # the model began the end itself
    assert state.take(3) and state.forced_token() == 7  # 3 counted tokens: the budget is spent
    assert state.take(7) and state.forced_token() == 8
    assert state.take(8) and state.forced_token() == 9
    assert state.take(9) and state.ended and state.forced_token() is None
    assert not state.take(4)  # the answer
    unlimited = ThinkingState(END, budget=None)
    assert all(unlimited.take(t) for t in range(10, 110)) and unlimited.forced_token() is None
    assert ThinkingState(END, budget=0).forced_token() == 7


def test_the_budget_forces_the_end_tokens_step_by_step():
    scheduler = create_scheduler()
    scheduler.add_request(
        create_request("t", max_tokens=12, reasoning_end_token_ids=END, thinking_token_budget=2)
    )
    scheduler.add_request(create_request("plain", max_tokens=6))
    forced = []
    for sampled in ([11], [12], [7], [8], [9], [14]):
        output, _ = step(scheduler, sampled={"t": sampled, "plain": [15]})
        forced.append(output.forced_token_ids.get("t"))
        assert "plain" not in output.forced_token_ids
    # Two thinking tokens, then 7, 8, 9 forced (the fake model samples them), then free.
    assert forced == [None, None, 7, 8, 9, None]
    assert scheduler.requests["t"].thinking.ended
    scheduler.finish_requests("t", scheduler.requests["t"].status.FINISHED_ABORTED)
    while scheduler.has_requests():
        step(scheduler)
    assert_no_leaked_blocks(scheduler)
    assert scheduler.live.num_thinking_budgets == 0


@pytest.fixture(scope="module")
def manager(tiny_llama_dir):
    manager = StructuredOutputManager(
        tiny_llama_dir, tiny_llama_dir, StructuredOutputsConfig(), max_num_seqs=16
    )
    yield manager
    manager.shutdown()


def test_the_grammar_constrains_only_the_answer(manager, tiny_llama_dir):
    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast.from_pretrained(tiny_llama_dir)
    digit, letter = tokenizer.encode("5")[0], tokenizer.encode("q")[0]
    end = tokenizer.encode("ab")
    scheduler = create_scheduler()
    scheduler.structured_output_manager = manager
    scheduler.add_request(
        create_request(
            "s",
            max_tokens=12,
            eos_token_id=TINY_EOS_TOKEN_ID,
            structured_outputs=StructuredOutputsParams(regex="[0-9]+"),
            reasoning_end_token_ids=end,
        )
    )
    for future in scheduler.pending_grammar_futures():
        future.exception(timeout=30)
    # Thinking: letters the grammar would refuse, and no bitmask row.
    for token in (letter, letter, *end):
        output, outputs = step(scheduler, sampled={"s": [token]})
        assert output.grammar_req_ids == [] and not any(o.error for o in outputs)
    # The answer: a bitmask row, and the grammar holds (a digit passes).
    output, outputs = step(scheduler, sampled={"s": [digit]})
    assert output.grammar_req_ids == ["s"] and not any(o.error for o in outputs)
    output, outputs = step(scheduler, sampled={"s": [letter]})
    assert "not allowed by the request's grammar" in outputs[0].error
    while scheduler.has_requests():
        step(scheduler)
    assert_no_leaked_blocks(scheduler)


def test_speculative_decoding_refuses_a_budget():
    checker = RequestChecker(None, 20, 1024, True, None, speculative=True)
    budgeted = create_request("b", reasoning_end_token_ids=END, thinking_token_budget=4)
    assert "speculative decoding" in checker.check(budgeted, False)
    assert checker.check(create_request("c", reasoning_end_token_ids=END), False) is None
    with pytest.raises(ValueError, match="reasoning_end_token_ids"):
        create_request("d", thinking_token_budget=4)
