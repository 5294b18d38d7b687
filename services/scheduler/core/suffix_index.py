"""A suffix index over token text, and drafts from the continuations of a context's matches.

Suffix decoding (Arctic Inference, arXiv 2411.04975) drafts from where the text so far
already occurred: find the earlier occurrences of the context's longest suffix, then follow
the continuation they agree on most, as far as the agreement stays likely. The paper keeps a
suffix tree; this index answers the same two questions (the occurrences of the context's
suffix and how often each next token follows them) from the text itself:

- `ends[(a, b)]`: every position where the token pair (a, b) ends, ascending. A context's
  candidate occurrences are those of its last pair, newest first; each one's match length is
  how far the text before it agrees with the context (a slice compare, at most `depth`).
  Where no earlier occurrence of the pair has a next token, those of its last token
  (`ends[a]`, match length 1): a one-token match drafts one token, which costs a verify step
  almost nothing.
- The draft walks forward from the occurrences that match at least m tokens: at each
  position the most frequent next token is taken, its frequency multiplied into the path's
  probability, and the occurrences that disagree are dropped (a suffix tree's node counts,
  without building the tree). One occurrence left: its continuation is copied at once.

Appending a token costs two dict appends; a proposal costs one dict lookup plus the work on
at most `max_candidates` occurrences. Several texts (a tenant's finished outputs) share one
index with `SEPARATOR` between them, which no token equals, so no match or draft crosses from
one text into the next; the oldest texts are dropped from the front (`drop_front`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

SEPARATOR = -1
# Pair keys: a * _PAIR + b, unique for token ids below 2**32 (SEPARATOR included).
_PAIR = 1 << 32
# Single-token keys: _ONE - token, below every pair key.
_ONE = -(2 * _PAIR)


@dataclass
class Draft:
    """A proposal and its score: the expected number of its tokens accepted (the sum of
    each prefix's estimated probability, `path_probs`). The proposer sets the other fields:
    what it was drafted from."""

    token_ids: list[int]
    score: float
    path_probs: list[float] = field(default_factory=list)
    match_len: int = 0
    source: int = 0  # which index it was copied from (suffix_acceptance.py)


NO_DRAFT = Draft([], 0.0)


class SuffixIndex:
    """Token text (one sequence, or several separated by SEPARATOR) and its pair index.

    Args:
        max_candidates: occurrences of the context's last pair examined per proposal,
            newest first (bounds the cost on very repetitive text).
    """

    def __init__(self, max_candidates: int = 32):
        self.max_candidates = max_candidates
        self.tokens: list[int] = []
        self.ends: dict[int, list[int]] = {}
        # Positions below `start` were dropped (drop_front); compacted away when they
        # outnumber the live ones.
        self.start = 0

    def __len__(self) -> int:
        return len(self.tokens) - self.start

    def extend(self, token_ids: list[int]) -> None:
        """Append tokens (SEPARATOR ends one text and starts the next)."""
        tokens, ends = self.tokens, self.ends
        prev = tokens[-1] if tokens else SEPARATOR
        pos = len(tokens)
        for token_id in token_ids:
            for key in (prev * _PAIR + token_id, _ONE - token_id):
                positions = ends.get(key)
                if positions is None:
                    ends[key] = [pos]
                else:
                    positions.append(pos)
            prev = token_id
            pos += 1
        tokens.extend(token_ids)

    def drop_front(self, num_tokens: int) -> None:
        """Forget the oldest num_tokens tokens (whole texts with their separators)."""
        self.start += num_tokens
        if self.start > len(self.tokens) - self.start:
            live = self.tokens[self.start :]
            self.tokens, self.ends, self.start = [], {}, 0
            self.extend(live)

    def matches(self, context: list[int], depth: int) -> list[tuple[int, int]]:
        """(end position, match length) of the earlier occurrences of the context's
        suffix that have a next token, newest first: those of its last pair (match lengths
        2 .. depth), or where it has none, those of its last token (match length 1).

        Args:
            context: the text to continue (its last tokens).
            depth: the longest match looked for.
        """
        if not context:
            return []
        depth = min(depth, len(context))
        found = []
        if len(context) >= 2:
            pair = context[-2] * _PAIR + context[-1]
            found = self._occurrences(pair, context[-depth:], self.start + 1)
        # No earlier occurrence of the pair has a next token: each of the last token's
        # matches 1 token exactly.
        return found or self._occurrences(_ONE - context[-1], None, self.start)

    def _occurrences(self, key: int, tail: list[int] | None, first: int) -> list[tuple[int, int]]:
        """(end position, match length with tail, 1 without) of the key's occurrences from
        position `first` on that have a next token, newest first, at most max_candidates."""
        positions = self.ends.get(key)
        if not positions:
            return []
        tokens, start, last = self.tokens, self.start, len(self.tokens) - 1
        found = []
        for pos in reversed(positions):
            if pos < first:
                break  # dropped texts (positions ascend)
            if pos >= last or tokens[pos + 1] == SEPARATOR:
                continue  # nothing follows it yet
            found.append((pos, 1 if tail is None else _match_length(tokens, pos, start, tail)))
            if len(found) >= self.max_candidates:
                break
        return found

    def draft(self, ends: list[int], max_len: int, min_prob: float) -> Draft:
        """The likeliest continuation of the occurrences ending at `ends`.

        Args:
            ends: end positions of the matched occurrences (each has a next token).
            max_len: tokens at most.
            min_prob: stop before a token whose path probability falls below this.
        """
        tokens, num = self.tokens, len(self.tokens)
        token_ids: list[int] = []
        path_probs: list[float] = []
        prob, score = 1.0, 0.0
        while len(token_ids) < max_len and ends:
            if len(ends) == 1:
                # One occurrence: its continuation, up to its text's end, at this probability.
                stop = min(num, ends[0] + 1 + max_len - len(token_ids))
                rest = tokens[ends[0] + 1 : stop]
                if SEPARATOR in rest:
                    rest = rest[: rest.index(SEPARATOR)]
                token_ids += rest
                path_probs += [prob] * len(rest)
                score += prob * len(rest)
                break
            counts: dict[int, int] = {}
            for pos in ends:
                if pos + 1 < num:
                    counts[tokens[pos + 1]] = counts.get(tokens[pos + 1], 0) + 1
            counts.pop(SEPARATOR, None)
            if not counts:
                break
            token_id = max(counts, key=counts.__getitem__)
            prob *= counts[token_id] / len(ends)
            if prob < min_prob:
                break
            token_ids.append(token_id)
            path_probs.append(prob)
            score += prob
            ends = [pos + 1 for pos in ends if pos + 1 < num and tokens[pos + 1] == token_id]
        return Draft(token_ids, score, path_probs)


def _match_length(tokens: list[int], pos: int, start: int, tail: list[int]) -> int:
    """How many tokens ending at pos equal the end of `tail` (its last token matched)."""
    depth = len(tail)
    if pos + 1 - depth >= start and tokens[pos + 1 - depth : pos + 1] == tail:
        return depth  # the common case in text that repeats: one slice compare
    length = 1
    while length < depth and pos - length >= start and tokens[pos - length] == tail[-1 - length]:
        length += 1
    return length
