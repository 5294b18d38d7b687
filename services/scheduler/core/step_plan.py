"""The working state of one `Scheduler.schedule()` call."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvserve.services.scheduler.core.block_pool import KVCacheBlock
from kvserve.services.scheduler.core.request import Request
from kvserve.shared.messages import KVBlockTransfer


@dataclass
class StepPlan:
    """What one `schedule()` call decided so far; the undo serves preemption of a request
    scheduled earlier in the same step."""

    token_budget: int
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    new_block_ids: dict[str, list[int]] = field(default_factory=dict)
    scheduled_running: list[Request] = field(default_factory=list)
    scheduled_new: list[Request] = field(default_factory=list)  # new or resumed
    preempted: list[Request] = field(default_factory=list)
    # Speculative decoding: the drafts each request verifies, and the drafts each proposes
    # after the step.
    spec_token_ids: dict[str, list[int]] = field(default_factory=dict)
    num_spec_tokens_to_propose: dict[str, int] = field(default_factory=dict)
    # KV connector transfers (SchedulerOutput.kv_saves_before / kv_loads / kv_saves).
    kv_saves_before: list[KVBlockTransfer] = field(default_factory=list)
    kv_loads: list[KVBlockTransfer] = field(default_factory=list)
    kv_saves: list[KVBlockTransfer] = field(default_factory=list)

    def add(self, request: Request, num_tokens: int, new_blocks: list[KVCacheBlock]) -> None:
        self.num_scheduled_tokens[request.req_id] = num_tokens
        self.new_block_ids[request.req_id] = [block.block_id for block in new_blocks]
        self.token_budget -= num_tokens

    def undo(self, request: Request) -> None:
        """Forget a request scheduled earlier in this step (it was just preempted)."""
        num_tokens = self.num_scheduled_tokens.pop(request.req_id, None)
        if num_tokens is None:
            return
        self.new_block_ids.pop(request.req_id)
        self.spec_token_ids.pop(request.req_id, None)
        self.token_budget += num_tokens
        self.scheduled_running.remove(request)
