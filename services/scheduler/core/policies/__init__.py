"""Scheduling policies, by their `--scheduling-policy` name (the seam: base.py)."""

from __future__ import annotations

from kvserve.services.scheduler.core.policies.base import Round, SchedulingPolicy
from kvserve.services.scheduler.core.policies.fair import FairPolicy
from kvserve.services.scheduler.core.policies.fcfs import FcfsPolicy
from kvserve.services.scheduler.core.policies.priority import PriorityPolicy
from kvserve.shared.config import SchedulerConfig

__all__ = ["POLICIES", "Round", "SchedulingPolicy", "create_policy"]

POLICIES: dict[str, type[SchedulingPolicy]] = {
    policy.name: policy for policy in (FcfsPolicy, PriorityPolicy, FairPolicy)
}


def create_policy(scheduler_config: SchedulerConfig) -> SchedulingPolicy:
    """The policy that `scheduler_config.scheduling_policy` names.

    Raises:
        ValueError: no policy has that name.
    """
    name = scheduler_config.scheduling_policy
    policy_class = POLICIES.get(name)
    if policy_class is None:
        known = ", ".join(repr(known_name) for known_name in POLICIES)
        raise ValueError(f"unknown scheduling policy {name!r}; use one of {known}")
    return policy_class(scheduler_config)
