"""Usage per tenant: the ledger's minute buckets and ranges (an injected clock), its bounds,
the per-tenant series against the responses' `usage`, and GET /v1/usage's access rules."""

from __future__ import annotations

from types import SimpleNamespace

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvserve.services.api.engine_client.client import EngineClient, StatsTotals
from kvserve.services.api.observability.metrics import ApiMetrics
from kvserve.services.api.observability.stats import IterationStats, RequestUsage
from kvserve.services.api.server import build_app
from kvserve.services.api.serving.base import count_usage
from kvserve.services.api.serving.output_processor import OutputProcessor
from kvserve.services.api.serving.tokenizer import TokenizerInfo
from kvserve.services.api.tenancy.usage import OTHER_TENANT, TenantCap, UsageLedger
from kvserve.shared.api_config import FrontendConfig
from kvserve.shared.messages import EngineCoreOutput, FinishReason, SchedulerStats
from kvserve.shared.sampling_params import SamplingParams

T0 = 1_764_892_800.0  # a whole minute


class Clock:
    def __init__(self, now: float = T0):
        self.now = now

    def __call__(self) -> float:
        return self.now


def ended(*usages: RequestUsage) -> IterationStats:
    return IterationStats(0.0, 0.0, request_usages=list(usages))


def usage(tenant: str, prompt: int, completion: int, n: int = 1) -> RequestUsage:
    return RequestUsage(tenant, prompt, completion, ("length",) * n)


def totals(ledger: UsageLedger, start=None, end=None) -> dict[str, tuple[int, int, int, int]]:
    report = ledger.report(start, end)
    return {
        name: (t.requests, t.prompt_tokens, t.completion_tokens, t.total_tokens)
        for name, t in report.tenants.items()
    }


# --------------------------------------------------------------------------- the ledger


def test_ledger_sums_per_tenant_and_counts_every_choice():
    ledger = UsageLedger(Clock())
    ledger.record(0, None, ended(usage("alpha", 5, 3), usage("beta", 7, 8, n=2)))
    ledger.record(1, None, ended(usage("alpha", 1, 2)))
    ledger.record(0, None, IterationStats(0.0, 0.0))  # a step that ended nothing
    assert totals(ledger) == {"alpha": (2, 6, 5, 11), "beta": (2, 7, 8, 15)}
    report = ledger.report()
    assert (report.object, report.start, report.end) == ("usage", T0, T0 + 60)


def test_range_counts_whole_minutes_that_overlap_it():
    clock = Clock()
    ledger = UsageLedger(clock)
    for minute in range(3):  # one request at T0+10, T0+70, T0+130
        clock.now = T0 + 60 * minute + 10
        ledger.record(0, None, ended(usage("alpha", 1, 10**minute)))
    assert totals(ledger)["alpha"][2] == 111
    # [T0+65, T0+70): inside the second minute, which counts whole.
    assert totals(ledger, T0 + 65, T0 + 70)["alpha"][2] == 10
    report = ledger.report(T0 + 65, T0 + 70)
    assert (report.start, report.end) == (T0 + 60, T0 + 120)
    # The end is not included: [T0, T0+120) is the first two minutes.
    assert totals(ledger, T0, T0 + 120)["alpha"][2] == 11
    assert totals(ledger, T0 + 59.5, T0 + 120.5)["alpha"][2] == 111
    assert totals(ledger, start=T0 + 120)["alpha"][2] == 100
    assert totals(ledger, end=T0 + 1) == {"alpha": (1, 1, 1, 2)}
    assert totals(ledger, end=T0) == {}  # before the first bucket
    assert totals(ledger, start=T0 + 600) == {}  # after the last
    assert totals(ledger, T0 + 600, T0 + 700) == {}  # nothing then
    assert totals(ledger, T0 + 60, T0 + 60)["alpha"][2] == 10  # an instant: its minute


