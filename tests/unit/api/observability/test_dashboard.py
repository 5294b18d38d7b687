"""The status page's JSON (services/api/observability/dashboard.py) from hand-built engine steps
through the real ApiMetrics, and who may read it (observability/routes_dashboard.py,
observability/dashboard_auth.py)."""

from __future__ import annotations

import asyncio
import re
from types import SimpleNamespace

import httpx
import pytest

from kvserve.services.api.engine_client.client import EngineClient
from kvserve.services.api.observability.dashboard import dashboard_state
from kvserve.services.api.observability.dashboard_auth import (
    COOKIE_NAME,
    SESSION_S,
    session_token,
    token_key_name,
)
from kvserve.services.api.observability.dashboard_sampler import (
    NUM_HISTORY_POINTS,
    SAMPLE_INTERVAL_S,
    WINDOW_S,
    DashboardSampler,
    quantile,
)
from kvserve.services.api.observability.metrics import ApiMetrics
from kvserve.services.api.observability.slo_metrics import GOODPUT_WINDOW_S
from kvserve.services.api.observability.stats import (
    FinishedRequestStats,
    IterationStats,
    RequestUsage,
)
from kvserve.services.api.server import build_app
from kvserve.services.api.serving.tokenizer import TokenizerInfo
from kvserve.shared.api_config import FrontendConfig, TenantConfig
from kvserve.shared.messages import SchedulerStats
from tests.support.metrics import read_metric

# --------------------------------------------------------------------------- percentiles


def test_quantile_interpolates_within_the_bucket_as_histogram_quantile():
    bounds = [1.0, 2.0, 4.0]
    # 10 observations in (1, 2], 10 in (2, 4]: the median is the top of the first bucket.
    cumulative = [0, 10, 20, 20]
    assert quantile(0.5, bounds, cumulative) == pytest.approx(2.0)
    assert quantile(0.25, bounds, cumulative) == pytest.approx(1.5)
    assert quantile(0.75, bounds, cumulative) == pytest.approx(3.0)
    assert quantile(0.05, [1.0], [10, 10]) == pytest.approx(0.05)  # the first from 0
    # Past the last finite bound: that bound, as Prometheus answers.
    assert quantile(0.99, bounds, [0, 0, 1, 10]) == 4.0
    assert quantile(0.5, bounds, [0, 0, 0, 0]) is None


# --------------------------------------------------------------------------- the state


