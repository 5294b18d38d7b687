"""The scheduling policy seam: what differs between the `--scheduling-policy` choices.

Every policy runs under one algorithm (Scheduler.schedule): each step schedules running
requests first, then admits waiting ones, and admits none in a step that preempted. A policy
decides the rest:

- the waiting queue, so which waiting request is admitted next (`waiting`);
- the rounds of a step: the order in which running requests get their tokens, and which
  waiting requests may be admitted after them (`rounds`); most policies have one round;
- the preemption victim when the KV cache is full (`pick_preemption_victim`);
- its own bookkeeping, told of each arrival, each scheduled chunk, each finish and each
  planned step (the `on_*` hooks: the fair policy's tenant counters live there).

A new policy is one file in this folder: a SchedulingPolicy subclass, added to the registry
(policies/__init__.py) and to SchedulerConfig.scheduling_policy's choices.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

from kvserve.services.scheduler.core.request import Request
from kvserve.services.scheduler.core.request_queue import RequestQueue

if TYPE_CHECKING:
    from kvserve.services.scheduler.core.step_plan import StepPlan
    from kvserve.shared.config import SchedulerConfig


@dataclass(frozen=True)
class Round:
    """One pass of a step: the running requests, then the waiting queue.

    Args:
        running: running requests, scheduled in this order (a request preempted earlier in
            the step is skipped).
        admits: whether the waiting queue's head may be admitted in this round, asked of
            each head in turn (the first refusal ends the round's admissions); None admits
            while budget, seats and blocks last.
    """

    running: list[Request]
    admits: Callable[[Request], bool] | None = None


class SchedulingPolicy(ABC):
    """The part of scheduling that a `--scheduling-policy` chooses (see the module doc).

    Args:
        scheduler_config: the scheduler's config (`scheduling_policy` named this policy).
    """

    name: ClassVar[str]  # the --scheduling-policy value
    waiting: RequestQueue  # the waiting queue, made by the policy (its order is the policy's)

    def __init__(self, scheduler_config: SchedulerConfig) -> None:
        self.scheduler_config = scheduler_config

    def rounds(self, running: list[Request], plan: StepPlan) -> Iterator[Round]:
        """The step's rounds, each made when the one before is done; the scheduler asks for
        no more after a round that preempted. By default one: every running request in
        admission order, then the waiting queue.

        Args:
            running: the running requests in admission order (Scheduler.running).
            plan: the step so far, for a round that depends on what the ones before did.
        """
        yield Round(running)

    @abstractmethod
    def pick_preemption_victim(self, running: list[Request]) -> Request:
        """The running request to preempt when the KV cache is full.

        Args:
            running: the running requests in admission order, never empty.
        """

    # Optional hooks, empty here: a policy overrides the ones it needs.

    def on_request_added(self, request: Request) -> None:  # noqa: B027
        """A request arrived (it is queued next, or waits for its grammar first)."""

    def on_tokens_scheduled(self, request: Request, num_new_tokens: int) -> None:  # noqa: B027
        """`num_new_tokens` of `request` were scheduled in this step (before its
        num_computed_tokens advances)."""

    def on_request_freed(self, request: Request) -> None:  # noqa: B027
        """A request finished or was aborted, wherever it was."""

    def on_step_planned(self) -> None:  # noqa: B027
        """A step's plan is complete (its tokens are counted as computed)."""

    def tenant_service(self) -> dict[str, float]:
        """Each tenant's service on this engine, reported in its load for the other engines
        (EngineLoad.tenant_service); empty where the policy does not count it. Read from
        the output thread: return a dict that is replaced, never mutated."""
        return {}

    def set_remote_tenant_service(self, remote: dict[str, float]) -> None:  # noqa: B027
        """The other engines' service per tenant (MsgType.TENANT_SERVICE); ignored where the
        policy does not count it."""
