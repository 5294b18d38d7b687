"""A request's thinking, as the scheduler follows it (SamplingParams.reasoning_end_token_ids,
.thinking_token_budget).

A request with end tokens starts out thinking: each output token counts as thinking until the
output ends with the end tokens. Structured outputs constrain only the answer after them (the
scheduler feeds the grammar no thinking token and sends no bitmask row while the request
thinks). With a budget, once that many thinking tokens are out the engine forces the end
tokens: the next step samples only the next of them (SchedulerOutput.forced_token_ids), and
so on until they are all out, whatever the model would have said. Where the model had begun
the end tokens itself, the forcing goes on from there.
"""

from __future__ import annotations


class ThinkingState:
    """Args:
    end_token_ids: the tokens that end the thinking.
    budget: thinking tokens allowed before the end is forced (None: no limit).
    """

    __slots__ = ("budget", "end_token_ids", "ended", "num_tokens", "_tail")

    def __init__(self, end_token_ids: list[int], budget: int | None):
        self.end_token_ids = list(end_token_ids)
        self.budget = budget
        self.num_tokens = 0  # thinking tokens so far, the end tokens included
        self.ended = False
        self._tail: list[int] = []  # the last len(end_token_ids) tokens

    def take(self, token_id: int) -> bool:
        """Count a sampled token; True when it belongs to the thinking (the end tokens do),
        False once the thinking is over (an answer token)."""
        if self.ended:
            return False
        self.num_tokens += 1
        self._tail.append(token_id)
        del self._tail[: -len(self.end_token_ids)]
        self.ended = self._tail == self.end_token_ids
        return True

    def forced_token(self) -> int | None:
        """The token the next step must sample: with the budget spent and the thinking not
        ended, the next end token (after the longest start of them the output ends with)."""
        if self.ended or self.budget is None or self._num_budgeted() < self.budget:
            return None
        return self.end_token_ids[self._end_prefix_len()]

    def _num_budgeted(self) -> int:
        """Thinking tokens that count against the budget: not the end tokens being forced."""
        return self.num_tokens - self._end_prefix_len()

    def _end_prefix_len(self) -> int:
        end = self.end_token_ids
        for length in range(min(len(end) - 1, len(self._tail)), 0, -1):
            if self._tail[-length:] == end[:length]:
                return length
        return 0