class Clock:
    def __init__(self, now: float = 1000.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


def make_sampler() -> tuple[EngineClient, ApiMetrics, DashboardSampler, Clock]:
    client = EngineClient(SimpleNamespace(tokenizer=None), max_model_len=512, model_name="m")
    metrics = ApiMetrics(client, "m")
    clock = Clock()
    return client, metrics, DashboardSampler(client, metrics, clock=clock), clock


def step(
    client: EngineClient,
    metrics: ApiMetrics,
    ttfts: list[float] = (),
    itls: list[float] = (),
    prompt: int = 0,
    generated: int = 0,
    finished: int = 0,
    stats: SchedulerStats | None = None,
) -> None:
    """One engine step as the EngineClient hands it to ApiMetrics."""
    iteration = IterationStats(now=0.0, engine_timestamp=0.0)
    iteration.time_to_first_tokens = list(ttfts)
    iteration.first_token_tenants = ["default"] * len(ttfts)
    iteration.inter_token_latencies = list(itls)
    iteration.num_prompt_tokens, iteration.num_generation_tokens = prompt, generated
    iteration.finished_requests = [
        FinishedRequestStats("length", 0.1, 3, 2, 2, None) for _ in range(finished)
    ]
    if stats is not None:
        client.latest_stats = stats
        client.stats_totals.add(stats)
    metrics.record(0, stats, iteration)


def test_state_of_an_idle_server_has_its_engine_and_no_latency():
    client, metrics, sampler, _ = make_sampler()
    state = dashboard_state(sampler, "m", "1.0", show_tenants=True)
    assert state.status == "healthy"
    assert [(e.engine, e.state) for e in state.engines] == [(0, "serving")]
    assert (state.ttft.count, state.ttft.p50, state.itl.p99) == (0, None, None)
    assert state.spec_decode is None and state.tenants == []
    assert state.finished_requests_total == 0
    assert len(state.history.seconds_ago) == NUM_HISTORY_POINTS


def test_latency_rates_and_hits_cover_the_window_only():
    client, metrics, sampler, clock = make_sampler()
    # Old traffic: slow first tokens, prefix misses.
    step(client, metrics, ttfts=[5.0] * 10, prompt=100, generated=10, finished=10,
         stats=SchedulerStats(prefix_cache_queries=100, prefix_cache_hits=0))  # fmt: skip
    clock.now += 1
    sampler.sample()  # the read one interval after a burst (record's trailing read)
    clock.now += WINDOW_S + 60
    sampler.sample()  # the window's start: after the old traffic
    clock.now += 30
    step(client, metrics, ttfts=[0.05] * 4, itls=[0.02] * 8, prompt=40, generated=12,
         finished=4, stats=SchedulerStats(num_running_reqs=2, num_waiting_reqs=1,
                                          kv_cache_usage=0.25, prefix_cache_queries=40,
                                          prefix_cache_hits=30))  # fmt: skip
    clock.now += 2
    state = dashboard_state(sampler, "m", "1.0", show_tenants=True)

    assert state.ttft.count == 4 and state.ttft.p50 is not None and state.ttft.p50 < 0.06
    assert state.ttft.p99 is not None and state.ttft.p99 < 0.06  # the 5 s ones are gone
    assert state.itl.count == 8 and 0.01 < state.itl.p50 <= 0.025
    assert state.prefix_cache_hit_rate == pytest.approx(30 / 40)
    assert state.prefix_cache_hit_rate_total == pytest.approx(30 / 140)
    assert state.finished_requests_total == 14 and state.generation_tokens_total == 22
    # The last 10 s held 40 prompt and 12 output tokens (read 2 s after the step).
    assert state.prompt_tokens_per_s == pytest.approx(40 / 10, rel=0.01)
    assert state.generation_tokens_per_s == pytest.approx(12 / 10, rel=0.01)
    assert (state.num_running, state.num_waiting, state.kv_cache_usage) == (2, 1, 0.25)
    assert state.engines[0].num_running == 2
    assert state.window_s == pytest.approx(WINDOW_S, abs=35)
    # The charts: the step is in the last point, nothing before it (but the first reading).
    history = state.history
    assert history.generation_tokens_per_s[-1] == pytest.approx(12 / 5)
    assert sum(v for v in history.generation_tokens_per_s if v) == pytest.approx(12 / 5)
    assert history.num_running[-1] == 2 and history.kv_cache_usage[-1] == 0.25


def test_history_is_unknown_before_the_api_started():
    client, metrics, sampler, clock = make_sampler()
    clock.now += 22
    history = dashboard_state(sampler, "m", "1.0", show_tenants=True).history
    # 22 s of 300 in points of 5 s: a gauge is known at the last five points' ends, a rate
    # over the last four points only (the fifth began before the start).
    running = [v is not None for v in history.num_running]
    assert running == [False] * (NUM_HISTORY_POINTS - 5) + [True] * 5
    rates = [v is not None for v in history.prompt_tokens_per_s]
    assert rates == [False] * (NUM_HISTORY_POINTS - 4) + [True] * 4


def test_spec_decode_shows_once_drafts_were_verified():
    client, metrics, sampler, _ = make_sampler()
    stats = SchedulerStats(
        spec_num_drafts=4,
        spec_num_draft_tokens=12,
        spec_num_accepted_tokens=6,
        spec_accepted_per_pos=[3, 2, 1],
    )
    step(client, metrics, stats=stats)
    spec = dashboard_state(sampler, "m", "1.0", show_tenants=True).spec_decode
    assert spec is not None
    assert spec.acceptance_rate == pytest.approx(0.5)
    assert spec.mean_acceptance_length == pytest.approx(1 + 6 / 4)
    assert spec.accepted_per_position == pytest.approx([0.75, 0.5, 0.25])


def test_pins_show_per_engine_once_an_engine_pinned_and_on_metrics():
    client, metrics, sampler, _ = make_sampler()
    assert dashboard_state(sampler, "m", "1.0", show_tenants=True).pins == []
    step(client, metrics, stats=SchedulerStats(num_pinned_blocks=12, pin_misses={"5m": 1}))
    step(client, metrics, stats=SchedulerStats(num_pinned_blocks=12, pin_hits={"5m": 2, "1h": 1},
                                               num_pins_expired=1, num_pins_yielded=3))  # fmt: skip
    (pins,) = dashboard_state(sampler, "m", "1.0", show_tenants=True).pins
    assert (pins.engine, pins.num_pinned_blocks) == (0, 12)
    assert pins.hits == {"5m": 2, "1h": 1} and pins.misses == {"5m": 1}
    assert (pins.num_expired, pins.num_yielded) == (1, 3)
    text = metrics.render()[0].decode()
    assert read_metric(text, "kvserve:prompt_pin_hits_total", engine="0", ttl="1h") == 1
    assert read_metric(text, "kvserve:prompt_pinned_blocks", engine="0") == 12
    assert read_metric(text, "kvserve:prompt_pins_yielded_total", engine="0") == 3


def test_tenants_come_from_the_usage_ledger_and_the_engines_load():
    client, metrics, sampler, _ = make_sampler()
    iteration = IterationStats(now=0.0, engine_timestamp=0.0)
    iteration.request_usages = [
        RequestUsage("alpha", 10, 5, ("stop",)),
        RequestUsage("beta", 3, 1, ("length", "length")),
    ]
    stats = SchedulerStats(running_by_tenant={"alpha": 2}, waiting_by_tenant={"gamma": 1})
    client.latest_stats = stats
    metrics.record(0, stats, iteration)
    state = dashboard_state(sampler, "m", "1.0", show_tenants=True)
    by_name = {t.name: t for t in state.tenants}
    assert set(by_name) == {"alpha", "beta", "gamma"}
    alpha, beta = by_name["alpha"], by_name["beta"]
    assert (alpha.num_running, alpha.requests, alpha.prompt_tokens, alpha.total_tokens) == (
        2,
        1,
        10,
        15,
    )
    assert (beta.requests, beta.completion_tokens, beta.total_requests) == (2, 1, 2)
    assert by_name["gamma"].num_waiting == 1
    assert dashboard_state(sampler, "m", "1.0", show_tenants=False).tenants is None


def test_goodput_panel_counts_targets_met_and_missed_in_all_and_per_tenant():
    client, metrics, sampler, _ = make_sampler()
    state = dashboard_state(sampler, "m", "1.0", show_tenants=True)
    assert state.slo.goodput_per_s == 0.0 and state.slo.tenants == []
    assert [(t.target, t.met, t.missed) for t in state.slo.targets] == [
        ("ttft", 0, 0),
        ("tpot", 0, 0),
    ]
    iteration = IterationStats(now=0.0, engine_timestamp=0.0)
    # TTFT 100 ms; TPOT (1000 - 100) / 9 = 100 ms.
    targeted = [
        ("alpha", 200.0, 200.0),  # good
        ("alpha", 50.0, None),  # TTFT missed
        ("beta", None, 200.0),  # good
        ("beta", None, None),  # no target: not counted
    ]
    iteration.finished_requests = [
        FinishedRequestStats("length", 1.0, 3, 10, 10, None, tenant=tenant,
                             time_to_first_token=0.1, ttft_target_ms=ttft, tpot_target_ms=tpot)
        for tenant, ttft, tpot in targeted
    ]  # fmt: skip
    metrics.record(0, None, iteration)
    slo = dashboard_state(sampler, "m", "1.0", show_tenants=True).slo
    assert slo.goodput_per_s == pytest.approx(2 / GOODPUT_WINDOW_S)
    assert [(t.target, t.met, t.missed) for t in slo.targets] == [("ttft", 1, 1), ("tpot", 2, 0)]
    by_name = {t.name: t for t in slo.tenants}
    assert set(by_name) == {"alpha", "beta"}
    assert by_name["alpha"].goodput_per_s == pytest.approx(1 / GOODPUT_WINDOW_S)
    assert [(t.met, t.missed) for t in by_name["alpha"].targets] == [(1, 1), (1, 0)]
    assert [(t.met, t.missed) for t in by_name["beta"].targets] == [(0, 0), (1, 0)]
    assert dashboard_state(sampler, "m", "1.0", show_tenants=False).slo.tenants is None


@pytest.mark.anyio
async def test_a_burst_is_read_one_interval_after_its_last_step():
    client = EngineClient(SimpleNamespace(tokenizer=None), max_model_len=512, model_name="m")
    metrics = ApiMetrics(client, "m")
    sampler = DashboardSampler(client, metrics)
    client.stat_loggers.append(sampler)
    step(client, metrics, generated=3)
    sampler.record(0, None, IterationStats(now=0.0, engine_timestamp=0.0))  # too soon: later
    assert len(sampler.readings) == 1
    await asyncio.sleep(SAMPLE_INTERVAL_S + 0.3)
    assert len(sampler.readings) == 2 and sampler.readings[-1].generation_tokens == 3


def test_readings_are_throttled_and_pruned_to_the_window():
    client, metrics, sampler, clock = make_sampler()
    for _ in range(1000):
        clock.now += 0.5
        sampler.sample()
    assert len(sampler.readings) <= WINDOW_S + 2  # one a second at most
    assert sampler.readings[0].time <= clock.now - WINDOW_S < sampler.readings[1].time


# --------------------------------------------------------------------------- the key


def test_session_token_is_bound_to_its_key_and_expiry():
    keys = {"admin": "sk-admin", "alpha": "sk-alpha"}
    now = 1_000_000.0
    token = session_token("sk-alpha", int(now) + SESSION_S)
    assert token_key_name(token, keys, clock=lambda: now) == "alpha"
    assert "sk-alpha" not in token
    assert token_key_name(token, keys, clock=lambda: now + SESSION_S + 1) is None  # expired
    assert token_key_name(token, {"admin": "sk-admin"}, clock=lambda: now) is None  # key gone
    expires, mac = token.split(".")
    forged = f"{int(expires) + 3600}.{mac}"  # a later expiry with the old signature
    assert token_key_name(forged, keys, clock=lambda: now) is None
    far = session_token("sk-alpha", int(now) + 100 * SESSION_S)  # longer than a session
    assert token_key_name(far, keys, clock=lambda: now) is None
    for junk in ("", ".", "x.y", "-1.ab", "9" * 40 + ".ab"):
        assert token_key_name(junk, keys, clock=lambda: now) is None


KEYS = {"admin": "sk-admin-1", "alpha": "sk-alpha-1"}


@pytest.fixture(scope="module")
def tokenizer_info(tiny_llama_dir) -> TokenizerInfo:
    return TokenizerInfo(tiny_llama_dir)


def client_of(app) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test")


def keyed_app(tokenizer_info):
    engine_client = EngineClient(tokenizer_info, 256, "tiny")
    frontend = FrontendConfig(disable_log_stats=True, tenants=TenantConfig())
    return build_app(engine_client, served_model_name="tiny", frontend=frontend, api_keys=KEYS)


@pytest.mark.anyio
async def test_without_a_key_the_page_redirects_and_its_json_is_401(tokenizer_info):
    async with client_of(keyed_app(tokenizer_info)) as client:
        response = await client.get("/dashboard/state")
        assert response.status_code == 401
        assert "log in at /dashboard/login" in response.json()["error"]["message"]
        page = await client.get("/dashboard")
        assert page.status_code == 303 and page.headers["location"] == "/dashboard/login"
        login = await client.get("/dashboard/login")
        assert login.status_code == 200 and 'name="key"' in login.text
        # A wrong key: the form again, 401, no cookie.
        wrong = await client.post("/dashboard/login", data={"key": "sk-nope"})
        assert wrong.status_code == 401 and "not known" in wrong.text
        assert COOKIE_NAME not in wrong.cookies
        client.cookies.set(COOKIE_NAME, "99999999999.deadbeef")
        assert (await client.get("/dashboard/state")).status_code == 401
        client.cookies.clear()
        # The /v1 key check is untouched, and the script and style are public.
        assert (await client.get("/v1/models")).status_code == 401
        assert (await client.get("/dashboard/app.js")).status_code == 200


@pytest.mark.anyio
async def test_login_sets_a_cookie_that_opens_the_page_and_only_admins_see_tenants(
    tokenizer_info,
):
    async with client_of(keyed_app(tokenizer_info)) as client:
        response = await client.post("/dashboard/login", data={"key": KEYS["alpha"]})
        assert response.status_code == 303 and response.headers["location"] == "/dashboard"
        cookie = response.headers["set-cookie"]
        assert KEYS["alpha"] not in cookie
        for attribute in ("HttpOnly", "SameSite=strict", "Path=/dashboard", f"Max-Age={SESSION_S}"):
            assert re.search(attribute, cookie, re.IGNORECASE), cookie
        page = await client.get("/dashboard")  # the client keeps the cookie
        assert page.status_code == 200
        assert "script-src 'self'" in page.headers["content-security-policy"]
        state = (await client.get("/dashboard/state")).json()
        assert state["needs_key"] is True and state["tenants"] is None  # alpha is no admin
        assert state["slo"]["tenants"] is None
        assert [e["engine"] for e in state["engines"]] == [0]
        # The session cookie is no API key.
        assert (await client.get("/v1/models")).status_code == 401
        logout = await client.post("/dashboard/logout")
        assert logout.status_code == 303 and COOKIE_NAME in logout.headers["set-cookie"]

    async with client_of(keyed_app(tokenizer_info)) as client:
        bearer = {"Authorization": f"Bearer {KEYS['admin']}"}
        state = (await client.get("/dashboard/state", headers=bearer)).json()
        assert state["tenants"] == []  # an admin key sees them (none yet)


@pytest.mark.anyio
async def test_without_keys_the_page_is_open(tokenizer_info):
    engine_client = EngineClient(tokenizer_info, 256, "tiny")
    app = build_app(
        engine_client, served_model_name="tiny", frontend=FrontendConfig(disable_log_stats=True)
    )
    async with client_of(app) as client:
        assert (await client.get("/dashboard")).status_code == 200
        state = (await client.get("/dashboard/state")).json()
        assert state["needs_key"] is False and state["tenants"] == []
        assert state["model"] == "tiny"
        # The goodput panel's figures, before any request with a target.
        assert state["slo"]["goodput_per_s"] == 0.0 and state["slo"]["tenants"] == []
        assert [t["target"] for t in state["slo"]["targets"]] == ["ttft", "tpot"]
        page = (await client.get("/dashboard")).text
        assert 'id="slo"' in page and 'id="goodput"' in page


@pytest.fixture
def anyio_backend():
    return "asyncio"
