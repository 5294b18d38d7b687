"""N-gram (prompt lookup) proposer: the tokens that followed the last occurrence of the
request's final n tokens, searched over its prompt and output.

Text that repeats (editing a passage, rewriting code, quoting the prompt) makes these
guesses right often, at no model cost. Longer n-grams are tried first (prompt_lookup_max
down to prompt_lookup_min); within one n the most recent earlier occurrence wins. The search
is one vectorised comparison over all windows of the sequence: no per-token Python loop.
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


class NgramProposer:
    """
    Args:
        min_n, max_n: the n-gram lengths matched (prompt_lookup_min / _max).
    """

    def __init__(self, min_n: int, max_n: int):
        assert 1 <= min_n <= max_n, (min_n, max_n)
        self.min_n = min_n
        self.max_n = max_n

    def propose_one(self, token_ids: np.ndarray, k: int) -> list[int]:
        """Up to k tokens after the latest earlier match of the sequence's suffix.

        Args:
            token_ids: [L] the request's tokens (prompt + output), the last one included.
            k: drafts wanted (> 0).

        Example: tokens [a b c d a b], n = 2: the suffix [a b] occurred at 0, so the
        proposal is [c d a ...] up to k tokens (they may run into the suffix itself).
        """
        num_tokens = len(token_ids)
        for n in range(min(self.max_n, num_tokens - 1), self.min_n - 1, -1):
            suffix = token_ids[num_tokens - n :]
            # Windows that start early enough to have a following token: 0 .. L - n - 1.
            windows = sliding_window_view(token_ids[: num_tokens - 1], n)
            matches = np.flatnonzero((windows == suffix).all(axis=1))
            if len(matches):
                start = int(matches[-1]) + n
                return token_ids[start : start + k].tolist()
        return []

    def propose(self, sequences: list[np.ndarray], num_drafts: list[int]) -> list[list[int]]:
        """One proposal per request (empty when nothing matches)."""
        return [
            self.propose_one(tokens, k) if k > 0 else [] for tokens, k in zip(sequences, num_drafts)
        ]
