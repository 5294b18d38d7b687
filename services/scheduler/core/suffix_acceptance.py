"""How likely each token of a suffix draft is accepted, learned from the target's own tokens.

A suffix draft is a copy of where the text already occurred, so its tokens are not accepted
independently with one rate alpha (the adaptive rule's alpha ** j): a copy that follows a
long match is usually right token after token until the text departs from its model (an
edited spot), while a copy after a 2-token match is often wrong at once. So the chance that
a draft token is right is learned per match length at that token: a draft made on a match of
m tokens drafts its i-th token at match m + i - 1 (the tokens before it extend the match when
they are accepted). Match lengths fall into buckets of about sqrt(2) growth; each bucket
counts the tokens tried there and those the target agreed with, per source (the request's
own text, its tenant's finished outputs), halved when the count grows large so the model
follows a change of text.

The evidence comes for free: each step's sampled tokens are the target's choices at the
draft's first positions, verified or not, so a trimmed draft (even one trimmed to nothing)
still says whether its first tokens were right.

A draft's expected accepted tokens (`gains`): the j-th entry is the chance that its first j
tokens are all accepted, the product of the per-token chances (times the suffix index's own
path-probability ratio where the continuations disagreed).
"""

from __future__ import annotations

import math

# Weight of each bucket's prior, in tokens tried (_prior_chance).
_PRIOR_TRIED = 2.0
# Counts are halved when a bucket has seen this many tokens.
_MAX_TRIED = 512.0
_NUM_BUCKETS = 16
# Where a draft was copied from, each with its own measured chances: the request's own text,
# its tenant's finished outputs.
OWN_TEXT, TENANT_OUTPUTS = 0, 1
NUM_SOURCES = 2


def _prior_chance(bucket: int) -> float:
    """Before any evidence: m / (m + 1) for the bucket's shortest match m (a copy that has
    held for longer is likelier to hold on)."""
    match_len = math.ceil(2 ** (bucket / 2))
    return match_len / (match_len + 1)


def _bucket(match_len: int) -> int:
    return min(int(2 * math.log2(max(match_len, 1))), _NUM_BUCKETS - 1)


# Every bucket from 256 on is the last; a table up to there saves the log per token.
_BUCKETS = [_bucket(m) for m in range(256)]


def bucket_of(match_len: int) -> int:
    """Match lengths 1, 2, 3, 4-5, 6-7, 8-11, 12-15, 16-22, ... (about sqrt(2) apart)."""
    return _BUCKETS[match_len] if match_len < 256 else _NUM_BUCKETS - 1


class DraftAcceptance:
    """Per source and match-length bucket: tokens tried and accepted (see the module)."""

    def __init__(self) -> None:
        prior = [_PRIOR_TRIED * _prior_chance(b) for b in range(_NUM_BUCKETS)]
        self.tried = [[_PRIOR_TRIED] * _NUM_BUCKETS for _ in range(NUM_SOURCES)]
        self.accepted = [list(prior) for _ in range(NUM_SOURCES)]

    def chance(self, source: int, match_len: int) -> float:
        """The measured chance that a token drafted at this match length is right."""
        b = bucket_of(match_len)
        return self.accepted[source][b] / self.tried[source][b]

    def observe(
        self, source: int, match_len: int, draft: list[int], target_token_ids: list[int]
    ) -> None:
        """Count the draft's tokens the target has decided on: each one up to and including
        the first the target disagreed with."""
        tried, accepted = self.tried[source], self.accepted[source]
        for i, (drafted, target) in enumerate(zip(draft, target_token_ids)):
            b = bucket_of(match_len + i)
            if tried[b] >= _MAX_TRIED:
                tried[b] /= 2
                accepted[b] /= 2
            tried[b] += 1
            if drafted != target:
                return
            accepted[b] += 1

    def gains(self, source: int, match_len: int, path_probs: list[float]) -> list[float]:
        """Chance that the draft's first j tokens are all accepted, for j = 1 .. len.

        Args:
            source: where the draft was copied from.
            match_len: the match it was drafted on.
            path_probs: the suffix index's path probability after each draft token.
        """
        tried, accepted = self.tried[source], self.accepted[source]
        gains = []
        prob, prev_path = 1.0, 1.0
        for i, path in enumerate(path_probs):
            b = bucket_of(match_len + i)
            prob *= accepted[b] / tried[b]
            if path != prev_path:
                prob *= path / prev_path
                prev_path = path
            gains.append(prob)
        return gains
