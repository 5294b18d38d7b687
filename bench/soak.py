"""Chaos under load: a whole deployment, constant mixed traffic, seeded faults; then the bill.

    PYTHONPATH=. .venv/bin/python bench/soak.py [--duration 1800] [--seed 0]
        [--model PATH|tiny] [--variant dp|pd] [--out report.json] [--markdown report.md]

It starts `kvserve serve` as a user would (bench/soak_deploy.py: DP=2 beside a KV store, or
P/D; API keys with tenants from a key file), answers a greedy sample undisturbed, then drives
constant mixed load from `openai` clients (bench/soak_load.py) for --duration seconds. After
a warm-up (a fifth of the run, 30 s at least), a seeded chaos schedule (bench/soak_chaos.py)
SIGKILLs or SIGSTOPs an engine core, a worker, the KV store, the DP coordinator or the api's
helper process, or edits the key file and SIGHUPs the api, every 30-90 s (pauses and
freezes scaled by duration / 1800 for shorter runs, 0.15 at least), while the greedy sample
runs again and again. Then it stops the load, waits for the engines to go idle, reads their
KV blocks and the store's leases, stops everything and reports (bench/soak_report.py):
requests sent / completed / failed by cause (documented or defect, with what the client saw),
the greedy sample against the undisturbed run, RSS / fds / threads of every process from
warm-up to the end, and leaks. Exit status 0 when every check holds.

--model tiny serves tests/support/models.py's tiny random Llama (CI: tests/faults/
test_soak.py); the default is the embedded default model.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shlex
import sys
import tempfile
import threading
import time

if __package__ in (None, ""):  # run as a script: the repository root on sys.path
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.soak_chaos import Chaos, Watcher, events_json  # noqa: E402
from bench.soak_deploy import Deployment, DeploymentSpec  # noqa: E402
from bench.soak_load import GreedySample, Load, LoadConfig  # noqa: E402
from bench.soak_report import (  # noqa: E402
    engine_blocks,
    markdown,
    requests_summary,
    resources_summary,
    store_leases,
)

logger = logging.getLogger("soak")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--duration", type=float, default=1800.0, help="seconds of load")
    parser.add_argument("--seed", type=int, default=0, help="the chaos schedule's and the mix's")
    parser.add_argument(
        "--model", default=None, help="a model folder or GGUF, 'tiny' (default: the default)"
    )
    parser.add_argument("--variant", choices=("dp", "pd"), default="dp")
    parser.add_argument("--out", default=None, help="the JSON report's path")
    parser.add_argument("--markdown", default=None, help="the markdown summary's path")
    parser.add_argument("--clients", type=int, default=None, help="mixed clients (4 / 6)")
    parser.add_argument("--slow-clients", type=int, default=None, help="slow readers (1 / 2)")
    parser.add_argument("--warmup-s", type=float, default=None, help="default: a fifth, >= 30")
    parser.add_argument("--max-rss-growth-pct", type=float, default=10.0)
    parser.add_argument(
        "--request-timeout-s", type=float, default=240.0, help="a client's wait (then: hung)"
    )
    parser.add_argument("--log-dir", default=None, help="default: a new temporary folder")
    return parser


def load_config(args: argparse.Namespace, tiny: bool) -> LoadConfig:
    """The mix: the tiny model's byte-level prompts stay under its 512 positions."""
    return LoadConfig(
        num_clients=args.clients or (4 if tiny else 6),
        num_slow=args.slow_clients if args.slow_clients is not None else (1 if tiny else 2),
        max_tokens=24 if tiny else 16,
        long_words=40 if tiny else 200,
        seed=args.seed,
        timeout_s=args.request_timeout_s,
    )


def deployment_for(args: argparse.Namespace, folder: str) -> Deployment:
    tiny = args.model == "tiny"
    model = args.model
    if tiny:
        from tests.support.models import build_tiny_llama

        model = build_tiny_llama(os.path.join(folder, "tiny-llama"))
    spec = DeploymentSpec(
        variant=args.variant,
        model=model,
        tiny=tiny,
        folder=folder,
        kv_cache_memory="16M" if tiny else "256M",
        max_model_len=None if tiny else 1024,
    )
    return Deployment(spec)


def run_soak(args: argparse.Namespace) -> dict:
    """The whole soak; its report (a dict, as --out writes it)."""
    folder = args.log_dir or tempfile.mkdtemp(prefix="kvserve-soak-")
    os.makedirs(folder, exist_ok=True)
    deployment = deployment_for(args, folder)
    tiny = deployment.spec.tiny
    started = time.monotonic()
    try:
        deployment.start()
        greedy = GreedySample(deployment.url, 4, 16, args.request_timeout_s)
        greedy.run_reference()
        logger.info("serving after %.1f s; the greedy sample answered", time.monotonic() - started)
        phases = run_phases(args, deployment, greedy, load_config(args, tiny))
        phases["leaks"] = leaks(deployment)
    finally:
        orphans = stop(deployment)
    return build_report(args, deployment, greedy, phases, orphans)


