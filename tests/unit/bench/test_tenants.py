"""`kvserve bench serve --tenants`: the spec grammar, the sources it builds, per-tenant figures."""

from __future__ import annotations

import argparse
import math

import pytest

from kvserve.benchmarks import serve
from kvserve.benchmarks.endpoint_client import RequestRecord
from kvserve.benchmarks.serve_runner import build_sources, parse_run_options
from kvserve.benchmarks.tenants import (
    TenantTraffic,
    format_tenant_report,
    parse_tenants,
    select_tenants,
    summarize_tenant,
)

DEFAULTS = TenantTraffic(
    name="",
    index=0,
    request_rate=math.inf,
    max_concurrency=None,
    input_len=1024,
    output_len=128,
    num_prompts=1000,
)
MIX = "heavy:rate=inf,conc=32,input=1024,output=64,num=200;light:rate=1,input=128,output=32,num=20"


def bench_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    serve.add_parser(parser.add_subparsers())
    return parser.parse_args(["serve", *argv])


def test_spec_fields_and_defaults():
    heavy, light = parse_tenants(MIX + ";", DEFAULTS)
    assert heavy == TenantTraffic("heavy", 0, math.inf, 32, 1024, 64, 200)
    assert light == TenantTraffic("light", 1, 1.0, None, 128, 32, 20)
    [solo] = parse_tenants(" solo : key=sk-a=b , weight=2.5 ", DEFAULTS)
    # Fields not given come from the defaults (the flags); a key may hold '='.
    assert solo == TenantTraffic("solo", 0, math.inf, None, 1024, 128, 1000, "sk-a=b", 2.5)
    assert solo.config() == {
        "request_rate": "inf",
        "max_concurrency": None,
        "input_len": 1024,
        "output_len": 128,
        "num_prompts": 1000,
        "weight": 2.5,
    }
    assert "sk-a=b" not in str(solo.config())  # the key stays out of the result JSON


@pytest.mark.parametrize(
    "spec, message",
    [
        ("a:rate=1;a:num=2", "tenant 'a' appears twice"),
        ("a:speed=3", "unknown field 'speed' .fields: rate, conc, input, output, num, key"),
        ("a:num=ten", "num=ten: 'ten' is not an integer"),
        ("a:num=1.5", "num=1.5: '1.5' is not an integer"),
        ("a:conc=0", "conc=0: must be an integer >= 1"),
        ("a:rate=-1", "rate=-1: must be a number > 0"),
        ("a:rate=nan", "rate=nan: must be a number > 0"),
        ("a:rate=fast", "rate=fast: 'fast' is not a number"),
        ("a:weight=0", "weight=0: must be a number > 0"),
        ("a:key=", "key=: must not be empty"),
        ("a:num", "expected FIELD=VALUE, got 'num'"),
        ("a:num=1,num=2", "num is given twice"),
        (":num=1", "'' is not a tenant name"),
        ("bad name:num=1", "'bad name' is not a tenant name"),
        (" ; ", "names no tenant"),
    ],
)
def test_spec_errors_name_the_problem(spec, message):
    with pytest.raises(ValueError, match=f"^--tenants.*{message}"):
        parse_tenants(spec, DEFAULTS)


def test_tenants_only_keeps_spec_order_and_positions():
    tenants = parse_tenants("a;b;c", DEFAULTS)
    assert select_tenants(tenants, None) == tenants
    assert [(t.name, t.index) for t in select_tenants(tenants, "c, a")] == [("a", 0), ("c", 2)]
    for only in ("d", "a,d", ","):
        with pytest.raises(ValueError, match=r"--tenants-only .* \(a, b, c\)"):
            select_tenants(tenants, only)


