"""The policy registry: every `--scheduling-policy` choice builds its policy behind the one
seam (policies/base.py), and an unknown name is a clear error."""

from __future__ import annotations

import typing

import pytest

from kvserve.services.scheduler.core.policies import POLICIES, SchedulingPolicy, create_policy
from kvserve.services.scheduler.core.policies.fair import FairPolicy
from kvserve.services.scheduler.core.policies.fcfs import FcfsPolicy, FcfsRequestQueue
from kvserve.services.scheduler.core.policies.priority import PriorityPolicy, PriorityRequestQueue
from kvserve.shared.config import SchedulerConfig
from tests.support.scheduler import create_scheduler


@pytest.mark.parametrize(
    ("name", "policy_class"),
    [("fcfs", FcfsPolicy), ("priority", PriorityPolicy), ("fair", FairPolicy)],
)
def test_each_name_builds_its_policy(name, policy_class):
    policy = create_policy(SchedulerConfig(scheduling_policy=name))
    assert type(policy) is policy_class and policy.name == name
    assert not policy.waiting and policy.tenant_service() == {}
    scheduler = create_scheduler(scheduling_policy=name)
    assert type(scheduler.policy) is policy_class
    assert scheduler.waiting is scheduler.policy.waiting


def test_the_queues_are_the_policies_own():
    assert isinstance(create_policy(SchedulerConfig()).waiting, FcfsRequestQueue)
    priority = create_policy(SchedulerConfig(scheduling_policy="priority"))
    assert isinstance(priority.waiting, PriorityRequestQueue)


def test_the_registry_has_every_config_choice():
    hints = typing.get_type_hints(SchedulerConfig, include_extras=True)
    choices = typing.get_args(typing.get_args(hints["scheduling_policy"])[0])
    assert set(choices) == set(POLICIES)
    assert all(issubclass(policy, SchedulingPolicy) for policy in POLICIES.values())


def test_an_unknown_name_is_a_value_error_naming_the_choices():
    with pytest.raises(ValueError, match="unknown scheduling policy 'lifo'.*'fcfs'"):
        create_policy(SchedulerConfig(scheduling_policy="lifo"))  # type: ignore[arg-type]
