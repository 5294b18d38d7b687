"""`kvserve bench serve --tenants` against a real tiny server that attributes tenants.

The server takes the key file's keys and trusts X-Tenant. The mix has three tenants: heavy
and light with their own keys, and an intruder whose key the server does not know, so the
JSON must hold each tenant's own completions, output tokens, percentiles and errors. A
`--dataset-name mixed` run against the same server checks that only the targeted class's
requests carry targets (the server's own kvserve:request_slo_total counts them).
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.support.metrics import metrics_text, read_metric
from tests.support.server import start_tiny_server

pytestmark = pytest.mark.slow

BENCH_TIMEOUT_S = 120  # a loaded 2-core machine; each run takes a few seconds when idle
KEY_FILE = "heavy:sk-heavy weight=2\nlight:sk-light\n"
MIX = (
    "heavy:rate=inf,conc=4,input=48,output=8,num=8,key=sk-heavy,weight=2;"
    "light:rate=20,input=16,output=4,num=3,key=sk-light;"
    "intruder:input=8,output=2,num=2,key=sk-wrong"
)


@pytest.fixture(scope="module")
def base_url(tiny_llama_dir, tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("serve")
    key_file = log_dir / "keys.txt"
    key_file.write_text(KEY_FILE)
    server = start_tiny_server(
        tiny_llama_dir, log_dir, "--api-key-file", str(key_file), "--tenant-header", "X-Tenant"
    )
    try:
        server.wait_healthy()
        yield server.url
    finally:
        server.stop()


def bench_serve(base_url: str, model_dir: str, result_path, *args: str) -> tuple[str, dict]:
    """Run `kvserve bench serve ARGS` against the server; its stdout and the saved JSON."""
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvserve.cli",
            "bench",
            "serve",
            "--base-url",
            base_url,
            "--tokenizer",
            model_dir,
            "--disable-tqdm",
            "--ignore-eos",
            "--save-result",
            "--result-dir",
            str(result_path.parent),
            "--result-filename",
            result_path.name,
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=BENCH_TIMEOUT_S,
        check=False,
    )
    assert done.returncode == 0, f"{done.stdout}\n{done.stderr}"
    return done.stdout, json.loads(result_path.read_text())


def bench_tenants(base_url: str, model_dir: str, result_path, *args: str) -> tuple[str, dict]:
    """Run `kvserve bench serve --tenants MIX ARGS`; its stdout and the saved JSON."""
    return bench_serve(
        base_url, model_dir, result_path, "--tenants", MIX, "--tenant-header", "X-Tenant", *args
    )


def check_tenant(result: dict, name: str, num: int, input_len: int, output_len: int) -> None:
    tenant = result["tenants"][name]
    assert tenant["num_requests"] == tenant["completed"] == num, tenant["error_examples"]
    assert tenant["failed"] == 0 and tenant["error_examples"] == []
    assert tenant["total_output_tokens"] == num * output_len
    assert tenant["input_len"] == input_len and tenant["output_len"] == output_len
    for metric in ("ttft", "tpot", "e2el"):
        assert 0 < tenant[f"mean_{metric}_ms"], metric
        assert (
            0
            < tenant[f"p50_{metric}_ms"]
            <= tenant[f"p90_{metric}_ms"]
            <= tenant[f"p99_{metric}_ms"]
            <= tenant[f"max_{metric}_ms"]
        ), metric
    mine = [i for i, owner in enumerate(result["request_tenants"]) if owner == name]
    # The tiny byte-level tokenizer can miss a random prompt's length by a token or two.
    assert all(abs(result["input_lens"][i] - input_len) < 8 for i in mine)
    assert [result["output_lens"][i] for i in mine] == [output_len] * num


def test_mix_reports_each_tenant(base_url, tiny_llama_dir, tmp_path):
    stdout, result = bench_tenants(base_url, tiny_llama_dir, tmp_path / "mix.json")
    assert list(result["tenants"]) == ["heavy", "light", "intruder"]
    assert result["request_tenants"] == ["heavy"] * 8 + ["light"] * 3 + ["intruder"] * 2
    check_tenant(result, "heavy", 8, 48, 8)
    check_tenant(result, "light", 3, 16, 4)
    assert result["tenants"]["heavy"]["weight"] == 2.0
    assert result["tenants"]["light"]["request_rate"] == 20.0
    assert result["tenants"]["heavy"]["max_concurrency"] == 4
    # The unknown key fails on its own tenant only.
    intruder = result["tenants"]["intruder"]
    assert (intruder["completed"], intruder["failed"]) == (0, 2)
    assert intruder["error_examples"][0].startswith("HTTP 401")
    # The totals are the tenants' sums.
    assert (result["completed"], result["failed"]) == (11, 2)
    assert result["total_output_tokens"] == 8 * 8 + 3 * 4
    assert result["tenant_header"] == "X-Tenant" and result["request_rate"] is None
    assert "sk-heavy" not in json.dumps(result)
    assert "============ Serving Benchmark Result ============" in stdout
    assert "Per-tenant Result" in stdout
    rows: dict[str, list[str]] = {}  # a tenant's first row: its counts
    for line in stdout.splitlines():
        if line.strip():
            rows.setdefault(line.split()[0], line.split()[1:])
    assert rows["heavy"][:3] == ["8", "0", "64"] and rows["intruder"][:2] == ["2", "2"]


def test_one_tenant_alone(base_url, tiny_llama_dir, tmp_path):
    stdout, alone = bench_tenants(
        base_url, tiny_llama_dir, tmp_path / "alone.json", "--tenants-only", "light"
    )
    assert list(alone["tenants"]) == ["light"]
    check_tenant(alone, "light", 3, 16, 4)
    assert (alone["completed"], alone["failed"]) == (3, 0)
    assert alone["request_tenants"] == ["light"] * 3
    assert "heavy" not in stdout


def test_mixed_classes_send_their_targets_and_report_apart(base_url, tiny_llama_dir, tmp_path):
    """--dataset-name mixed: only the short class carries target headers; the server's
    request_slo_total counts exactly those requests, and the report splits the classes."""
    before = slo_counts(base_url)
    stdout, result = bench_serve(
        base_url,
        tiny_llama_dir,
        tmp_path / "mixed.json",
        "--api-key",
        "sk-light",
        "--dataset-name",
        "mixed",
        "--mix",
        "short:16:4:0.8:ttft=1e9:tpot=1e9,long:200:4:0.2",
        "--num-prompts",
        "10",
        "--request-rate",
        "50",
        "--seed",
        "1",
    )
    num_short = result["request_classes"].count("short")
    assert 0 < num_short < 10 and result["completed"] == 10
    short, long = result["classes"]["short"], result["classes"]["long"]
    assert (short["num_requests"], long["num_requests"]) == (num_short, 10 - num_short)
    assert short["request_goodput"] > 0 and long["request_goodput"] is None
    assert short["p50_ttft_ms"] <= short["p99_ttft_ms"] and long["p50_itl_ms"] > 0
    assert "Per-class Result" in stdout
    after = slo_counts(base_url)
    assert after["ttft"] - before["ttft"] == num_short
    assert after["tpot"] - before["tpot"] == num_short


def slo_counts(base_url: str) -> dict[str, float]:
    """The server's kvserve:request_slo_total met counts per target (every target is met)."""
    text = metrics_text(base_url)
    return {
        target: read_metric(text, "kvserve:request_slo_total", 0.0, target=target, outcome="met")
        for target in ("ttft", "tpot")
    }
