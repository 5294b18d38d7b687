"""Per-tenant quotas (services/api/tenancy/quotas.py) on a fake clock: concurrency, requests and
tokens per minute, reservations kept honest when a request ends early, Retry-After, idle
tenants forgotten; and SettledResults, which settles a ticket however a stream ends."""

from __future__ import annotations

import asyncio
import gc

import pytest

from kvserve.services.api.serving.errors import APIError
from kvserve.services.api.serving.outputs import CompletionOutput, RequestOutput
from kvserve.services.api.tenancy.quotas import SettledResults, TenantQuotas, has_quotas
from kvserve.services.api.tenancy.tenants import TenantSpec


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def quotas(clock) -> TenantQuotas:
    return TenantQuotas(clock)


def refused(quotas: TenantQuotas, spec: TenantSpec, prompt: int = 1, new: int = 1) -> APIError:
    with pytest.raises(APIError) as info:
        quotas.admit(spec, prompt, new)
    return info.value


def retry_after(exc: APIError) -> int:
    assert exc.status_code == 429 and exc.headers is not None
    return int(exc.headers["Retry-After"])


def test_has_quotas():
    assert not has_quotas(TenantSpec(name="a", weight=3))
    assert has_quotas(TenantSpec(name="a", max_concurrent=1))
    assert has_quotas(TenantSpec(name="a", tokens_per_minute=1))
    assert has_quotas(TenantSpec(name="a", requests_per_minute=1))


def test_concurrency_one_slot_per_request_freed_once(quotas):
    spec = TenantSpec(name="batch", max_concurrent=2)
    first = quotas.admit(spec, 10, 100)
    second = quotas.admit(spec, 10, 100)
    exc = refused(quotas, spec)
    assert retry_after(exc) == 1
    assert "'batch'" in exc.message and "max_concurrent limit 2" in exc.message
    assert "--tenant-max-concurrent" in exc.message
    first.settle(20)
    first.settle(20)  # a second settle frees nothing more
    third = quotas.admit(spec, 10, 100)
    refused(quotas, spec)
    for ticket in (second, third):
        ticket.settle(0)
    assert quotas.in_use("batch") == (0, 3, 20)  # first used 20 tokens, the others none


def test_tenants_are_counted_apart(quotas):
    one = TenantSpec(name="one", max_concurrent=1)
    quotas.admit(one, 1, 1)
    quotas.admit(TenantSpec(name="two", max_concurrent=1), 1, 1)
    refused(quotas, one)


def test_requests_per_minute_and_retry_after(quotas, clock):
    spec = TenantSpec(name="search", requests_per_minute=3)
    for _ in range(3):
        quotas.admit(spec, 1, 1).settle(2)
        clock.now += 10.0
    # Admitted at 1000, 1010, 1020; now 1030: the first leaves the window at 1060.
    exc = refused(quotas, spec)
    assert retry_after(exc) == 30
    assert "requests_per_minute limit 3" in exc.message and "3 requests" in exc.message
    assert "--tenant-requests-per-minute" in exc.message
    clock.now = 1059.5
    assert retry_after(refused(quotas, spec)) == 1  # ceil(0.5)
    clock.now = 1060.0
    quotas.admit(spec, 1, 1).settle(2)
    # Refused requests never counted: the window holds 1010, 1020, 1060.
    assert quotas.in_use("search") == (0, 3, 6)


def test_requests_per_minute_lowered_by_a_reload(quotas, clock):
    spec = TenantSpec(name="t", requests_per_minute=4)
    for second in range(4):
        clock.now = 1000.0 + second
        quotas.admit(spec, 1, 1).settle(2)
    # Lowered to 2: the window may hold 1 before one more is admitted, so the three
    # admitted at 1000, 1001 and 1002 must leave first.
    exc = refused(quotas, TenantSpec(name="t", requests_per_minute=2))
    assert retry_after(exc) == 59  # 1002 + 60 - 1003


def test_tokens_per_minute_reserves_prompt_and_max_tokens(quotas, clock):
    spec = TenantSpec(name="search", tokens_per_minute=1000)
    first = quotas.admit(spec, 100, 400)  # reserves 500
    clock.now += 5.0
    quotas.admit(spec, 100, 300)  # 900 in the window
    clock.now += 5.0
    exc = refused(quotas, spec, 50, 100)  # 1050 > 1000
    assert "tokens_per_minute limit 1000" in exc.message and "900 tokens" in exc.message
    assert "--tenant-tokens-per-minute" in exc.message
    # The first reservation (500) leaves at 1060: 50 s from now.
    assert retry_after(exc) == 50
    # It ends early, having generated 50 tokens: 350 of its reservation come back.
    first.settle(150)
    assert quotas.in_use("search") == (1, 2, 550)
    quotas.admit(spec, 50, 100)
    assert quotas.in_use("search") == (2, 3, 700)


def test_tokens_retry_after_waits_for_enough_tokens(quotas, clock):
    spec = TenantSpec(name="t", tokens_per_minute=100)
    for _ in range(4):
        quotas.admit(spec, 10, 10).settle(20)  # 20 tokens each, at 1000, 1010, 1020, 1030
        clock.now += 10.0
    # 80 in the window, 50 more asked: 30 must leave, that is the first two (at 1010 + 60).
    assert retry_after(refused(quotas, spec, 25, 25)) == 30


def test_settle_never_raises_the_reservation(quotas):
    spec = TenantSpec(name="t", tokens_per_minute=100)
    quotas.admit(spec, 10, 10).settle(500)
    assert quotas.in_use("t") == (0, 1, 20)


