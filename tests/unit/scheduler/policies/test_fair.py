"""--scheduling-policy fair: tenants served by their virtual token counters (fair.py and
fair_share.py), driven through the real Scheduler with a fake model (tests/support/scheduler.py)."""

from __future__ import annotations

import pytest

from kvserve.services.scheduler.core.policies.fair_share import OUTPUT_TOKEN_COST
from tests.support.kv import assert_no_leaked_blocks
from tests.support.scheduler import create_request, create_scheduler, run_to_completion, step


def _admission_order(scheduler, max_steps: int = 500) -> list[str]:
    """Step to the end; the request ids in the order they were first scheduled."""
    order: list[str] = []
    for _ in range(max_steps):
        if not scheduler.has_requests():
            return order
        scheduler_output, _ = step(scheduler)
        order += [
            new.req_id for new in scheduler_output.scheduled_new_reqs if new.req_id not in order
        ]
    raise AssertionError("requests still unfinished")


@pytest.mark.parametrize("policy", ["fcfs", "fair"])
def test_a_light_tenant_is_admitted_ahead_of_a_heavy_backlog(policy):
    scheduler = create_scheduler(max_num_seqs=2, scheduling_policy=policy)
    for i in range(8):
        scheduler.add_request(
            create_request(f"heavy{i}", 32, max_tokens=8, arrival_time=i, tenant="heavy")
        )
    step(scheduler)  # heavy0 and heavy1 run; six heavy requests wait
    scheduler.add_request(create_request("light", 8, max_tokens=8, arrival_time=9, tenant="light"))

    order = _admission_order(scheduler)

    if policy == "fair":
        # The next free seat is the light tenant's: it has had no service.
        assert order.index("light") == 0
    else:
        assert order[-1] == "light"  # behind the whole backlog
    assert_no_leaked_blocks(scheduler)


def test_weights_two_to_one_share_the_tokens_two_to_one():
    scheduler = create_scheduler(max_num_seqs=3, scheduling_policy="fair")
    for i in range(60):
        for tenant, weight in (("gold", 2.0), ("bronze", 1.0)):
            scheduler.add_request(
                create_request(
                    f"{tenant}{i}",
                    8,
                    max_tokens=8,
                    arrival_time=i,
                    tenant=tenant,
                    tenant_weight=weight,
                )
            )
    served = {"gold": 0, "bronze": 0}
    for _ in range(150):  # both tenants stay backlogged throughout
        scheduler_output, _ = step(scheduler)
        for req_id, num_tokens in scheduler_output.num_scheduled_tokens.items():
            served[req_id.rstrip("0123456789")] += num_tokens
    assert scheduler.waiting  # still saturated: the share was measured under contention
    assert served["gold"] / served["bronze"] == pytest.approx(2.0, rel=0.1), served
    run_to_completion(scheduler)
    assert_no_leaked_blocks(scheduler)


def test_a_lone_tenant_gets_every_seat():
    scheduler = create_scheduler(max_num_seqs=4, scheduling_policy="fair")
    for i in range(6):
        scheduler.add_request(create_request(f"r{i}", 8, max_tokens=4, tenant="only"))
    scheduler_output, _ = step(scheduler)
    assert len(scheduler_output.num_scheduled_tokens) == 4  # work conserving
    run_to_completion(scheduler)
    assert_no_leaked_blocks(scheduler)


def test_a_newly_active_tenant_banks_no_credit_for_its_idle_time():
    scheduler = create_scheduler(max_num_seqs=2, scheduling_policy="fair")
    for i in range(40):
        scheduler.add_request(create_request(f"a{i}", 8, max_tokens=8, arrival_time=i, tenant="a"))
    for _ in range(40):
        step(scheduler)  # "a" alone: its counter grows, "b" has none
    ledger = scheduler.policy.ledger
    for i in range(20):
        scheduler.add_request(
            create_request(f"b{i}", 8, max_tokens=8, arrival_time=100 + i, tenant="b")
        )
    # Lifted to the least active counter ("a"'s), not starting from 0.
    assert ledger.counter("b") == pytest.approx(ledger.counter("a"))
    admitted = []
    for _ in range(60):
        scheduler_output, _ = step(scheduler)
        admitted += [new.req_id[0] for new in scheduler_output.scheduled_new_reqs]
    # From then on they alternate rather than "b" taking every seat until it caught up.
    assert 0.35 < admitted.count("a") / len(admitted) < 0.65, admitted


def test_the_most_served_tenant_is_preempted_first():
    # 6 usable blocks of 4 tokens; "big" runs two requests, "small" one.
    scheduler = create_scheduler(
        block_size=4, num_blocks=7, max_model_len=24, scheduling_policy="fair"
    )
    scheduler.add_request(create_request("small", 8, max_tokens=6, arrival_time=0, tenant="small"))
    scheduler.add_request(create_request("big1", 8, max_tokens=6, arrival_time=1, tenant="big"))
    scheduler.add_request(create_request("big2", 8, max_tokens=6, arrival_time=2, tenant="big"))
    step(scheduler)
    ledger = scheduler.policy.ledger
    assert ledger.counter("big") > ledger.counter("small")
    scheduler_output, _ = step(scheduler)  # every request needs a third block
    # The victim is big's, never small's, though small is not the last admitted either way.
    assert scheduler_output.preempted_req_ids and all(
        req_id.startswith("big") for req_id in scheduler_output.preempted_req_ids
    )
    assert "small" in scheduler_output.num_scheduled_tokens
    run_to_completion(scheduler)
    assert_no_leaked_blocks(scheduler)


