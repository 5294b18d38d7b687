"""The n-gram (prompt lookup) proposer."""

from __future__ import annotations

import numpy as np

from kvserve.services.worker.spec_decode.ngram import NgramProposer


def _propose(tokens, k, min_n=1, max_n=3):
    return NgramProposer(min_n, max_n).propose_one(np.array(tokens, dtype=np.int64), k)


def test_the_longest_suffix_match_wins():
    # Suffix [5 6 7] occurred once (followed by 8 9); [7] alone is also followed by 1.
    assert _propose([5, 6, 7, 8, 9, 7, 1, 5, 6, 7], 2) == [8, 9]
    assert _propose([5, 6, 7, 8, 9, 7, 1, 5, 6, 7], 2, max_n=1) == [1, 5]


def test_the_most_recent_occurrence_wins_within_one_length():
    assert _propose([1, 2, 3, 1, 2, 4, 1, 2], 1, min_n=2, max_n=2) == [4]


def test_proposals_may_run_into_the_suffix_and_stop_at_the_end():
    assert _propose([1, 2, 1, 2], 5, min_n=2, max_n=2) == [1, 2]
    assert _propose([3, 3, 3], 4, min_n=1, max_n=1) == [3]


def test_no_match_and_short_sequences_propose_nothing():
    assert _propose([1, 2, 3, 4], 3) == []
    assert _propose([1], 3) == []
    assert _propose([1, 2, 3, 1, 2], 3, min_n=3, max_n=3) == []


def test_batch_propose_skips_requests_that_want_none():
    proposer = NgramProposer(1, 2)
    seqs = [np.array([1, 2, 1], dtype=np.int64), np.array([4, 4], dtype=np.int64)]
    assert proposer.propose(seqs, [2, 0]) == [[2, 1], []]