def test_a_request_larger_than_the_limit_is_a_400(quotas):
    spec = TenantSpec(name="t", tokens_per_minute=100)
    exc = refused(quotas, spec, 20, 81)
    assert exc.status_code == 400 and exc.param == "max_tokens"
    assert "never be admitted" in exc.message and "lower max_tokens" in exc.message
    quotas.admit(spec, 20, 80)  # exactly the limit fits an empty window


def test_a_charge_older_than_the_window_is_not_settled_again(quotas, clock):
    spec = TenantSpec(name="t", tokens_per_minute=100)
    long_running = quotas.admit(spec, 10, 90)
    clock.now += 61.0
    quotas.admit(spec, 10, 90)  # the first charge left the window
    long_running.settle(40)
    assert quotas.in_use("t") == (1, 1, 100)


def test_idle_tenants_are_forgotten(quotas, clock):
    spec = TenantSpec(name="a", requests_per_minute=10)
    ticket = quotas.admit(spec, 1, 1)
    clock.now += 61.0
    assert len(quotas) == 1  # in flight: kept past the window
    ticket.settle(2)
    assert len(quotas) == 0  # nothing in flight, the window empty
    for name in ("b", "c"):
        quotas.admit(TenantSpec(name=name, max_concurrent=1), 1, 1).settle(2)
    assert len(quotas) == 2  # their windows still hold a request
    clock.now += 60.0
    quotas.admit(TenantSpec(name="d", max_concurrent=1), 1, 1)  # a sweep is due
    assert len(quotas) == 1 and quotas.in_use("b") is None


# --------------------------------------------------------------------------- SettledResults


def output(index: int, num_prompt: int, num_generated: list[int], error=False) -> RequestOutput:
    outputs = [
        CompletionOutput(i, token_ids=list(range(n)), finish_reason="error" if error else None)
        for i, n in enumerate(num_generated)
    ]
    return RequestOutput(f"r{index}", None, list(range(num_prompt)), outputs)


async def items(*outputs: tuple[int, RequestOutput], fail: Exception | None = None):
    for item in outputs:
        yield item
        await asyncio.sleep(0)
    if fail is not None:
        raise fail


SPEC = TenantSpec(name="t", tokens_per_minute=1000, max_concurrent=1)


def settled(quotas, *outputs, fail=None) -> SettledResults:
    # Two prompts of 10 and 20 tokens, n=2, max_tokens 50: 230 reserved.
    ticket = quotas.admit(SPEC, 30, 200)
    return SettledResults(items(*outputs, fail=fail), ticket, [10, 20])


async def drain(results) -> None:
    async for _ in results:
        pass


def test_settled_results_count_what_was_generated(quotas):
    results = settled(quotas, (0, output(0, 10, [3, 4])), (1, output(1, 20, [5, 5])))
    asyncio.run(drain(results))
    assert quotas.in_use("t") == (0, 1, 47)


def test_settled_results_early_close_counts_what_came(quotas):
    async def first_then_close():
        results = settled(quotas, (0, output(0, 10, [3, 4])), (1, output(1, 20, [5, 5])))
        await anext(results)
        await results.aclose()
        await results.aclose()

    asyncio.run(first_then_close())
    # Prompt 0: 10 + 7; prompt 1 produced nothing yet but was submitted: its 20 prompt tokens.
    assert quotas.in_use("t") == (0, 1, 37)


def test_settled_results_closed_before_the_first_item(quotas):
    asyncio.run(settled(quotas).aclose())
    assert quotas.in_use("t") == (0, 1, 30)


def test_settled_results_failure_and_rejection(quotas):
    results = settled(quotas, (0, output(0, 10, [0, 0], error=True)), fail=RuntimeError("x"))
    with pytest.raises(RuntimeError):
        asyncio.run(drain(results))
    # The engine rejected prompt 0 (nothing); prompt 1 never answered (its prompt).
    assert quotas.in_use("t") == (0, 1, 20)


def test_settled_results_cancelled(quotas):
    async def cancelled():
        gate = asyncio.Event()

        async def waits():
            yield 0, output(0, 10, [1, 1])
            await gate.wait()

        ticket = quotas.admit(SPEC, 30, 200)
        task = asyncio.create_task(drain(SettledResults(waits(), ticket, [10, 20])))
        await asyncio.sleep(0.01)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    asyncio.run(cancelled())
    assert quotas.in_use("t") == (0, 1, 32)


def test_settled_results_dropped_unclosed(quotas):
    results = settled(quotas)
    del results
    gc.collect()
    assert quotas.in_use("t") == (0, 1, 30)


def test_each_refusal_is_reported_with_its_limit(clock):
    refusals: list[tuple[str, str]] = []
    quotas = TenantQuotas(clock, on_refused=lambda tenant, limit: refusals.append((tenant, limit)))
    quotas.admit(TenantSpec(name="a", max_concurrent=1), 1, 1)
    refused(quotas, TenantSpec(name="a", max_concurrent=1))
    quotas.admit(TenantSpec(name="b", requests_per_minute=1), 1, 1)
    refused(quotas, TenantSpec(name="b", requests_per_minute=1))
    quotas.admit(TenantSpec(name="c", tokens_per_minute=10), 4, 4)
    refused(quotas, TenantSpec(name="c", tokens_per_minute=10), 2, 2)
    too_big = refused(quotas, TenantSpec(name="d", tokens_per_minute=10), 20, 1)
    assert too_big.status_code == 400
    assert refusals == [
        ("a", "max_concurrent"),
        ("b", "requests_per_minute"),
        ("c", "tokens_per_minute"),
        ("d", "tokens_per_minute"),
    ]