def run_phases(
    args: argparse.Namespace, deployment: Deployment, greedy: GreedySample, config: LoadConfig
) -> dict:
    """Load (primed first: Load.prime); after warm-up, chaos and the greedy sample beside
    it; then everything stops."""
    load = Load(deployment.url, config)
    load.prime()
    t0 = time.monotonic()
    warmup_s = args.warmup_s if args.warmup_s is not None else max(30.0, args.duration / 5)
    watcher = Watcher(deployment, t0, interval_s=5.0 if args.duration < 600 else 10.0)
    chaos = Chaos(deployment, args.seed, max(0.15, min(1.0, args.duration / 1800)), t0)
    stop_watch, stop_chaos = threading.Event(), threading.Event()
    watch_thread = _thread(watcher.run, stop_watch)
    load.start()
    time.sleep(warmup_s)
    logger.info("warm-up over after %.0f s; chaos starts", warmup_s)
    threads = [_thread(chaos.run, stop_chaos), _thread(greedy.run_under_chaos, stop_chaos)]
    time.sleep(max(0.0, t0 + args.duration - time.monotonic()))
    stop_chaos.set()
    for thread in threads:
        thread.join()
    load.finish()
    last_sample_s = round(time.monotonic() - t0, 1)
    watcher.sample(last_sample_s)
    stop_watch.set()
    watch_thread.join()
    logger.info(
        "load stopped after %.0f s; %d chaos events", time.monotonic() - t0, len(chaos.events)
    )
    return {
        "t0": t0,
        "warmup_s": warmup_s,
        "last_sample_s": last_sample_s,
        "load": load,
        "chaos": chaos,
        "watcher": watcher,
    }


def _thread(target, stop: threading.Event) -> threading.Thread:
    thread = threading.Thread(target=target, args=(stop,), daemon=True)
    thread.start()
    return thread


def leaks(deployment: Deployment) -> dict:
    """KV blocks held once the engines are idle, and the store's leases."""
    deployment.restart_store_if_dead()
    address = deployment.store_address
    if deployment.spec.variant == "pd":
        address = deployment.health().get("kv_store", "")
    return {"engine_blocks": engine_blocks(deployment.url), "store": store_leases(address)}


def stop(deployment: Deployment) -> list[str]:
    """Stop the deployment; what outlived it."""
    orphans = []
    if deployment.front is not None:
        try:
            deployment.front.stop()
        except AssertionError as exc:
            orphans.append(str(exc))
    if deployment.store is not None and deployment.store.poll() is None:
        deployment.store.terminate()
        deployment.store.wait(30)
    return orphans


def build_report(
    args: argparse.Namespace,
    deployment: Deployment,
    greedy: GreedySample,
    phases: dict,
    orphans: list[str],
) -> dict:
    t0, chaos, watcher = phases["t0"], phases["chaos"], phases["watcher"]
    no_engine = watcher.no_engine_windows()
    outcomes = phases["load"].outcomes + greedy.outcomes
    report = {
        "variant": args.variant,
        "seed": args.seed,
        "duration_s": args.duration,
        "warmup_s": phases["warmup_s"],
        "model": args.model or "default",
        "command": shlex.join([os.path.relpath(sys.argv[0]), *sys.argv[1:]]),
        "log_dir": deployment.spec.folder,
        "requests": requests_summary(outcomes, t0, chaos.events, no_engine),
        "chaos": events_json(chaos.events),
        "store_restarts_by_soak": deployment.store_restarts,
        "no_engine_windows_s": no_engine,
        "resources": resources_summary(
            watcher.series, phases["warmup_s"], phases["warmup_s"], phases["last_sample_s"]
        ),
        "leaks": phases["leaks"],
        "greedy_sample": greedy_summary(greedy),
        "orphans": orphans,
    }
    report["checks"] = checks(report, args.max_rss_growth_pct)
    report["ok"] = all(report["checks"].values())
    return report


def greedy_summary(greedy: GreedySample) -> dict:
    return {
        "num_prompts": greedy.num_prompts,
        "compared": len(greedy.compared),
        "equal": sum(c["equal"] for c in greedy.compared),
        "failed": sum(o.status == "failed" for o in greedy.outcomes),
        "mismatches": [c for c in greedy.compared if not c["equal"]][:3],
    }


def checks(report: dict, max_rss_growth_pct: float) -> dict[str, bool]:
    """What the soak asserts (the CI test asserts the same)."""
    blocks = report["leaks"]["engine_blocks"]
    store = report["leaks"]["store"]
    greedy = report["greedy_sample"]
    return {
        "no_failure_outside_documented_causes": report["requests"]["defects"] == 0,
        "engines_idle": blocks["idle"],
        "no_leaked_kv_blocks": all(e["leaked_blocks"] == 0 for e in blocks["engines"].values()),
        "no_leaked_store_leases": store["leaked_leases"] == 0 and store["leaked_reservations"] == 0,
        "rss_within_bound": all(
            p["rss_growth_pct"] <= max_rss_growth_pct for p in report["resources"]["processes"]
        ),
        "greedy_sample_all_equal": greedy["compared"] > 0 and greedy["equal"] == greedy["compared"],
        "no_orphans": not report["orphans"],
    }


def main() -> int:
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s: %(message)s")
    logger.setLevel(logging.INFO)
    args = build_parser().parse_args()
    report = run_soak(args)
    summary = markdown(report)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(summary)
    sys.stdout.write(summary + f"\nchecks: {json.dumps(report['checks'])}\n")
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
