"""Speculative decoding in the scheduler: one object the Scheduler calls at fixed points.

Each decoding request's drafts from the last step are scheduled as extra query tokens after
its last token (`drafts_to_verify`); after the batch is decided, the adaptive rule
(spec_decode.py) decides how many drafts each sampling request proposes after the step
(`plan_proposals`), reserving lookahead slots for a proposer that writes K/V. When the
outputs return, the rejected drafts are rolled back (`on_output`: num_computed_tokens and
the K/V slots they wrote) and the new drafts kept for the next step: the worker's, or those
of a scheduler-side proposer (spec_proposers.py: suffix decoding).

A request under a grammar speculates too: its drafts are cut at the first token its grammar
forbids when they are scheduled (`drafts_to_verify`), and the step's bitmask then carries one
row per verified position (request_output.grammar_bitmask_of).
"""

from __future__ import annotations

from kvserve.services.scheduler.core.kv_cache_manager import KVCacheManager
from kvserve.services.scheduler.core.request import Request
from kvserve.services.scheduler.core.spec_decode import SpecDecodePolicy, SpecRequestState
from kvserve.services.scheduler.core.spec_proposers import make_scheduler_proposer
from kvserve.services.scheduler.core.step_plan import StepPlan
from kvserve.services.scheduler.structured_output.draft_masks import grammar_valid_prefix
from kvserve.shared.config import SpeculativeConfig
from kvserve.shared.messages import SchedulerOutput, SpecDecodeMetadata


