"""--scheduling-policy fair: tenants served by their virtual token counters (the policy: fair.py).

The rule is the Virtual Token Counter of "Fairness in Serving Large Language Models" (Sheng
et al., OSDI '24): each tenant's counter grows by the service it gets, prompt tokens weighted
INPUT_TOKEN_COST and generated ones OUTPUT_TOKEN_COST, divided by the tenant's weight; the
tenant with the smallest counter is served next. Where it acts in the scheduler:

- admission: the waiting queue's head is the head of the least-served tenant (inside a
  tenant: priority, then arrival, so the policy composes with `priority`); tenants with
  equal counters go by the requests they hold here, fewest first;
- prompt work: running requests still in their prompt (chunked prefill) of tenants more
  served than the waiting head's wait until it is admitted, so a light tenant's prompt does
  not queue behind a heavy tenant's long prompts already running (FairPolicy.rounds);
- preemption: the victim is a request of the most-served running tenant.

A tenant that becomes active (a request arrives while it has none on this engine) is lifted
to the smallest counter among the active tenants, so idle time is not banked as credit. It is
work conserving: a lone tenant is served alone at full speed.

Across engines (data parallelism) each engine core reports its tenants' counters in its load
(EngineLoad.tenant_service); the api hands each engine the sum of the others' (MsgType.
TENANT_SERVICE), which `counter` adds: a tenant served on another engine counts as served
here, so it cannot get N shares by landing on N engines.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterable, Iterator

from kvserve.services.scheduler.core.policies.deadline_queue import due_time
from kvserve.services.scheduler.core.request import Request
from kvserve.services.scheduler.core.request_queue import RequestQueue

INPUT_TOKEN_COST = 1.0  # a prompt token computed (the paper's w_p)
OUTPUT_TOKEN_COST = 2.0  # a generated token (the paper's w_q)


class TenantLedger:
    """Every tenant's virtual token counter on this engine core, and the other engines'.

    `local[t]` is what this engine served t (weighted, lifts included): what it reports.
    `remote[t]` is the other engines' sum, from the api (empty without data parallelism).
    """

    def __init__(self) -> None:
        self.local: dict[str, float] = {}
        self.remote: dict[str, float] = {}
        self.num_live: dict[str, int] = {}  # requests per tenant, waiting or running
        # A copy of `local` for the output thread (EngineLoad), replaced after each step.
        self.reported: dict[str, float] = {}

    def counter(self, tenant: str) -> float:
        return self.local.get(tenant, 0.0) + self.remote.get(tenant, 0.0)

    def rank(self, tenant: str) -> tuple[float, int]:
        """Who is served first: the least counter; on a tie (a tenant just lifted to the
        least counter) the one holding fewer requests here."""
        return self.counter(tenant), self.num_live.get(tenant, 0)

    def add(self, request: Request) -> None:
        """A request of its tenant arrived; a tenant that was idle here is lifted to the
        least counter of the active ones (no credit banked while idle)."""
        tenant = request.tenant
        if not self.num_live.get(tenant):
            active = [self.counter(t) for t, n in self.num_live.items() if n and t != tenant]
            if active:
                lift = min(active) - self.counter(tenant)
                if lift > 0:
                    self.local[tenant] = self.local.get(tenant, 0.0) + lift
        self.num_live[tenant] = self.num_live.get(tenant, 0) + 1

    def remove(self, request: Request) -> None:
        """A request of its tenant finished; idle tenants leave `num_live`."""
        tenant = request.tenant
        remaining = self.num_live.get(tenant, 0) - 1
        if remaining > 0:
            self.num_live[tenant] = remaining
        else:
            self.num_live.pop(tenant, None)

    def charge(self, request: Request, num_new_tokens: int) -> None:
        """Charge `request`'s tenant for the tokens scheduled for it in this step."""
        num_prompt_left = request.num_prompt_tokens - request.num_computed_tokens
        num_input = max(0, min(num_new_tokens, num_prompt_left))
        num_output = num_new_tokens - num_input
        cost = num_input * INPUT_TOKEN_COST + num_output * OUTPUT_TOKEN_COST
        tenant = request.tenant
        self.local[tenant] = self.local.get(tenant, 0.0) + cost / request.tenant_weight

    def set_remote(self, remote: dict[str, float]) -> None:
        self.remote = remote

    def publish(self) -> None:
        """Refresh the output thread's copy (after each step)."""
        self.reported = dict(self.local)


class FairRequestQueue(RequestQueue):
    """One queue per tenant (priority, then due time, then arrival, inside it: the due time
    is deadline_queue.due_time, so without TTFT targets the arrival order); the head is the
    head of the waiting tenant with the least counter (ties: the earliest head).

    Args:
        ledger: the tenants' counters.
        aging_s: a request without a TTFT target is due this long after its arrival.
    """

    def __init__(self, ledger: TenantLedger, aging_s: float = 5.0) -> None:
        self.ledger = ledger
        self.aging_s = aging_s
        self._queues: dict[str, list[tuple[int, float, float, int, Request]]] = {}
        self._seq = itertools.count()
        self._len = 0

    def add_request(self, request: Request) -> None:
        queue = self._queues.setdefault(request.tenant, [])
        due = due_time(request, self.aging_s)
        entry = (request.priority, due, request.arrival_time, next(self._seq), request)
        heapq.heappush(queue, entry)
        self._len += 1

    def prepend_request(self, request: Request) -> None:
        # Its (priority, due, arrival) key puts a preempted request back ahead of later ones.
        self.add_request(request)

    def _head_tenant(self) -> str:
        if not self._len:
            raise IndexError("the waiting queue is empty")
        rank = self.ledger.rank
        return min(self._queues, key=lambda t: (rank(t), self._queues[t][0][2:4]))

    def peek_request(self) -> Request:
        return self._queues[self._head_tenant()][0][-1]

    def pop_request(self) -> Request:
        tenant = self._head_tenant()
        queue = self._queues[tenant]
        request = heapq.heappop(queue)[-1]
        if not queue:
            del self._queues[tenant]
        self._len -= 1
        return request

    def head_rank(self) -> tuple[float, int] | None:
        """The rank (TenantLedger.rank) of the tenant whose request is next, or None when
        nothing waits."""
        return self.ledger.rank(self._head_tenant()) if self._len else None

    def remove_requests(self, requests: Iterable[Request]) -> None:
        to_remove = {id(request) for request in requests}
        for tenant in list(self._queues):
            kept = [entry for entry in self._queues[tenant] if id(entry[-1]) not in to_remove]
            self._len -= len(self._queues[tenant]) - len(kept)
            if kept:
                heapq.heapify(kept)
                self._queues[tenant] = kept
            else:
                del self._queues[tenant]

    def __len__(self) -> int:
        return self._len

    def __iter__(self) -> Iterator[Request]:
        """Every waiting request, tenant by tenant from the least served (the order the
        queue would admit them in if no counter moved)."""
        for tenant in sorted(self._queues, key=self.ledger.rank):
            yield from (entry[-1] for entry in sorted(self._queues[tenant]))