def test_flags_give_the_defaults_and_are_checked():
    options = parse_run_options(
        bench_args("--tenants", "a:num=3;b", "--num-prompts", "5", "--random-input-len", "7")
    )
    assert [(t.name, t.num_prompts, t.input_len) for t in options.tenants] == [
        ("a", 3, 7),
        ("b", 5, 7),
    ]
    assert options.gaps == []  # each tenant has its own arrivals
    assert parse_run_options(bench_args()).tenants == []
    for argv, message in (
        (["--tenants-only", "a"], "--tenants-only picks tenants of --tenants"),
        (["--tenants", "a", "--dataset-name", "prefix"], "--tenants sends random prompts"),
        (["--tenants", "a", "--burstiness", "0"], "--burstiness must be > 0"),
        (["--tenants", "a", "--tenants-only", "b"], "--tenants-only 'b'"),
    ):
        with pytest.raises(ValueError, match=message):
            parse_run_options(bench_args(*argv))


def test_sources_carry_headers_and_keep_prompts_under_tenants_only(tokenizer, monkeypatch):
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)  # --api-key's default
    spec = "heavy:rate=inf,conc=2,input=12,output=3,num=4,key=sk-heavy;light:rate=5,input=6,num=2"
    argv = ["--tenants", spec, "--api-key", "sk-main", "--seed", "3"]
    mix = build_sources(bench_args(*argv), parse_run_options(bench_args(*argv)), tokenizer)
    heavy, light = mix
    assert heavy.headers == {"Authorization": "Bearer sk-heavy", "X-Tenant": "heavy"}
    assert light.headers == {"Authorization": "Bearer sk-main", "X-Tenant": "light"}
    assert (heavy.max_concurrency, light.max_concurrency) == (2, None)
    assert [r.prompt_len for r in heavy.requests] == [12] * 4
    assert [r.expected_output_len for r in light.requests] == [128] * 2  # --random-output-len
    assert heavy.gaps == [0.0] * 4 and all(gap > 0 for gap in light.gaps)
    # Run alone, light sends the prompts and arrivals it sends in the mix.
    alone_argv = [*argv, "--tenants-only", "light", "--tenant-header", "X-Team"]
    [alone] = build_sources(
        bench_args(*alone_argv), parse_run_options(bench_args(*alone_argv)), tokenizer
    )
    assert alone.requests == light.requests and alone.gaps == light.gaps
    assert alone.headers == {"Authorization": "Bearer sk-main", "X-Team": "light"}
    # Without --tenants: the flags' one source, as before.
    plain_argv = ["--num-prompts", "2", "--random-input-len", "5", "--max-concurrency", "3"]
    [plain] = build_sources(
        bench_args(*plain_argv), parse_run_options(bench_args(*plain_argv)), tokenizer
    )
    assert plain.tenant is None and plain.headers == {}
    assert [r.prompt_len for r in plain.requests] == [5, 5] and plain.gaps == [0.0, 0.0]
    assert plain.max_concurrency == 3


def record(ttft: float, itl: list[float], start: float = 100.0) -> RequestRecord:
    return RequestRecord(
        success=True,
        prompt_len=10,
        start_time=start,
        ttft=ttft,
        itl=itl,
        latency=ttft + sum(itl),
        generated_text="x",
        output_tokens=len(itl) + 1,
    )


def test_tenant_summary_counts_its_own_requests(tokenizer):
    tenant = TenantTraffic("light", 1, 1.0, None, 10, 3, 4)
    records = [
        record(0.1, [0.02, 0.02]),
        record(0.2, [0.04, 0.04]),
        record(0.3, [0.06, 0.06]),
        RequestRecord(prompt_len=10, start_time=101.0, error="HTTP 429: over quota"),
    ]
    result = summarize_tenant(tenant, records, 2.0, tokenizer, [99.9], {}, 100.0)
    assert result["request_rate"] == 1.0 and result["weight"] == 1.0
    assert result["num_requests"] == 4
    assert (result["completed"], result["failed"]) == (3, 1)
    assert result["total_output_tokens"] == 9
    assert result["duration"] == 2.0 and result["output_throughput"] == pytest.approx(4.5)
    assert result["error_examples"] == ["HTTP 429: over quota"]
    assert result["mean_ttft_ms"] == pytest.approx(200.0)
    assert result["p50_ttft_ms"] == pytest.approx(200.0)
    assert result["mean_tpot_ms"] == pytest.approx(40.0)
    assert result["mean_e2el_ms"] == pytest.approx(280.0)
    # p50/p90/p99 always, the asked percentiles too.
    for metric in ("ttft", "tpot", "e2el"):
        values = [result[f"p{p}_{metric}_ms"] for p in ("50", "90", "99", "99.9")]
        assert values == sorted(values)


