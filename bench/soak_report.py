"""The soak's report: failures by cause, resource growth, leaks, the greedy sample.

A failure is either a documented cause (DOCUMENTED_CAUSES: the answer the docs promise for
that situation, checked against when it happened) or a defect, named by what the client saw
(status and the error body's first words) and listed with the chaos event it fell in.
"""

from __future__ import annotations

import re
import time

import httpx

from bench.soak_chaos import ChaosEvent, ProcessSeries
from bench.soak_load import Outcome
from tests.support.metrics import metrics_text, read_metric
from tests.support.waiting import wait_until

# cause -> (what the client sees, the docs that promise it)
DOCUMENTED_CAUSES = {
    "no_live_engine": (
        "503 'the engine is dead: ...' while no engine core (of the request's stage) serves",
        "docs/scale-out.md: engine failure, 'the api answers 503 meanwhile'",
    ),
    "in_flight_to_last_engine": (
        "EngineDeadError naming the engine core (a 503, or an error event in a stream) for a "
        "request in flight to the last live engine core of its stage as it died",
        "docs/kv-store.md, P/D: 'with none left the request fails with EngineDeadError (503) "
        "naming it'; issue 52 asks that it wait for the restart instead",
    ),
}
# A 503 within this many seconds of a window with no engine serving is that window's.
WINDOW_SLACK_S = 3.0


def classify(outcome: Outcome, t0: float, no_engine: list[tuple[float, float]]) -> str:
    """The failure's cause: a key of DOCUMENTED_CAUSES, or "defect: <what the client saw>"."""
    start, end = outcome.start - t0, outcome.end - t0
    near = any(a - WINDOW_SLACK_S <= end and start <= b + WINDOW_SLACK_S for a, b in no_engine)
    if near and outcome.error.startswith("503") and "engine is dead" in outcome.error:
        return "no_live_engine"
    if near and "EngineDeadError" in outcome.error and " died" in outcome.error:
        return "in_flight_to_last_engine"
    # Ids, pids and times vary between failures of one kind; the status code does not.
    signature = re.sub(r"[0-9a-f]{8,}|\d+\.\d+|\d{4,}", "N", outcome.error)[:90]
    return f"defect: {signature}"


def event_at(events: list[ChaosEvent], outcome: Outcome, t0: float) -> str:
    """The last chaos event before the failure ended (the one it most likely fell in)."""
    end = outcome.end - t0
    before = [e for e in events if e.at <= end]
    if not before:
        return "none"
    e = before[-1]
    return f"{e.target} {e.action} (pid {e.pid}) at {e.at} s"


def requests_summary(
    outcomes: list[Outcome], t0: float, events: list[ChaosEvent], no_engine: list
) -> dict:
    """Sent, completed, cancelled, failed by cause (with up to 3 examples each)."""
    by_cause: dict[str, dict] = {}
    for outcome in outcomes:
        if outcome.status != "failed":
            continue
        cause = classify(outcome, t0, no_engine)
        entry = by_cause.setdefault(cause, {"count": 0, "examples": []})
        entry["count"] += 1
        if len(entry["examples"]) < 3:
            entry["examples"].append(
                {
                    "shape": outcome.shape,
                    "at_s": round(outcome.end - t0, 1),
                    "seconds": round(outcome.end - outcome.start, 1),
                    "client_saw": outcome.error,
                    "during": event_at(events, outcome, t0),
                }
            )
    shapes = sorted({o.shape for o in outcomes})
    return {
        "sent": len(outcomes),
        "completed": sum(o.status == "completed" for o in outcomes),
        "cancelled_by_client": sum(o.status == "cancelled" for o in outcomes),
        "failed": sum(o.status == "failed" for o in outcomes),
        "by_shape": {s: sum(o.shape == s for o in outcomes) for s in shapes},
        "failed_by_cause": by_cause,
        "defects": sum(v["count"] for k, v in by_cause.items() if k.startswith("defect")),
    }


# ---------------------------------------------------------------------- resources


def growth(series: ProcessSeries, warmup_end: float, warmup_s: float) -> dict | None:
    """RSS / fds / threads at the end against the first sample after warm-up (for a process
    started later, warm-up counted from its start); None when it has no such sample or
    none after it."""
    base_t = max(warmup_end, series.started + warmup_s)
    later = [s for s in series.samples if s[0] >= base_t and s[1] > 0]  # 0: a zombie's
    if len(later) < 2:
        return None
    (t_base, rss0, fds0, thr0), (t_end, rss1, fds1, thr1) = later[0], later[-1]
    return {
        "pid": series.pid,
        "role": series.role,
        "from_s": t_base,
        "to_s": t_end,
        "rss_mib": [round(rss0 / 2**20, 1), round(rss1 / 2**20, 1)],
        "rss_growth_pct": round(100 * (rss1 - rss0) / rss0, 1),
        "fds": [fds0, fds1],
        "threads": [thr0, thr1],
        "peak_rss_mib": round(max(s[1] for s in series.samples) / 2**20, 1),
    }


