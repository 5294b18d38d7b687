"""Suffix decoding in the scheduler (suffix_index.py, suffix_proposer.py): drafts come from
where the text already occurred, their length follows the match and its agreement, finished
outputs draft for later requests of the same tenant only, and the scheduler asks the
proposer for drafts when the step's tokens come back."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve.services.scheduler.core.request import Request, RequestStatus
from kvserve.services.scheduler.core.suffix_index import SEPARATOR, SuffixIndex
from kvserve.services.scheduler.core.suffix_proposer import SuffixProposer, TenantOutputs
from kvserve.shared.config import SpeculativeConfig
from kvserve.shared.sampling_params import SamplingParams
from tests.support.kv import assert_no_leaked_blocks
from tests.support.scheduler import create_request, create_scheduler, step


def suffix_config(**knobs) -> SpeculativeConfig:
    knobs.setdefault("num_speculative_tokens", 8)
    return SpeculativeConfig(method="suffix", adaptive=False, **knobs)


def make_request(req_id, prompt, tenant="default", output=()) -> Request:
    request = Request(req_id, prompt, SamplingParams(max_tokens=100), None, 0.0, tenant=tenant)
    request.append_output_token_ids(list(output))
    return request


def occurs_in(needle: list[int], haystack: list[int]) -> bool:
    n = len(needle)
    return any(haystack[i : i + n] == needle for i in range(len(haystack) - n + 1))


texts = st.lists(st.lists(st.integers(0, 4), min_size=1, max_size=40), min_size=1, max_size=4)


@settings(max_examples=200, deadline=None)
@given(texts=texts, context=st.lists(st.integers(0, 4), min_size=2, max_size=12))
def test_every_draft_continues_an_occurrence_of_the_context_in_one_text(texts, context):
    index = SuffixIndex()
    for text in texts:
        index.extend(text + [SEPARATOR])
    proposer = SuffixProposer(suffix_config(suffix_decoding_max_tree_depth=16))
    found = index.matches(context, 15)
    for pos, match_len in found:
        # The match is real: the text ending at pos equals the context's last match_len.
        assert index.tokens[pos + 1 - match_len : pos + 1] == context[-match_len:]
    draft = proposer._draft(index, context, 8)
    assert len(draft.token_ids) <= 8
    if draft.token_ids:
        match_len = proposer._match_length(max(m for _, m in found), 8)[0]
        drafted = context[-match_len:] + draft.token_ids
        assert any(occurs_in(drafted, text) for text in texts), (drafted, texts)


@settings(max_examples=100, deadline=None)
@given(text=st.lists(st.integers(0, 3), min_size=3, max_size=60), cut=st.integers(2, 60))
def test_the_requests_own_text_drafts_a_copy_of_an_earlier_occurrence(text, cut):
    """The draft is what followed an earlier occurrence of the context's last pair, or of
    its last token where the pair has no earlier occurrence (then one token)."""
    proposer = SuffixProposer(suffix_config(suffix_decoding_min_token_prob=0.0))
    request = make_request("r", text[: min(cut, len(text))])
    draft = proposer.propose(request, [], 8)
    tokens = request.all_token_ids
    if occurs_in(tokens[-2:], tokens[:-1]):
        assert occurs_in(tokens[-2:] + draft, tokens)
    else:
        assert len(draft) <= 1 and occurs_in(tokens[-1:] + draft, tokens)


def test_draft_length_follows_the_match_and_the_tree_depth():
    body = list(range(100, 140))
    # The prompt holds body once; the output repeats its first 20 tokens: a 20-token match.
    proposer = SuffixProposer(
        suffix_config(num_speculative_tokens=32, suffix_decoding_max_tree_depth=64)
    )
    request = make_request("r", [1, 2, *body, 3], output=body[:20])
    assert proposer.propose(request, [], 32) == body[20:40]  # min(32, 1.0 * 20, 64 - 20)
    # A shallow tree leaves room for depth - m tokens: m = 12 gives 12 of the 24.
    shallow = SuffixProposer(suffix_config(num_speculative_tokens=32))
    assert shallow.propose(request, [], 32) == body[20:32]
    # A smaller spec factor drafts fewer tokens for the same match.
    half = SuffixProposer(suffix_config(suffix_decoding_max_spec_factor=0.25))
    assert len(half.propose(request, [], 8)) == 4  # m = 16 of the 20, 0.25 * 16


def test_a_context_whose_last_pair_never_occurred_drafts_one_token():
    index = SuffixIndex()
    index.extend([5, 6, 7, 5, 8, 9, 5])
    # (9, 5) occurs only at the end: the earlier 5s match 1 token each, newest first.
    assert index.matches([9, 5], 8) == [(3, 1), (0, 1)]
    assert index.matches([7, 5], 8) == [(3, 2)]  # the pair occurred: only it
    proposer = SuffixProposer(suffix_config(suffix_decoding_min_token_prob=0.0))
    # The 5s were followed by 6 and by 8: one token of the newest's, at probability 1/2.
    assert proposer.propose(make_request("r", [5, 6, 7, 5, 8, 9, 5]), [], 8) in ([6], [8])
    assert proposer.propose(make_request("s", [5, 6, 7, 9, 5]), [], 8) == [6]
    assert SuffixProposer(suffix_config()).propose(make_request("t", [1, 2, 3]), [], 8) == []


def test_continuations_that_disagree_lower_the_path_probability():
    # "7 8" was followed by 1 twice and by 2 twice: each next token has probability 1/2.
    prompt = [7, 8, 1, 5, 7, 8, 2, 6, 7, 8, 1, 5, 7, 8, 2, 6, 9, 7, 8]
    strict = SuffixProposer(suffix_config(suffix_decoding_min_token_prob=0.6))
    assert strict.propose(make_request("r", prompt), [], 8) == []
    loose = SuffixProposer(suffix_config(suffix_decoding_min_token_prob=0.4))
    assert loose.propose(make_request("r", prompt), [], 8)[0] in (1, 2)


def test_new_tokens_count_before_they_are_appended():
    proposer = SuffixProposer(suffix_config())
    request = make_request("r", [4, 5, 6, 7, 8, 9, 4, 5])
    assert proposer.propose(request, [6], 3) == [7, 8, 9]
    request.append_output_token_ids(6)
    assert proposer.propose(request, [7, 8], 2) == [9, 4]
    assert proposer.propose(request, [], 0) == []  # no drafts wanted: nothing done


def test_finished_outputs_draft_for_their_own_tenant_only():
    proposer = SuffixProposer(suffix_config())
    answer = list(range(200, 230))
    finished = make_request("a1", [1, 2, 3], tenant="acme", output=answer)
    proposer.free(finished)
    # A later request of acme that starts the same answer gets the rest drafted...
    same = make_request("a2", [9, 9, 9], tenant="acme", output=answer[:12])
    assert proposer.propose(same, [], 8) == answer[12:20]
    # ...one of another tenant with the same text does not.
    other = make_request("b1", [9, 9, 9], tenant="globex", output=answer[:12])
    assert proposer.propose(other, [], 8) == []
    proposer.free(same)
    proposer.free(other)
    assert set(proposer.outputs.indexes) == {("acme", None), ("globex", None)}
    assert not proposer.requests


def test_cached_outputs_are_bounded_oldest_first():
    outputs = TenantOutputs(max_cached_requests=2)
    for i in range(5):
        outputs.add(("t", None), [10 * i + 1, 10 * i + 2, 10 * i + 3])
        outputs.add(("u", None), [7, 7, 7])
    assert len(outputs.order) == 2 and outputs.num_tokens == 8
    index = outputs.index_of(("t", None))
    assert index is not None and len(index) == 4  # the last output and its separator
    assert index.matches([41, 42], 8) == [(len(index.tokens) - 3, 2)]
    assert index.matches([31, 32], 8) == []  # dropped


def test_the_scheduler_drafts_from_the_requests_own_prompt():
    config = suffix_config(num_speculative_tokens=4)
    scheduler = create_scheduler(speculative_config=config, block_size=4)
    prompt = [50, 51, 52, 53, 54, 55, 56, 50, 51]
    scheduler.add_request(create_request("a", prompt_token_ids=prompt, max_tokens=20))
    so, _ = step(scheduler, sampled={"a": [52]})  # the prefill; the worker proposes nothing
    assert so.spec_decode.num_to_propose == {"a": 4}
    request = scheduler.requests["a"]
    # "50 51 52" matched 3 tokens: 3 drafts (max_spec_factor 1).
    assert request.spec.draft_token_ids == [53, 54, 55]
    so, _ = step(scheduler, sampled={"a": [53, 54, 60]})
    assert so.spec_decode.draft_token_ids == {"a": [53, 54, 55]}
    assert request.num_computed_tokens == request.num_tokens - 1
    scheduler.finish_requests("a", RequestStatus.FINISHED_ABORTED)
    assert not scheduler.spec_decode.proposer.requests
    step(scheduler)
    assert_no_leaked_blocks(scheduler)
