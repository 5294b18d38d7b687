"""Speculative decoding in the scheduler: drafts as extra query tokens, rollback of the
rejected ones, the caps on drafts, lookahead slots, no hashing of unverified tokens, no
leaks, and the adaptive rule (services/scheduler/core/spec_decode.py)."""

from __future__ import annotations

import pytest

from kvserve.services.scheduler.core.request import RequestStatus
from kvserve.services.scheduler.core.spec_decode import (
    SpecDecodePolicy,
    SpecRequestState,
    StepCostModel,
)
from kvserve.shared.config import SpeculativeConfig
from kvserve.shared.hashing import get_hash_fn, hash_new_full_blocks
from tests.support.kv import assert_no_leaked_blocks
from tests.support.scheduler import create_request, create_scheduler, make_runner_output, step

NGRAM = SpeculativeConfig(method="ngram", num_speculative_tokens=4, adaptive=False)
DRAFT = SpeculativeConfig(
    method="draft_model", num_speculative_tokens=3, num_draft_layers=1, adaptive=False
)


def _decoding(scheduler, req_id="a", num_tokens=10, **kwargs):
    """The scheduler with one request added (its first step is the prefill)."""
    scheduler.add_request(create_request(req_id, num_tokens=num_tokens, **kwargs))
    return scheduler


def test_drafts_are_extra_query_tokens_and_rejected_ones_roll_back():
    scheduler = _decoding(create_scheduler(speculative_config=NGRAM, block_size=4))
    so, _ = step(scheduler, spec_token_ids={"a": [11, 12, 13, 14]})
    assert so.spec_decode.num_to_propose == {"a": 4}  # the prefill samples, then proposes
    request = scheduler.requests["a"]
    assert request.num_computed_tokens == 10 and request.num_tokens == 11

    so = scheduler.schedule()
    assert so.spec_decode.draft_token_ids == {"a": [11, 12, 13, 14]}
    assert so.num_scheduled_tokens == {"a": 5}  # the last token + 4 drafts
    assert so.spec_decode.num_to_propose == {"a": 4}
    assert request.num_computed_tokens == 15
    # The target agrees with 11 and 12, then samples 99 instead of 13.
    out = make_runner_output(scheduler, so, {"a": [11, 12, 99]}, {"a": [31, 32]})
    (output,) = scheduler.update_from_output(so, out)
    assert output.new_token_ids == [11, 12, 99]
    assert request.num_tokens == 14 and request.num_computed_tokens == 13
    assert request.spec.draft_token_ids == [31, 32]
    stats = scheduler.make_stats()
    assert (stats.spec_num_drafts, stats.spec_num_draft_tokens) == (1, 4)
    assert stats.spec_num_accepted_tokens == 2
    assert stats.spec_accepted_per_pos == [1, 1, 0, 0]
    assert scheduler.make_stats().spec_num_drafts == 0  # counters restart

    so = scheduler.schedule()
    assert so.spec_decode.draft_token_ids == {"a": [31, 32]}
    assert so.num_scheduled_tokens == {"a": 3}
    scheduler.update_from_output(so, make_runner_output(scheduler, so, {"a": [31, 32, 33]}))
    assert request.num_computed_tokens == request.num_tokens - 1 == 16
    scheduler.finish_requests("a", RequestStatus.FINISHED_ABORTED)
    assert_no_leaked_blocks(scheduler)


def test_unverified_tokens_are_never_hashed():
    block_size = 4
    scheduler = _decoding(
        create_scheduler(speculative_config=NGRAM, block_size=block_size), num_tokens=6
    )
    step(scheduler, spec_token_ids={"a": [21, 22, 23, 24]})
    request = scheduler.requests["a"]
    so = scheduler.schedule()
    assert so.num_scheduled_tokens == {"a": 5}  # slots up to 11 tokens: 3 blocks
    manager = scheduler.kv_cache_manager
    assert len(manager.req_to_blocks["a"]) == 3
    # Only the 7 verified tokens are hashed: one full block of 4.
    assert len(request.block_hashes) == 1
    assert manager.num_cached_block["a"] == 1
    # Everything rejected: the block holding the drafts' slots is not cached either.
    scheduler.update_from_output(so, make_runner_output(scheduler, so, {"a": [50]}))
    assert request.all_token_ids[-1] == 50 and request.num_tokens == 8
    expected = hash_new_full_blocks(
        get_hash_fn("sha256"), block_size, request.all_token_ids, [], request.extra_keys
    )
    assert request.block_hashes == expected  # the hashes of verified tokens only
    cached = set(manager.block_pool.cached_block_hash_to_block)
    assert cached <= set(expected)
    scheduler.finish_requests("a", RequestStatus.FINISHED_ABORTED)
    assert_no_leaked_blocks(scheduler)