def test_a_heavy_running_prompt_waits_for_a_light_tenants_prompt():
    # A 16-token budget: "heavy" is mid-way through a 64-token prompt, another one queued
    # behind it, when "light" comes (lifted to heavy's counter, and holding fewer requests).
    scheduler = create_scheduler(max_num_batched_tokens=16, scheduling_policy="fair")
    scheduler.add_request(create_request("heavy", 64, max_tokens=4, tenant="heavy"))
    scheduler.add_request(create_request("heavy2", 64, max_tokens=4, tenant="heavy"))
    step(scheduler)
    scheduler.add_request(create_request("light", 8, max_tokens=4, tenant="light"))

    scheduler_output, _ = step(scheduler)

    # Light's whole prompt goes first, in a step of its own; heavy's next chunk follows.
    assert scheduler_output.num_scheduled_tokens == {"light": 8}
    assert [new.req_id for new in scheduler_output.scheduled_new_reqs] == ["light"]
    # Light, lifted to heavy's counter and then charged its prompt, is now the more served:
    # heavy's chunk goes first and fills the budget; light's decode follows when it ranks
    # below again.
    scheduler_output, _ = step(scheduler)
    assert scheduler_output.num_scheduled_tokens == {"heavy": 16}
    scheduler_output, _ = step(scheduler)
    assert scheduler_output.num_scheduled_tokens["light"] == 1
    run_to_completion(scheduler)
    assert_no_leaked_blocks(scheduler)


def test_fcfs_keeps_the_running_prompt_first():
    scheduler = create_scheduler(max_num_batched_tokens=16, scheduling_policy="fcfs")
    scheduler.add_request(create_request("heavy", 64, max_tokens=4, tenant="heavy"))
    step(scheduler)
    scheduler.add_request(create_request("light", 8, max_tokens=4, tenant="light"))
    scheduler_output, _ = step(scheduler)
    assert scheduler_output.num_scheduled_tokens == {"heavy": 16}


def test_service_on_other_engines_counts():
    scheduler = create_scheduler(max_num_seqs=1, scheduling_policy="fair")
    scheduler.add_request(create_request("x1", 8, max_tokens=2, arrival_time=0, tenant="x"))
    scheduler.add_request(create_request("y1", 8, max_tokens=2, arrival_time=1, tenant="y"))
    scheduler.add_request(create_request("y2", 8, max_tokens=2, arrival_time=2, tenant="y"))
    # "x" was served elsewhere in the cluster (what the api sends, MsgType.TENANT_SERVICE).
    scheduler.policy.set_remote_tenant_service({"x": 1000.0})
    # "y" arrived second but is the least served cluster-wide: its requests go first.
    assert _admission_order(scheduler) == ["y1", "y2", "x1"]


def test_priority_orders_requests_inside_a_tenant():
    scheduler = create_scheduler(max_num_seqs=1, scheduling_policy="fair")
    scheduler.add_request(create_request("late", 8, max_tokens=2, priority=5, tenant="t"))
    scheduler.add_request(create_request("urgent", 8, max_tokens=2, priority=0, tenant="t"))
    assert _admission_order(scheduler) == ["urgent", "late"]


def test_counters_weigh_output_tokens_and_divide_by_the_weight():
    scheduler = create_scheduler(scheduling_policy="fair")
    scheduler.add_request(create_request("r", 10, max_tokens=3, tenant="t", tenant_weight=2.0))
    run_to_completion(scheduler)
    # 10 prompt tokens, then 2 decode steps (the first token comes with the prompt's step).
    ledger = scheduler.policy.ledger
    assert ledger.local["t"] == pytest.approx((10 + 2 * OUTPUT_TOKEN_COST) / 2.0)
    # What the engine reports in its load (EngineLoad.tenant_service).
    assert ledger.reported == ledger.local == scheduler.policy.tenant_service()
    assert ledger.num_live == {}


def test_a_light_tenants_prompt_gets_a_step_without_the_heavy_decodes():
    scheduler = create_scheduler(scheduling_policy="fair")
    for i in range(3):
        scheduler.add_request(create_request(f"heavy{i}", 16, max_tokens=20, tenant="heavy"))
    step(scheduler)
    step(scheduler)  # the heavy requests decode
    scheduler.add_request(create_request("light", 8, max_tokens=4, tenant="light"))

    scheduler_output, _ = step(scheduler)

    assert scheduler_output.num_scheduled_tokens == {"light": 8}
    # The next step has everyone again, decodes first.
    scheduler_output, _ = step(scheduler)
    assert scheduler_output.num_scheduled_tokens == {
        "light": 1,
        "heavy0": 1,
        "heavy1": 1,
        "heavy2": 1,
    }
    run_to_completion(scheduler)
    assert_no_leaked_blocks(scheduler)
