"""The soak's bookkeeping (bench/soak_report.py, bench/soak_chaos.py) on hand-made samples:
which failures are documented, the windows with no engine serving, and RSS growth."""

from __future__ import annotations

from bench.soak_chaos import ChaosEvent, ProcessSeries, Watcher, num_serving
from bench.soak_load import Outcome
from bench.soak_report import classify, growth, requests_summary, resources_summary

DEAD_503 = '503 {"error":{"message":"the engine is dead: the engine is not healthy"}}'


def failed(start: float, end: float, error: str) -> Outcome:
    return Outcome("short", "alice", start, end, status="failed", error=error)


def test_a_503_is_documented_only_while_no_engine_serves():
    windows = [(40.0, 55.0)]
    assert classify(failed(50.0, 50.1, DEAD_503), 0.0, windows) == "no_live_engine"
    # The same answer while an engine served is a defect, named by what the client saw.
    cause = classify(failed(100.0, 100.1, DEAD_503), 0.0, windows)
    assert cause.startswith("defect: 503") and "engine is dead" in cause
    in_flight = "error event {'message': 'EngineDeadError: engine core process X (pid 7) died'}"
    assert classify(failed(30.0, 41.0, in_flight), 0.0, windows) == "in_flight_to_last_engine"
    assert classify(failed(1.0, 2.0, "ReadTimeout: timed out"), 0.0, windows).startswith("defect")


def test_requests_summary_counts_causes_and_names_the_event():
    outcomes = [
        Outcome("short", "bob", 1.0, 2.0),
        Outcome("cancel", "bob", 1.0, 2.0, status="cancelled"),
        failed(50.0, 51.0, DEAD_503),
        failed(90.0, 91.0, "500 internal"),
    ]
    events = [ChaosEvent(45.0, "engine", "kill", pid=11), ChaosEvent(85.0, "kv_store", "stop")]
    summary = requests_summary(outcomes, 0.0, events, [(44.0, 60.0)])
    assert (summary["sent"], summary["completed"], summary["failed"]) == (4, 1, 2)
    assert summary["cancelled_by_client"] == 1 and summary["defects"] == 1
    assert summary["failed_by_cause"]["no_live_engine"]["count"] == 1
    (defect,) = [v for k, v in summary["failed_by_cause"].items() if k.startswith("defect")]
    assert defect["examples"][0]["during"] == "kv_store stop (pid 0) at 85.0 s"


def test_no_engine_windows_merge_consecutive_samples():
    watcher = Watcher(deployment=None, t0=0.0)  # type: ignore[arg-type]
    watcher.serving_samples = [(1.0, 2), (2.0, 0), (3.0, 0), (4.0, 1), (9.0, 0), (10.0, 2)]
    assert watcher.no_engine_windows() == [(1.0, 4.0), (8.0, 10.0)]


def test_pd_serving_counts_the_smaller_stage():
    health = {
        "engines": [
            {"state": "serving", "kv_role": "kv_producer"},
            {"state": "dead", "kv_role": "kv_consumer"},
        ]
    }
    assert num_serving(health) == 0
    health["engines"][1]["state"] = "serving"
    assert num_serving(health) == 1


def test_growth_from_warm_sample_to_the_end_of_live_processes_only():
    mib = 2**20
    warm = ProcessSeries(1, "engine", started=0.0)
    warm.samples = [(10.0, 90 * mib, 9, 3), (30.0, 100 * mib, 10, 4), (90.0, 108 * mib, 10, 4)]
    late = ProcessSeries(2, "engine", started=80.0)  # restarted: no warm sample yet
    late.samples = [(85.0, 50 * mib, 5, 2), (90.0, 60 * mib, 5, 2)]
    killed = ProcessSeries(3, "worker", started=0.0)
    killed.samples = [(30.0, 100 * mib, 5, 2), (40.0, 0, 0, 0)]
    assert growth(warm, warmup_end=30.0, warmup_s=30.0)["rss_growth_pct"] == 8.0
    summary = resources_summary({1: warm, 2: late, 3: killed}, 30.0, 30.0, end=90.0)
    assert [p["pid"] for p in summary["processes"]] == [1]
    assert summary["too_young_pids"] == [2] and summary["exited_pids"] == [3]