def resources_summary(
    series: dict[int, ProcessSeries], warmup_end: float, warmup_s: float, end: float
) -> dict:
    """Growth of each process alive at the end (`end`: the last sample's time); the pids of
    those that died (killed) or started too late to have a warm sample."""
    alive = {pid: s for pid, s in series.items() if s.samples[-1][0] >= end and s.samples[-1][1]}
    grown = {pid: growth(s, warmup_end, warmup_s) for pid, s in alive.items()}
    return {
        "processes": [g for g in grown.values() if g is not None],
        "too_young_pids": [pid for pid, g in grown.items() if g is None],
        "exited_pids": sorted(set(series) - set(alive)),
    }


# ---------------------------------------------------------------------- leaks


def engine_blocks(url: str, idle_timeout_s: float = 60.0) -> dict:
    """Once the engines are idle: each engine's KV blocks still held by a request (its own
    kv_cache_usage_perc x its allocatable blocks: free blocks back to the total is 0)."""
    idle = wait_until(lambda: _idle(url), timeout_s=idle_timeout_s, interval_s=0.2)
    text = metrics_text(url)
    engines = {}
    for engine in sorted(set(re.findall(r'engine="(\d+)"', text))):
        usage = read_metric(text, "kvserve:kv_cache_usage_perc", default=0.0, engine=engine)
        total = _num_blocks(text, engine)
        engines[engine] = {
            "num_blocks": total,
            "usage": usage,
            "leaked_blocks": round(usage * (total - 1)) if total else None,
        }
    return {"idle": idle, "engines": engines}


def _idle(url: str) -> bool:
    try:
        text = metrics_text(url)
    except (AssertionError, httpx.HTTPError):
        return False
    gauges = ("kvserve:num_requests_running", "kvserve:num_requests_waiting")
    return not any(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.split("{", 1)[0] in gauges
    )


def _num_blocks(text: str, engine: str) -> int:
    for line in text.splitlines():
        if line.startswith("kvserve:cache_config_info{") and f'engine="{engine}"' in line:
            found = re.search(r'num_gpu_blocks="(\d+)"', line)
            return int(found[1]) if found else 0
    return 0


def store_leases(address: str, lease_timeout_s: float = 30.0) -> dict:
    """The store's leases and reservations once idle; held past the lease timeout they are
    leaked (a client that dies leaks nothing only once its leases expire)."""
    from kvserve.services.kv_store.client import KvStoreClient
    from kvserve.shared.messages import KvFingerprint

    probe = KvFingerprint(
        model="soak-probe",
        dtype="float32",
        block_size=16,
        num_layers=1,
        num_kv_heads=1,
        head_size=1,
    )
    client = KvStoreClient(address, probe, timeout_s=5.0, connect=False)

    def held() -> tuple[int, int]:
        stats = client.stats()
        return stats.num_leases, stats.num_reserved

    at_idle = held()
    deadline = time.monotonic() + lease_timeout_s + 5
    while held() != (0, 0) and time.monotonic() < deadline:
        time.sleep(0.2)
    leases, reserved = held()
    return {"at_idle": list(at_idle), "leaked_leases": leases, "leaked_reservations": reserved}


# ---------------------------------------------------------------------- markdown


def markdown(report: dict) -> str:
    """The report as a short markdown summary."""
    req, leaks, greedy = report["requests"], report["leaks"], report["greedy_sample"]
    lines = [
        f"## Soak: {report['variant']}, {report['duration_s']:.0f} s, seed {report['seed']}",
        "",
        f"Command: `{report['command']}`",
        "",
        f"Requests: {req['sent']} sent, {req['completed']} completed, "
        f"{req['cancelled_by_client']} cancelled by their client, {req['failed']} failed "
        f"({req['defects']} outside the documented causes).",
        "",
        "| cause | count | what the client saw (first example) | during |",
        "|---|---|---|---|",
    ]
    for cause, entry in req["failed_by_cause"].items():
        example = entry["examples"][0]
        saw = example["client_saw"].replace("|", "/")[:160]
        lines.append(f"| {cause[:60]} | {entry['count']} | {saw} | {example['during']} |")
    lines += ["", "Chaos events:", ""]
    for e in report["chaos"]:
        lines.append(
            f"- {e['at']} s: {e['action']} {e['target']} (pid {e['pid']})"
            + (f" for {e['stop_s']} s" if e["stop_s"] else "")
            + f"; serving again after {e['recovered_s']} s {e['note']}"
        )
    lines += ["", "| process | role | RSS MiB (warm -> end) | growth | fds | threads |"]
    lines.append("|---|---|---|---|---|---|")
    for p in sorted(report["resources"]["processes"], key=lambda p: p["role"]):
        lines.append(
            f"| {p['pid']} | {p['role']} | {p['rss_mib'][0]} -> {p['rss_mib'][1]} | "
            f"{p['rss_growth_pct']:+.1f}% | {p['fds'][0]} -> {p['fds'][1]} | "
            f"{p['threads'][0]} -> {p['threads'][1]} |"
        )
    blocks = {e: v["leaked_blocks"] for e, v in leaks["engine_blocks"]["engines"].items()}
    lines += [
        "",
        f"Leaks once idle: KV blocks held per engine {blocks}; store leases "
        f"{leaks['store'].get('leaked_leases')}, reservations "
        f"{leaks['store'].get('leaked_reservations')}.",
        f"Greedy sample: {greedy['equal']}/{greedy['compared']} equal to the undisturbed run "
        f"({greedy['num_prompts']} prompts); {greedy['failed']} failed.",
    ]
    return "\n".join(lines) + "\n"