def test_ledger_keeps_seven_days_then_drops_the_oldest_minutes():
    clock = Clock()
    ledger = UsageLedger(clock)
    ledger.record(0, None, ended(usage("alpha", 1, 1)))
    clock.now = T0 + 7 * 24 * 3600 - 60  # the oldest bucket is still inside 7 days
    ledger.record(0, None, ended(usage("alpha", 1, 1)))
    assert totals(ledger)["alpha"][0] == 2
    clock.now = T0 + 7 * 24 * 3600 + 60
    ledger.record(0, None, ended(usage("beta", 1, 1)))
    assert totals(ledger) == {"alpha": (1, 1, 1, 2), "beta": (1, 1, 1, 2)}
    assert ledger.num_cells == 2


def test_ledger_past_max_cells_drops_the_oldest_minutes_first():
    clock = Clock()
    ledger = UsageLedger(clock, max_cells=4)
    for minute in range(3):
        clock.now = T0 + 60 * minute
        ledger.record(0, None, ended(usage("alpha", 1, 1), usage("beta", 1, 1)))
    assert ledger.num_cells == 4
    assert min(ledger.buckets) == int(T0 // 60) + 1
    # One minute with more cells than the cap keeps that minute.
    clock.now = T0 + 600
    ledger.record(0, None, ended(*(usage(f"t{i}", 1, 1) for i in range(6))))
    assert list(ledger.buckets) == [int(T0 // 60) + 10]
    assert ledger.num_cells == 6


def test_tenants_past_the_cap_count_as_other_and_log_once(caplog):
    cap = TenantCap(max_tenants=2)
    names = [cap(name) for name in ("a", "b", "c", "a", "d")]
    assert names == ["a", "b", OTHER_TENANT, "a", OTHER_TENANT]
    assert sum("more than 2 distinct tenants" in r.message for r in caplog.records) == 1
    ledger = UsageLedger(Clock(), max_tenants=1)
    ledger.record(0, None, ended(usage("a", 1, 1), usage("b", 2, 2), usage("c", 3, 3)))
    assert totals(ledger) == {"a": (1, 1, 1, 2), OTHER_TENANT: (2, 5, 5, 10)}


# --------------------------------------------------------------------------- the series


def samples(metrics: ApiMetrics, name: str) -> dict[tuple, float]:
    text = metrics.render()[0].decode()
    return {
        tuple(sorted(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == name
    }


def test_tenant_series_and_ledger_equal_the_usage_of_the_responses():
    client = EngineClient(SimpleNamespace(tokenizer=None), max_model_len=100, model_name="m")
    metrics = ApiMetrics(client, "m")
    processor: OutputProcessor = client.output_processor
    processor.add_request("a", None, [1, 2, 3], SamplingParams(n=2, max_tokens=3), "alpha")
    processor.add_request("b", None, [1, 2], SamplingParams(max_tokens=2), "beta")
    processor.add_request("c", None, [9] * 5, SamplingParams(max_tokens=4), "alpha")
    steps = [
        [EngineCoreOutput("0_a", [5]), EngineCoreOutput("1_a", [5, 6]), EngineCoreOutput("b", [7])],
        [
            EngineCoreOutput("0_a", [6], finish_reason=FinishReason.STOP),
            EngineCoreOutput("1_a", [7], finish_reason=FinishReason.LENGTH),
            EngineCoreOutput("b", [8], finish_reason=FinishReason.LENGTH),
            EngineCoreOutput("c", [1, 2]),
        ],
    ]
    finals = []
    for outputs in steps:
        stats = IterationStats(0.0, 0.0)
        request_outputs, _ = processor.process_outputs(outputs, stats)
        finals += [o for o in request_outputs if o.finished]
        metrics.record(0, None, stats)
    assert count_usage(finals) == (3 + 2, 2 + 3 + 2)
    # "c" is aborted after 2 tokens: its client saw no usage, but the tokens were made.
    aborted = IterationStats(0.0, 0.0)
    processor.abort_request("c", aborted)
    metrics.record(0, None, aborted)

    prompt = samples(metrics, "kvserve:tenant_prompt_tokens_total")
    generation = samples(metrics, "kvserve:tenant_generation_tokens_total")
    assert prompt == {(("tenant", "alpha"),): 3 + 5, (("tenant", "beta"),): 2}
    assert generation == {(("tenant", "alpha"),): 2 + 3 + 2, (("tenant", "beta"),): 2}
    requests = samples(metrics, "kvserve:tenant_requests_total")
    assert requests == {
        (("finished_reason", "stop"), ("tenant", "alpha")): 1,
        (("finished_reason", "length"), ("tenant", "alpha")): 1,
        (("finished_reason", "abort"), ("tenant", "alpha")): 1,
        (("finished_reason", "length"), ("tenant", "beta")): 1,
    }
    ttft = samples(metrics, "kvserve:tenant_time_to_first_token_seconds_count")
    assert ttft == {(("tenant", "alpha"),): 3, (("tenant", "beta"),): 1}
    assert totals(metrics.usage) == {"alpha": (3, 8, 7, 15), "beta": (1, 2, 2, 4)}


def test_tenant_gauges_sum_the_engines_latest_stats():
    engines = [
        (0, SchedulerStats(running_by_tenant={"alpha": 2}, waiting_by_tenant={"beta": 1})),
        (1, SchedulerStats(running_by_tenant={"alpha": 1, "beta": 3})),
        (2, None),
    ]
    client = EngineClient(SimpleNamespace(tokenizer=None), max_model_len=100, model_name="m")
    metrics = ApiMetrics(client, "m")
    client.per_engine_stats = lambda: [  # type: ignore[method-assign]
        (index, stats, StatsTotals()) for index, stats in engines
    ]
    running = samples(metrics, "kvserve:tenant_num_requests_running")
    waiting = samples(metrics, "kvserve:tenant_num_requests_waiting")
    assert running == {(("tenant", "alpha"),): 3, (("tenant", "beta"),): 3}
    assert waiting == {(("tenant", "alpha"),): 0, (("tenant", "beta"),): 1}
    engines[:] = [(0, SchedulerStats())]  # idle: the tenants stay, at 0
    assert samples(metrics, "kvserve:tenant_num_requests_running") == {
        (("tenant", "alpha"),): 0,
        (("tenant", "beta"),): 0,
    }


# --------------------------------------------------------------------------- the route

KEYS = {"admin": "sk-admin", "alpha": "sk-alpha"}
QUIET = FrontendConfig(disable_log_stats=True)


@pytest.fixture(scope="module")
def tokenizer_info(tiny_llama_dir) -> TokenizerInfo:
    return TokenizerInfo(tiny_llama_dir)


async def get_usage(app, query: str = "", key: str | None = None) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
        return await client.get("/v1/usage" + query, headers=headers)


@pytest.mark.anyio
async def test_usage_route_needs_an_admin_key(tokenizer_info):
    client = EngineClient(tokenizer_info, 256, "tiny")
    app = build_app(client, served_model_name="tiny", frontend=QUIET, api_keys=KEYS)
    app.state.ctx.metrics.usage.record(0, None, ended(usage("alpha", 4, 2)))
    response = await get_usage(app, key="sk-admin")
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["object"] == "usage"
    assert body["tenants"] == {
        "alpha": {"requests": 1, "prompt_tokens": 4, "completion_tokens": 2, "total_tokens": 6}
    }
    response = await get_usage(app, key="sk-alpha")
    assert response.status_code == 403
    assert "--usage-admin-keys" in response.json()["error"]["message"]
    assert (await get_usage(app)).status_code == 401


@pytest.mark.anyio
@pytest.mark.parametrize(
    "query", ["?start=abc", "?end=-1", "?start=nan", "?end=inf", "?start=1e13", "?start=20&end=10"]
)
async def test_usage_route_refuses_bad_bounds(tokenizer_info, query):
    app = build_app(EngineClient(tokenizer_info, 256, "tiny"), served_model_name="tiny")
    response = await get_usage(app, query)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] in ("start", "end")


@pytest.mark.anyio
async def test_usage_route_is_open_without_keys(tokenizer_info):
    app = build_app(EngineClient(tokenizer_info, 256, "tiny"), served_model_name="tiny")
    response = await get_usage(app, "?start=0&end=60.5")
    assert response.status_code == 200, response.text
    assert response.json() == {"object": "usage", "start": 0, "end": 120, "tenants": {}}
