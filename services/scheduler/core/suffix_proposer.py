"""Suffix decoding (vLLM's `method: "suffix"`, Arctic Inference's algorithm, our own code).

Each running request drafts from two suffix indexes (suffix_index.py) and keeps the better
draft by expected accepted tokens:

- its own text, prompt and output (built when it first proposes, then kept up step by step);
- its tenant's recent outputs: every finished request's output joins the index of its tenant
  (and cache salt), so one tenant's text never drafts for another's. The indexes hold the
  last `suffix_decoding_max_cached_requests` outputs of all tenants together (and at most
  `_MAX_CACHED_TOKENS` tokens), oldest dropped first.

Draft length follows the match (vLLM's knobs): a match of m tokens drafts at most
min(num_drafts, max_spec_factor * m, max_tree_depth - m) tokens, and the draft stops where
its path's estimated probability falls below min_token_prob. Among the match lengths the
context has, the one allowing the longest draft is used (the longer on ties): a longer
match is more specific, a shorter one leaves the depth more room. Drafts are deterministic
given the text, so the rejection sampler keeps greedy and seeded sampling exact.
"""

from __future__ import annotations

from collections import deque

from kvserve.services.scheduler.core.request import Request
from kvserve.services.scheduler.core.suffix_acceptance import (
    OWN_TEXT,
    TENANT_OUTPUTS,
    DraftAcceptance,
)
from kvserve.services.scheduler.core.suffix_index import NO_DRAFT, SEPARATOR, Draft, SuffixIndex
from kvserve.shared.spec_config import SpeculativeConfig

# The most output tokens the tenants' indexes hold together (~100 bytes each).
_MAX_CACHED_TOKENS = 1 << 21

TenantKey = tuple[str, str | None]


class SuffixProposer:
    """A `SchedulerProposer` (spec_proposers.py).

    Args:
        config: the speculative config (method suffix and its suffix_decoding_* knobs).
    """

    def __init__(self, config: SpeculativeConfig):
        self.depth = config.suffix_decoding_max_tree_depth
        self.max_spec_factor = config.suffix_decoding_max_spec_factor
        self.min_token_prob = config.suffix_decoding_min_token_prob
        self.requests: dict[str, SuffixIndex] = {}
        self.outputs = TenantOutputs(config.suffix_decoding_max_cached_requests)
        # Each request's last proposal, until the step's tokens say how much of it was right.
        self.last_drafts: dict[str, Draft] = {}
        self.acceptance = DraftAcceptance()

    def propose(self, request: Request, new_token_ids: list[int], num_drafts: int) -> list[int]:
        last = self.last_drafts.pop(request.req_id, None)
        if last is not None:
            # The step's tokens are the target's choices at the last draft's first positions.
            self.acceptance.observe(last.source, last.match_len, last.token_ids, new_token_ids)
        if num_drafts <= 0:
            return []  # its index catches up when it next proposes
        index = self._synced_index(request, new_token_ids)
        context = index.tokens[-self.depth :]
        best = self._draft(index, context, num_drafts, OWN_TEXT)
        shared = self.outputs.index_of(tenant_key(request))
        if shared is not None and len(best.token_ids) < num_drafts:
            other = self._draft(shared, context, num_drafts, TENANT_OUTPUTS)
            if other.score > best.score:
                best = other
        if best.token_ids:
            self.last_drafts[request.req_id] = best
        return best.token_ids

    def expected_accepted(self, request: Request) -> list[float]:
        """The chance that the first j tokens of the request's last proposal are all
        accepted, j = 1 .. its length (suffix_acceptance.py)."""
        draft = self.last_drafts.get(request.req_id)
        if draft is None:
            return []
        return self.acceptance.gains(draft.source, draft.match_len, draft.path_probs)

    def free(self, request: Request) -> None:
        self.requests.pop(request.req_id, None)
        self.last_drafts.pop(request.req_id, None)
        self.outputs.add(tenant_key(request), request.output_token_ids)

    def _synced_index(self, request: Request, new_token_ids: list[int]) -> SuffixIndex:
        """The request's own index over all its tokens, new_token_ids included."""
        index = self.requests.get(request.req_id)
        known = request.all_token_ids
        if index is None or len(index.tokens) > len(known):
            index = self.requests[request.req_id] = SuffixIndex()
        index.extend(known[len(index.tokens) :])
        index.extend(new_token_ids)
        return index

    def _draft(
        self, index: SuffixIndex, context: list[int], num_drafts: int, source: int = OWN_TEXT
    ) -> Draft:
        # A match leaves at least one token of the depth to draft.
        found = index.matches(context, self.depth - 1)
        if not found:
            return NO_DRAFT
        match_len, max_len = self._match_length(max(m for _, m in found), num_drafts)
        ends = [pos for pos, m in found if m >= match_len]
        draft = index.draft(ends, max_len, self.min_token_prob)
        draft.match_len, draft.source = match_len, source
        return draft

    def _match_length(self, longest: int, num_drafts: int) -> tuple[int, int]:
        """(m, draft allowance) for the match length m in 2..longest (1 when only the last
        token matched) whose allowance min(num_drafts, factor * m, depth - m) is largest,
        the longer m on ties."""
        first = min(2, longest)
        best = (first, self._allowance(first, num_drafts))
        for m in range(3, longest + 1):
            allowance = self._allowance(m, num_drafts)
            if allowance >= best[1]:
                best = (m, allowance)
        return best

    def _allowance(self, match_len: int, num_drafts: int) -> int:
        by_factor = int(self.max_spec_factor * match_len)
        return max(0, min(num_drafts, by_factor, self.depth - match_len))


def tenant_key(request: Request) -> TenantKey:
    """Whose outputs a request may draft from: its tenant's, under its cache salt."""
    return request.tenant, request.cache_salt


class TenantOutputs:
    """Finished requests' outputs, one suffix index per tenant key, oldest dropped first.

    Args:
        max_cached_requests: outputs kept, all tenants together (0: none).
    """

    def __init__(self, max_cached_requests: int):
        self.max_cached_requests = max_cached_requests
        self.indexes: dict[TenantKey, SuffixIndex] = {}
        # (tenant key, tokens with the separator) of each kept output, oldest first.
        self.order: deque[tuple[TenantKey, int]] = deque()
        self.num_tokens = 0

    def add(self, key: TenantKey, token_ids: list[int]) -> None:
        """Keep one finished output (too short to match: not kept)."""
        if self.max_cached_requests == 0 or len(token_ids) < 3:
            return
        index = self.indexes.get(key)
        if index is None:
            index = self.indexes[key] = SuffixIndex()
        index.extend(token_ids)
        index.extend([SEPARATOR])
        self.order.append((key, len(token_ids) + 1))
        self.num_tokens += len(token_ids) + 1
        while len(self.order) > self.max_cached_requests or self.num_tokens > _MAX_CACHED_TOKENS:
            self._drop_oldest()

    def index_of(self, key: TenantKey) -> SuffixIndex | None:
        return self.indexes.get(key)

    def _drop_oldest(self) -> None:
        key, num_tokens = self.order.popleft()
        self.num_tokens -= num_tokens
        index = self.indexes[key]
        index.drop_front(num_tokens)
        if not len(index):
            del self.indexes[key]
