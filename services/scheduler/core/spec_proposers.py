"""Speculative methods that propose in the scheduler: no model, only the request's tokens.

Such a method (suffix decoding) sees what the worker does not: the request's tenant, and
every request's end, so it can draft from finished requests' outputs without one tenant's
text drafting for another. The worker runs no proposer for it
(services/worker/spec_decode/registry.py); `SpecDecodeScheduler` asks this one for each
request's drafts when the step's sampled tokens come back (`on_output`), and tells it when
a request is freed.

A new scheduler-side method: a class with `SchedulerProposer`'s methods (a Protocol: the
method's module needs nothing from here), its factory in `_PROPOSERS`, and its name in
`SpecMethod` and `SCHEDULER_METHODS` in shared/spec_config.py.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from kvserve.services.scheduler.core.request import Request
from kvserve.shared.spec_config import SpeculativeConfig


class SchedulerProposer(Protocol):
    """One speculative method in the scheduler (see the module docstring)."""

    def propose(self, request: Request, new_token_ids: list[int], num_drafts: int) -> list[int]:
        """The request's drafts for its next step.

        Args:
            request: a running request; its tokens do not yet include new_token_ids.
            new_token_ids: the tokens this step emitted for it (verified; appended next).
            num_drafts: drafts wanted at most (0: none, but the proposer may keep up).
        """
        ...

    def expected_accepted(self, request: Request) -> list[float]:
        """For the request's last proposal: the chance that its first j tokens are all
        accepted, j = 1 .. its length. The adaptive rule keeps the prefix that pays
        (SpecDecodePolicy.num_worth_verifying) instead of its alpha ** j model."""
        ...

    def free(self, request: Request) -> None:
        """The request ended (finished, aborted or failed): drop its state."""
        ...


def _suffix(config: SpeculativeConfig) -> SchedulerProposer:
    from kvserve.services.scheduler.core.suffix_proposer import SuffixProposer

    return SuffixProposer(config)


_PROPOSERS: dict[str, Callable[[SpeculativeConfig], SchedulerProposer]] = {"suffix": _suffix}


def make_scheduler_proposer(config: SpeculativeConfig) -> SchedulerProposer | None:
    """The scheduler-side proposer of config.method; None for a method the worker runs."""
    factory = _PROPOSERS.get(config.method)
    return None if factory is None else factory(config)
