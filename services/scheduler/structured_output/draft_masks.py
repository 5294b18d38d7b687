"""Speculation under a grammar: drafts cut where the grammar forbids them, and one bitmask
row per position a step verifies.

A request with k drafts verifies k + 1 positions in one forward: its last token's and each
draft's. Position j is sampled under the grammar after the drafts before it, so the step's
bitmask carries k + 1 rows for it, filled by walking the matcher over its drafts and rolling
it back (xgrammar's accept_token / rollback). A draft's prefix that the grammar forbids
never reaches the worker (`grammar_valid_prefix`), so every row has an allowed token, and a
token the rejection sampler emits is one its row allows.

    grammar at state s, drafts [d0 d1]:   row 0 = mask(s)  row 1 = mask(s.d0)  row 2 = mask(s.d0.d1)
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from kvserve.services.scheduler.structured_output.grammar import Grammar, XgrammarBackend


def grammar_valid_prefix(grammar: Grammar, draft_token_ids: list[int]) -> list[int]:
    """The drafts up to the first the grammar forbids, and short of one that completes it
    (the request ends there, so the positions after it would have no allowed token)."""
    matcher = grammar.matcher
    num_accepted = 0
    for token_id in draft_token_ids:
        if not matcher.accept_token(token_id):
            break
        num_accepted += 1
        if matcher.is_terminated():
            break
    num_valid = num_accepted - 1 if num_accepted and matcher.is_terminated() else num_accepted
    if num_accepted:
        matcher.rollback(num_accepted)
    return draft_token_ids[:num_valid]


def fill_verify_bitmask(
    backend: XgrammarBackend,
    grammars: list[Grammar],
    drafts: list[list[int]],
    bitmask: np.ndarray,
) -> None:
    """Rows of each grammar's positions, grammar after grammar: 1 + len(drafts[i]) rows for
    grammars[i]. The drafts are grammar-valid (grammar_valid_prefix); each matcher ends
    where it started."""
    offsets = np.cumsum([0] + [1 + len(d) for d in drafts[:-1]]).tolist()
    for j in range(1 + max(len(d) for d in drafts)):
        # Every grammar with a position j, in one batched fill.
        live = [i for i, d in enumerate(drafts) if len(d) >= j]
        backend.batch_matcher.batch_fill_next_token_bitmask(
            [grammars[i].matcher for i in live], bitmask, [offsets[i] + j for i in live]
        )
        for i in live:
            if j < len(drafts[i]):
                accepted = grammars[i].matcher.accept_token(drafts[i][j])
                assert accepted, "drafts were checked against the grammar when scheduled"
    for grammar, draft in zip(grammars, drafts):
        if draft:
            grammar.matcher.rollback(len(draft))
