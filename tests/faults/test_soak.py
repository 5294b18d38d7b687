"""Two minutes of chaos, at CI size: bench/soak.py against the tiny model.

DP=2 beside a KV store, API keys with tenants; a few `openai` clients send a constant mix
(short and long, streams and not, a required tool, a JSON schema, cancellations, a slow
reader) while a seeded schedule SIGKILLs or SIGSTOPs an engine core, a worker, the store,
the coordinator and the api's helper, and reloads the key file. Afterwards: no failure
outside the documented causes, no KV block or store lease left, every process's RSS within
10% of its value at the end of warm-up, and the greedy sample answered under chaos as it
was undisturbed. The 30-minute run with the default model is the bench's own
(bench/RESULTS.md, "Thirty minutes of chaos").
"""

from __future__ import annotations

import pytest

from bench.soak import build_parser, run_soak

pytestmark = pytest.mark.slow

# Two minutes (the first 30 s warm-up, 90 s of chaos; it was three minutes, cut to keep the
# suite in its 15 minutes: the bench's 30-minute soaks reach every target many times).
DURATION_S = 120
# Seed 1's shuffled cycle starts engine core, KV store, key file, worker, api helper,
# coordinator: the first three are hit within 90 s of chaos (pauses of 4.5-13.5 s at this
# size, each after the deployment recovered).
SEED = 1


def test_two_minutes_of_chaos_lose_and_leak_nothing(tmp_path):
    args = build_parser().parse_args(
        [
            "--model", "tiny",
            "--variant", "dp",
            "--duration", str(DURATION_S),
            "--seed", str(SEED),
            "--clients", "3",
            "--slow-clients", "1",
            "--warmup-s", "30",
            "--max-rss-growth-pct", "10",
            "--log-dir", str(tmp_path),
        ]
    )  # fmt: skip
    report = run_soak(args)

    requests, leaks = report["requests"], report["leaks"]
    context = f"log: {tmp_path}/serve.log; chaos: {report['chaos']}"
    assert requests["completed"] > 50, (requests, context)
    assert requests["defects"] == 0, (requests["failed_by_cause"], context)
    assert {e["target"] for e in report["chaos"]} >= {"engine", "kv_store", "key_file"}, context
    assert all(e["recovered_s"] is not None for e in report["chaos"]), context
    assert leaks["engine_blocks"]["idle"], leaks
    assert all(e["leaked_blocks"] == 0 for e in leaks["engine_blocks"]["engines"].values()), leaks
    assert leaks["store"]["leaked_leases"] == 0 == leaks["store"]["leaked_reservations"], leaks
    grown = [p for p in report["resources"]["processes"] if p["rss_growth_pct"] > 10]
    assert not grown, grown
    greedy = report["greedy_sample"]
    assert greedy["compared"] > 0 and greedy["equal"] == greedy["compared"], greedy
    assert not report["orphans"], report["orphans"]