def test_tenant_table(tokenizer):
    results = {
        "heavy": summarize_tenant(
            TenantTraffic("heavy", 0, math.inf, 2, 10, 3, 2),
            [record(0.5, [0.1, 0.1]), record(0.7, [0.1, 0.1])],
            1.0,
            tokenizer,
            [99],
            {},
            100.0,
        ),
        "a-long-tenant-name": summarize_tenant(
            TenantTraffic("a-long-tenant-name", 1, 1.0, None, 10, 3, 1),
            [RequestRecord(prompt_len=10, start_time=100.0, error="HTTP 500")],
            1.0,
            tokenizer,
            [99],
            {},
            100.0,
        ),
    }
    lines = format_tenant_report(results, ["ttft", "e2el"]).splitlines()
    width = len(lines[0])
    assert lines[0] == f"{' Per-tenant Result ':=^{width}}" and lines[-1] == "=" * width
    assert lines[1].split() == ["Tenant", "Requests", "Failed", "Out", "tokens", "Out", "tok/s"]
    assert lines[2].split() == ["heavy", "2", "0", "6", "6.00"]
    assert lines[3].split() == ["a-long-tenant-name", "1", "1", "0", "0.00"]
    assert lines[4].strip("-") == " TTFT (ms) "
    assert lines[5].split() == ["Tenant", "P50", "P90", "P99", "Mean"]
    assert lines[6].split()[0] == "heavy" and float(lines[6].split()[-1]) == pytest.approx(600.0)
    assert lines[8].strip("-") == " E2EL (ms) "
    assert not any("TPOT" in line for line in lines)
    # The columns line up whatever the names' lengths.
    assert len({len(line) for line in lines if not line.startswith(("=", "-"))}) == 1


def test_tenant_targets_travel_as_headers_and_judge_its_goodput(tokenizer, monkeypatch):
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    spec = "chat:input=6,output=3,num=2,ttft=150,tpot=50.5;batch:input=6,output=3,num=2"
    argv = ["--tenants", spec]
    chat, batch = build_sources(bench_args(*argv), parse_run_options(bench_args(*argv)), tokenizer)
    assert chat.headers == {"X-Tenant": "chat", "x-slo-ttft-ms": "150", "x-slo-tpot-ms": "50.5"}
    assert batch.headers == {"X-Tenant": "batch"}
    assert chat.request_slos() == [{"ttft": 150.0, "tpot": 50.5}] * 2
    quiet = ["--no-target-headers", *argv]
    quiet_chat, _ = build_sources(
        bench_args(*quiet), parse_run_options(bench_args(*quiet)), tokenizer
    )
    assert quiet_chat.headers == {"X-Tenant": "chat"}
    assert quiet_chat.request_slos() == chat.request_slos()
    assert batch.request_slos() == [{}, {}]
    tenant = chat.tenant
    assert tenant.config()["ttft_ms"] == 150.0 and "ttft_ms" not in batch.tenant.config()
    # TTFT 100 and 200 ms, TPOT 20 ms: one of two meets the tenant's targets.
    records = [record(0.1, [0.02, 0.02]), record(0.2, [0.02, 0.02])]
    result = summarize_tenant(tenant, records, 2.0, tokenizer, [99], {}, 100.0)
    assert result["request_goodput"] == pytest.approx(1 / 2.0)
    # --goodput's targets add to the tenant's, which win where both set one.
    result = summarize_tenant(tenant, records, 2.0, tokenizer, [99], {"e2el": 100.0}, 100.0)
    assert result["request_goodput"] == 0.0
    lines = format_tenant_report({"chat": result}, ["ttft"]).splitlines()
    assert lines[1].split()[-2:] == ["Good", "req/s"] and lines[2].split()[-1] == "0.000"
    for bad, message in (("ttft=0", "must be a number > 0"), ("tpot=inf", "finite")):
        with pytest.raises(ValueError, match=message):
            parse_tenants(f"a:{bad}", DEFAULTS)
