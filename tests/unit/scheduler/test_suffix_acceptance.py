"""Suffix drafts scored by their measured acceptance (suffix_acceptance.py) and trimmed to
the prefix that pays (SpecDecodePolicy.num_worth_verifying), in place of alpha ** j."""

from __future__ import annotations

from kvserve.services.scheduler.core.request import Request
from kvserve.services.scheduler.core.spec_decode import SpecDecodePolicy, StepCostModel
from kvserve.services.scheduler.core.suffix_acceptance import DraftAcceptance, bucket_of
from kvserve.services.scheduler.core.suffix_proposer import SuffixProposer
from kvserve.shared.config import SpeculativeConfig
from kvserve.shared.sampling_params import SamplingParams
from tests.support.scheduler import create_request, create_scheduler, step

# A CPU-like verify cost: 33 query tokens cost 6x one (bench/spec_decode/README.md).
STEP_COSTS = [(1, 0.039), (2, 0.037), (4, 0.069), (8, 0.116), (16, 0.158), (32, 0.243)]


def suffix_config(**knobs) -> SpeculativeConfig:
    knobs.setdefault("num_speculative_tokens", 32)
    knobs.setdefault("suffix_decoding_max_tree_depth", 64)
    return SpeculativeConfig(method="suffix", **knobs)


def test_tokens_count_up_to_the_first_the_target_disagreed_with():
    model = DraftAcceptance()
    before = [list(row) for row in model.tried], [list(row) for row in model.accepted]
    # Drafted at match 4: tokens at matches 4, 5, 6, 7; the target agreed with two.
    model.observe(0, 4, [1, 2, 3, 4], [1, 2, 9, 4])
    tried = [a - b for a, b in zip(model.tried[0], before[0][0])]
    accepted = [a - b for a, b in zip(model.accepted[0], before[1][0])]
    # Matches 4 and 5 share a bucket (4-5), 6 and 7 the next; the 4th token is not counted.
    assert bucket_of(4) == bucket_of(5) != bucket_of(6) == bucket_of(7)
    assert tried[bucket_of(4)] == 2 and accepted[bucket_of(4)] == 2
    assert tried[bucket_of(6)] == 1 and accepted[bucket_of(6)] == 0
    assert sum(tried) == 3 and model.tried[1] == before[0][1]  # the other source untouched


def test_the_chance_follows_what_was_measured_at_that_match_length():
    model = DraftAcceptance()
    prior_short, prior_long = model.chance(0, 2), model.chance(0, 30)
    assert prior_short < prior_long  # a copy that has held is likelier to hold on
    for _ in range(50):
        model.observe(0, 2, [1], [7])  # short matches: wrong
        model.observe(0, 30, [1, 2], [1, 2])  # long matches: right
    assert model.chance(0, 2) < 0.1 < prior_short
    assert model.chance(0, 30) > prior_long
    # Counts are bounded: old evidence fades so a change of text is followed.
    for _ in range(2000):
        model.observe(0, 2, [1], [1])
    assert model.chance(0, 2) > 0.9


def test_gains_are_the_chance_of_each_prefix_times_the_path_probability():
    model = DraftAcceptance()
    gains = model.gains(1, 8, [1.0, 1.0, 0.5])
    c = [model.chance(1, m) for m in (8, 9, 10)]
    assert gains == [c[0], c[0] * c[1], c[0] * c[1] * c[2] * 0.5]


def test_a_sure_copy_is_verified_whole_and_an_unsure_one_not_at_all():
    policy = SpecDecodePolicy(suffix_config(), STEP_COSTS)
    assert policy.num_worth_verifying([0.99**j for j in range(1, 33)]) == 32
    assert policy.num_worth_verifying([0.3**j for j in range(1, 33)]) <= 1
    # All or nothing: 4 sure-ish tokens do not pay for their step, 32 of them do (the
    # rule weighs every length, not only the first that stops paying).
    gains = [0.5] * 32
    assert policy.num_worth_verifying(gains[:3]) == 1  # 2 tokens cost less than 1 here
    assert policy.num_worth_verifying(gains) == 32
    assert policy.num_worth_verifying([]) == 0


def test_a_proposal_is_scored_and_learned_from_the_next_steps_tokens():
    body = list(range(100, 140))
    proposer = SuffixProposer(suffix_config())
    request = Request("r", [1, 2, *body, 3, *body[:20]], SamplingParams(max_tokens=100), None, 0.0)
    draft = proposer.propose(request, [], 32)
    assert draft == body[20:40]
    gains = proposer.expected_accepted(request)
    assert len(gains) == 20 and all(a > b for a, b in zip(gains, gains[1:]))
    tried = sum(proposer.acceptance.tried[0])
    # Even a draft trimmed to nothing is learned from: the step's token was its first.
    proposer.propose(request, [body[20]], 32)
    assert sum(proposer.acceptance.tried[0]) == tried + 1
    request.append_output_token_ids(body[20])
    proposer.free(request)
    assert proposer.expected_accepted(request) == []


def test_the_scheduler_proposes_up_to_the_cap_and_keeps_the_prefix_that_pays():
    config = suffix_config(num_speculative_tokens=16)
    scheduler = create_scheduler(speculative_config=config, block_size=4)
    scheduler.spec_decode.policy.step_cost_model = StepCostModel(STEP_COSTS)
    body = list(range(100, 140))
    prompt = [1, 2, *body, 3, *body[:24]]
    scheduler.add_request(create_request("a", prompt_token_ids=prompt, max_tokens=60))
    so, _ = step(scheduler, sampled={"a": [body[24]]})
    assert so.spec_decode.num_to_propose == {"a": 16}  # the cap, not alpha ** j's count
    request = scheduler.requests["a"]
    proposer = scheduler.spec_decode.proposer
    kept = scheduler.spec_decode.policy.num_worth_verifying(proposer.expected_accepted(request))
    assert 0 < kept and request.spec.draft_token_ids == [*body, 3, *body][25 : 25 + kept]