def test_drafts_are_capped_by_budget_max_tokens_and_max_model_len():
    # The budget: 3 tokens in the step leave room for 2 drafts.
    scheduler = _decoding(
        create_scheduler(speculative_config=NGRAM, max_num_batched_tokens=3, max_model_len=64),
        num_tokens=2,
    )
    step(scheduler, spec_token_ids={"a": [1, 2, 3, 4]})
    so = scheduler.schedule()
    assert so.spec_decode.draft_token_ids == {"a": [1, 2]}
    assert so.num_scheduled_tokens == {"a": 3}

    # max_tokens: one output and max_tokens 3 leave one more token after the step's own.
    scheduler = _decoding(create_scheduler(speculative_config=NGRAM), max_tokens=3)
    step(scheduler, spec_token_ids={"a": [1, 2, 3, 4]})
    so = scheduler.schedule()
    assert so.spec_decode.draft_token_ids == {"a": [1]}

    # max_model_len 13 and 11 tokens: slots for 2 more positions, the last token's and one.
    scheduler = _decoding(
        create_scheduler(speculative_config=NGRAM, max_model_len=13), max_tokens=None
    )
    step(scheduler, spec_token_ids={"a": [1, 2, 3, 4]})
    so = scheduler.schedule()
    assert so.spec_decode.draft_token_ids == {"a": [1, 2]}


def test_a_draft_model_gets_lookahead_slots():
    scheduler = _decoding(
        create_scheduler(speculative_config=DRAFT, block_size=4), num_tokens=8, max_tokens=50
    )
    step(scheduler, spec_token_ids={"a": [1, 2, 3]})
    so = scheduler.schedule()
    assert so.num_scheduled_tokens == {"a": 4}
    assert so.spec_decode.num_to_propose == {"a": 3}
    # 8 computed + 4 new + 3 lookahead slots = 15 tokens: 4 blocks of 4.
    assert len(scheduler.kv_cache_manager.req_to_blocks["a"]) == 4
    scheduler.finish_requests("a", RequestStatus.FINISHED_ABORTED)
    assert_no_leaked_blocks(scheduler)


def test_preemption_drops_drafts_and_nothing_leaks():
    scheduler = create_scheduler(
        speculative_config=NGRAM, block_size=4, num_blocks=7, max_model_len=24
    )
    for req_id in "ab":
        scheduler.add_request(create_request(req_id, num_tokens=8, max_tokens=10))
    step(scheduler, spec_token_ids={"a": [11, 12, 13, 14], "b": [15, 16, 17, 18]})
    # 6 usable blocks: 9 tokens and 4 drafts need 4 blocks each: b is preempted.
    so, _ = step(scheduler, sampled={"a": [11, 12, 13, 14, 9]})
    assert so.preempted_req_ids == ["b"]
    assert scheduler.requests["b"].spec.draft_token_ids == []
    for _ in range(100):
        if not scheduler.has_requests():
            break
        step(scheduler)
    assert_no_leaked_blocks(scheduler)


def test_structured_output_requests_never_speculate():
    scheduler = create_scheduler(speculative_config=NGRAM)
    scheduler.add_request(create_request("a"))
    assert scheduler.requests["a"].spec is not None
    no_spec = create_scheduler()
    no_spec.add_request(create_request("a"))
    assert no_spec.requests["a"].spec is None


# ----------------------------------------------------------------------------- the rule


def _states(*acceptances):
    states = []
    for acceptance in acceptances:
        state = SpecRequestState()
        state.acceptance = acceptance
        states.append(state)
    return states


