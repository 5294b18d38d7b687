"""--scheduling-policy fair: the policy over the tenants' counters (fair_share.py has the rule)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from kvserve.services.scheduler.core.policies.base import Round, SchedulingPolicy
from kvserve.services.scheduler.core.policies.fair_share import FairRequestQueue, TenantLedger
from kvserve.services.scheduler.core.request import Request
from kvserve.services.scheduler.core.step_plan import StepPlan
from kvserve.shared.config import SchedulerConfig


class FairPolicy(SchedulingPolicy):
    """The least served tenant first: in the waiting queue, in the step, and out of
    preemption last.

    Args:
        scheduler_config: the scheduler's config.
    """

    name = "fair"

    def __init__(self, scheduler_config: SchedulerConfig) -> None:
        super().__init__(scheduler_config)
        self.ledger = TenantLedger()
        self.waiting: FairRequestQueue = FairRequestQueue(
            self.ledger, scheduler_config.slo_aging_ms / 1000
        )

    def rounds(self, running: list[Request], plan: StepPlan) -> Iterator[Round]:
        """While requests wait whose tenant ranks below some running request's, the running
        requests of the tenants ranked no higher than the waiting head's go first, then those
        waiting requests are admitted, and if any was, the step ends there: the less served
        tenants get a short step of their own (a CPU step's time grows with its tokens, so
        their first tokens come sooner; the others lose one step, not throughput). Otherwise
        every running request, decodes first, then prompts by rank; then the waiting queue."""
        rank = self.ledger.rank
        head = self.waiting.head_rank()
        above = [r for r in running if head is not None and rank(r.tenant) > head]
        if not above:
            yield Round(self._order(running))
            return
        above_ids = {id(r) for r in above}
        # The first round admits tenants ranked under all of `above` only; the bound holds
        # still, as that round charges none of `above`'s tenants.
        bound = min(rank(r.tenant) for r in above)
        num_admitted = len(plan.scheduled_new)
        yield Round(
            self._order(r for r in running if id(r) not in above_ids),
            admits=lambda request: rank(request.tenant) < bound,
        )
        if len(plan.scheduled_new) > num_admitted:
            return  # the less served tenants' short step
        yield Round(self._order(above))

    def _order(self, requests: Iterable[Request]) -> list[Request]:
        """Decodes first (a token each), then prompts, the least served tenant's first."""
        rank = self.ledger.rank
        return sorted(
            requests, key=lambda r: (r.num_tokens - r.num_computed_tokens > 1, rank(r.tenant))
        )

    def pick_preemption_victim(self, running: list[Request]) -> Request:
        # The most served tenant's; inside it as the priority policy (the last admitted on
        # exact ties).
        rank = self.ledger.rank
        return max(reversed(running), key=lambda r: (rank(r.tenant), r.priority, r.arrival_time))

    def on_request_added(self, request: Request) -> None:
        self.ledger.add(request)

    def on_tokens_scheduled(self, request: Request, num_new_tokens: int) -> None:
        self.ledger.charge(request, num_new_tokens)

    def on_request_freed(self, request: Request) -> None:
        self.ledger.remove(request)

    def on_step_planned(self) -> None:
        self.ledger.publish()

    def tenant_service(self) -> dict[str, float]:
        return self.ledger.reported

    def set_remote_tenant_service(self, remote: dict[str, float]) -> None:
        self.ledger.set_remote(remote)