class SpecDecodeScheduler:
    """
    Args:
        config: the speculative config.
        step_costs: (query tokens, seconds) of a forward, measured by the workers; the
            adaptive rule weighs drafts against them.
        max_model_len: the scheduler's effective limit (no draft past it).
    """

    def __init__(
        self,
        config: SpeculativeConfig,
        step_costs: list[tuple[int, float]],
        max_model_len: int,
    ):
        self.config = config
        self.policy = SpecDecodePolicy(config, step_costs)
        self.max_model_len = max_model_len
        self.stats = _SpecStats(config.num_speculative_tokens)
        self.proposer = make_scheduler_proposer(config)
        self.policy.trims_proposals = self.proposer is not None

    def add_request(self, request: Request) -> None:
        """Every request speculates but one with both a grammar and a reasoning parser
        (its grammar starts where its thinking ends, which a draft may cross)."""
        if request.sampling_params.structured_outputs is None or request.thinking is None:
            request.spec = SpecRequestState()

    def free(self, request: Request) -> None:
        """The request ended: a scheduler-side proposer may learn from its output."""
        if self.proposer is not None:
            self.proposer.free(request)

    def drafts_to_verify(self, request: Request, token_budget: int) -> list[int]:
        """The drafts a running request verifies in this step: they follow its last token,
        within the step's remaining budget, max_model_len and max_tokens."""
        spec = request.spec
        if spec is None or not spec.draft_token_ids:
            return []
        if request.num_computed_tokens != request.num_tokens - 1:
            return []
        draft_token_ids = spec.draft_token_ids[: self._max_drafts(request, token_budget)]
        state = request.structured_output
        if state is not None and draft_token_ids:
            # The matcher stands after the request's last token (update_from_output).
            grammar = state.grammar
            draft_token_ids = (
                [] if grammar is None else grammar_valid_prefix(grammar, draft_token_ids)
            )
        return draft_token_ids

    def _max_drafts(self, request: Request, token_budget: int) -> int:
        """A draft past the last allowed token is wasted work."""
        return max(0, min(token_budget, self._max_drafts_after(request, request.num_tokens)))

    def _max_drafts_after(self, request: Request, num_tokens: int) -> int:
        """Drafts that may follow `num_tokens` tokens of `request`: each needs a slot below
        max_model_len, and at most max_tokens - 1 of them can be emitted before the
        verifying step's own token ends the request."""
        num_slots = self.max_model_len - num_tokens
        max_tokens = request.max_tokens
        if max_tokens is not None:
            num_left = max_tokens - (request.num_output_tokens + num_tokens - request.num_tokens)
            num_slots = min(num_slots, num_left - 1)
        return max(0, num_slots)

    def plan_proposals(
        self, plan: StepPlan, num_running: int, kv_cache_manager: KVCacheManager
    ) -> None:
        """How many drafts each request that samples in this step proposes after it (the
        adaptive rule, over this step's batch); for a proposer that writes K/V, the
        lookahead slots its guesses write, when the pool has them (the proposer guesses only
        as far as the request's slots reach)."""
        sampling = [
            r
            for r in (*plan.scheduled_running, *plan.scheduled_new)
            if r.spec is not None
            and r.num_computed_tokens + plan.num_scheduled_tokens[r.req_id] >= r.num_tokens
        ]
        if not sampling:
            return
        # After this step a request holds at most num_tokens + drafts + 1 tokens; the next
        # step verifies the new drafts after those.
        caps = [
            self._max_drafts_after(r, r.num_tokens + len(plan.spec_token_ids.get(r.req_id, ())) + 1)
            for r in sampling
        ]
        states = [r.spec for r in sampling if r.spec is not None]
        counts = self.policy.num_to_propose(states, caps, num_running)
        for request, count in zip(sampling, counts):
            if count > 0:
                plan.num_spec_tokens_to_propose[request.req_id] = count
                if self.config.uses_lookahead_slots:
                    self._reserve_lookahead(request, count, plan, kv_cache_manager)

    @staticmethod
    def _reserve_lookahead(
        request: Request, count: int, plan: StepPlan, kv_cache_manager: KVCacheManager
    ) -> None:
        num_scheduled = plan.num_scheduled_tokens[request.req_id]
        extra = kv_cache_manager.allocate_slots(request, num_scheduled, num_lookahead_tokens=count)
        if extra and request.req_id in plan.new_block_ids:
            plan.new_block_ids[request.req_id].extend(b.block_id for b in extra)

    @staticmethod
    def make_metadata(plan: StepPlan) -> SpecDecodeMetadata:
        """The step's SchedulerOutput.spec_decode."""
        return SpecDecodeMetadata(
            draft_token_ids=plan.spec_token_ids,
            num_to_propose={
                req_id: n
                for req_id, n in plan.num_spec_tokens_to_propose.items()
                if req_id in plan.num_scheduled_tokens
            },
        )

    def on_output(
        self,
        request: Request,
        metadata: SpecDecodeMetadata,
        sampled_token_ids: list[int],
        proposed: list[int],
    ) -> None:
        """Roll back the rejected drafts: their K/V slots are rewritten by later steps, and
        num_computed_tokens counts only the verified tokens (whose hashes alone enter the
        prefix cache). Then keep the request's new drafts for its next step."""
        spec = request.spec
        assert spec is not None
        draft_token_ids = metadata.draft_token_ids.get(request.req_id)
        if draft_token_ids:
            num_drafts = len(draft_token_ids)
            # A verifying step emits the accepted drafts and one more token.
            num_accepted = max(len(sampled_token_ids) - 1, 0)
            request.num_computed_tokens -= num_drafts - num_accepted
            spec.record(num_drafts, num_accepted)
            self.stats.add(num_drafts, num_accepted)
        if self.proposer is not None:
            num_drafts = metadata.num_to_propose.get(request.req_id, 0)
            proposed = self.proposer.propose(request, sampled_token_ids, num_drafts)
            if proposed and self.config.adaptive and self.policy.trims_proposals:
                gains = self.proposer.expected_accepted(request)
                proposed = proposed[: self.policy.num_worth_verifying(gains)]
        spec.draft_token_ids = proposed

    def record_step_time(self, scheduler_output: SchedulerOutput, seconds: float) -> None:
        """How long a step took from schedule to outputs (the adaptive rule compares it
        with its cost model)."""
        self.policy.record_step(
            scheduler_output.total_num_scheduled_tokens,
            seconds,
            bool(scheduler_output.spec_decode.draft_token_ids),
        )

    def take_stats(self) -> dict:
        """The SchedulerStats fields since the last call (empty when nothing was verified)."""
        return self.stats.take()


class _SpecStats:
    """Speculative-decoding counters since the last SchedulerStats."""

    def __init__(self, num_speculative_tokens: int):
        self.num_speculative_tokens = num_speculative_tokens
        self._reset()

    def _reset(self) -> None:
        self.num_drafts = 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.accepted_per_pos = [0] * self.num_speculative_tokens

    def add(self, num_drafts: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_drafts
        self.num_accepted_tokens += num_accepted
        for pos in range(num_accepted):
            self.accepted_per_pos[pos] += 1

    def take(self) -> dict:
        if not self.num_drafts:
            return {}
        fields = {
            "spec_num_drafts": self.num_drafts,
            "spec_num_draft_tokens": self.num_draft_tokens,
            "spec_num_accepted_tokens": self.num_accepted_tokens,
            "spec_accepted_per_pos": self.accepted_per_pos,
        }
        self._reset()
        return fields