ADAPTIVE = SpeculativeConfig(method="ngram", num_speculative_tokens=4)
# A bandwidth-bound CPU step: 40 ms, +0.5 ms per extra token up to 16, then compute-bound.
BANDWIDTH_BOUND = [(1, 0.040), (16, 0.0475), (64, 0.19), (256, 0.76)]


def test_high_acceptance_takes_every_draft_and_low_takes_none():
    policy = SpecDecodePolicy(ADAPTIVE, BANDWIDTH_BOUND)
    assert policy.num_to_propose(_states(0.9), [4], 1) == [4]
    assert policy.num_to_propose(_states(0.005), [4], 1) == [0]
    # Mixed: the predictable request speculates, the unpredictable one does not.
    assert policy.num_to_propose(_states(0.8, 0.005), [4, 4], 2) == [4, 0]


def test_a_compute_bound_batch_turns_speculation_off():
    policy = SpecDecodePolicy(ADAPTIVE, BANDWIDTH_BOUND)
    # 32 requests at 0.6 acceptance: the step is already past the knee, and no request
    # probes (a sure draft would not pay either).
    states = _states(*[0.6] * 32)
    for _ in range(40):
        assert policy.num_to_propose(states, [4] * 32, 32) == [0] * 32
    assert sum(policy.num_to_propose(_states(*[0.6] * 2), [4] * 2, 2)) > 0


def test_caps_disable_by_batch_size_and_the_non_adaptive_mode():
    policy = SpecDecodePolicy(ADAPTIVE, BANDWIDTH_BOUND)
    assert policy.num_to_propose(_states(0.9, 0.9), [2, 0], 2) == [2, 0]
    capped = SpeculativeConfig(method="ngram", num_speculative_tokens=4, disable_by_batch_size=2)
    assert SpecDecodePolicy(capped, []).num_to_propose(_states(0.9, 0.9), [4, 4], 2) == [0, 0]
    fixed = SpeculativeConfig(method="ngram", num_speculative_tokens=3, adaptive=False)
    assert SpecDecodePolicy(fixed, BANDWIDTH_BOUND).num_to_propose(_states(0.0), [5], 1) == [3]


def test_a_request_turned_off_probes_again():
    policy = SpecDecodePolicy(ADAPTIVE, BANDWIDTH_BOUND)
    (state,) = _states(0.001)
    proposals = [policy.num_to_propose([state], [4], 1)[0] for _ in range(40)]
    assert proposals.count(1) == 2 and set(proposals) == {0, 1}
    # Drafts that keep being accepted bring the acceptance, and the drafts, back.
    for _ in range(20):
        state.record(4, 4)
    assert policy.num_to_propose([state], [4], 1) == [4]


def test_acceptance_is_an_ewma():
    state = SpecRequestState()
    state.acceptance = 0.5
    state.record(4, 4)
    assert state.acceptance == pytest.approx(0.5 + 0.3 * 0.5)
    state.record(0, 0)  # no drafts: nothing learned
    assert state.acceptance == pytest.approx(0.65)


def test_step_cost_model_interpolates_and_extrapolates():
    model = StepCostModel([(1, 1.0), (4, 1.3), (8, 2.1)])
    assert model(1) == 1.0 and model(2) == pytest.approx(1.1)
    assert model(16) == pytest.approx(2.1 + 0.2 * 8)
    assert StepCostModel([])(10) == pytest.approx(1.0 + 0.02 * 9)


def test_drafts_that_cost_more_than_modelled_turn_themselves_off():
    policy = SpecDecodePolicy(ADAPTIVE, BANDWIDTH_BOUND)
    states = _states(*[0.8] * 4)
    assert sum(policy.num_to_propose(states, [4] * 4, 4)) > 0
    # The engine measures drafting steps at 3x what the forward model says.
    for _ in range(20):
        policy.record_step(12, 3 * policy.step_cost_model(12), verified_drafts=True)
        policy.record_step(4, policy.step_cost_model(4), verified_drafts=False)
    assert policy.spec_ratio > 2
    assert policy.num_to_propose(states, [4] * 4, 4) == [0] * 4
    # Steps without drafts bring the estimate back, and with it the drafts.
    for _ in range(300):
        policy.record_step(4, policy.step_cost_model(4), verified_drafts=False)
    assert policy.spec_ratio < 1.05
    assert sum(policy.num_to_propose(states, [4] * 4, 4)) > 0
