"""Faults survived: every process kind SIGKILLed under load, again and again.

    PYTHONPATH=. .venv/bin/python bench/faults.py [--kinds engine,worker,coordinator,kv_store,
        headless,api] [--repeats 10] [--concurrency 6] [--data-parallel-size 2]
        [--output-json faults.json]

Each kind runs the deployment a user would run (`kvserve serve ...` processes, in sessions of
their own), keeps --concurrency streaming completions going, and --repeats times SIGKILLs the
victim, then waits until the deployment serves again (a killed headless node is started
again by this script, as its own supervisor would). Each kill comes --settle-s (11 s) after
the last recovery: longer than the supervisor's crash-loop window (10 s), so each is a fault
of a process that was serving, which restarts at once, not a crash loop, which backs off:

| kind        | deployment                                         | victim                    |
|-------------|----------------------------------------------------|---------------------------|
| engine      | default model, --restart-dead-engines              | the engine core (the last) |
| worker      | a tiny TP=2 model, --restart-dead-engines          | worker rank 1 (of the last) |
| coordinator | default model, DP=2                                | the DP coordinator        |
| kv_store    | default model, --prefill-size 1 --decode-size 1    | the KV store              |
| headless    | default model, DP=2: a front end and a headless node | the headless node's session |
| api         | default model, TP=1, started fresh for each kill   | the api (the launcher)    |

--data-parallel-size N runs the engine and worker kinds with N engine cores (the victim is the
last one). A request in flight on a killed engine core moves to a live one (with one engine
core: to its restart) and its stream goes on (services/api/engine_client/migration.py); its "added
latency" is its duration less the median duration of the requests no kill overlapped.

Per kill it records what the clients saw: the requests in flight at the kill that ended with
an error, and the longest time from the kill to such an error (the bound is 5 s); /health
while it recovers (503 seconds); the seconds until it serves again (for the api: until every
process it left behind is gone, since restarting the api is its supervisor's job). Per kind:
"nothing lost" (every request ended in a finish_reason or in an error the client received:
none hung, none ended silently) and no orphans once the deployment stopped.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Collection
from dataclasses import dataclass, field

if __package__ in (None, ""):  # run as a script: the repository root on sys.path
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import httpx  # noqa: E402
import psutil  # noqa: E402

from tests.support.models import save_tiny_parallel_llama  # noqa: E402
from tests.support.ports import free_port  # noqa: E402
from tests.support.server import DP_MODEL_NAME, ServeProcess  # noqa: E402
from tests.support.waiting import wait_until  # noqa: E402

KINDS = ("engine", "worker", "coordinator", "kv_store", "headless", "api")
ERROR_BOUND_S = 5.0
REQUEST_TIMEOUT_S = 120.0
KV_CACHE = "256MiB"


# ---------------------------------------------------------------------- the load


@dataclass
class Outcome:
    start: float
    end: float
    kind: str  # completed | error (received: a status or an error event) | broken | lost
    request_id: str = ""  # the stream's id (its first chunk's), to find it in the log


@dataclass
class Load:
    """--concurrency client threads, each streaming completions back to back."""

    url: str
    concurrency: int
    max_tokens: int
    prompt: object  # a string, or token ids (the tiny TP model)
    outcomes: list[Outcome] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)

    def start(self) -> None:
        self.threads = [
            threading.Thread(target=self._client, args=(i,), daemon=True)
            for i in range(self.concurrency)
        ]
        for thread in self.threads:
            thread.start()

    def finish(self) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(REQUEST_TIMEOUT_S + 10)

    def _client(self, index: int) -> None:
        n = 0
        while not self.stop.is_set():
            n += 1
            prompt = (
                self.prompt if not isinstance(self.prompt, str) else f"{index}.{n} {self.prompt}"
            )
            self.outcomes.append(self._one(prompt))
            if self.outcomes[-1].kind != "completed":
                time.sleep(0.2)  # a server that refuses is not hammered

    def _one(self, prompt) -> Outcome:
        start = time.monotonic()
        body = {
            "model": DP_MODEL_NAME,
            "prompt": prompt,
            "max_tokens": self.max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
        }
        kind = "lost"
        request_id = ""
        try:
            with httpx.stream(
                "POST", self.url + "/v1/completions", json=body, timeout=REQUEST_TIMEOUT_S
            ) as response:
                if response.status_code != 200:
                    response.read()
                    kind = "error"
                else:
                    for line in response.iter_lines():
                        if not request_id and (found := re.search(r'"id":"([^"]+)"', line)):
                            request_id = found[1]
                        if '"finish_reason":"length"' in line:
                            kind = "completed"
                        elif line.startswith("data: ") and '"error"' in line:
                            kind = "error"
        except httpx.TimeoutException:
            kind = "lost"  # hung: nothing came for REQUEST_TIMEOUT_S
        except httpx.HTTPError:
            kind = "broken"  # the connection itself failed: the client knows
        return Outcome(start, time.monotonic(), kind, request_id)


# ---------------------------------------------------------------------- deployments


class Deployment:
    """A kind's processes, its victim and how it recovers."""

    kind = ""

    def __init__(self, args: argparse.Namespace, tmp: str):
        self.args, self.tmp = args, tmp
        self.servers: list[ServeProcess] = []

    def serve(self, *flags: str, port: int | None, name: str) -> ServeProcess:
        server = ServeProcess(list(flags), os.path.join(self.tmp, f"{name}.log"), port)
        self.servers.append(server)
        return server

    def front_end(self, *flags: str) -> ServeProcess:
        port = free_port()
        self.port = port
        return self.serve(
            *self.model_flags(),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--kv-cache-memory",
            KV_CACHE,
            "--served-model-name",
            DP_MODEL_NAME,
            "--uvicorn-log-level",
            "warning",
            *flags,
            port=port,
            name=f"{self.kind}-{port}",
        )

    def model_flags(self) -> list[str]:
        return [self.args.model] if self.args.model else []

    def prompt(self) -> object:
        return "Write about the sea, the wind and the boats that cross it."

    def start(self) -> ServeProcess:
        raise NotImplementedError

    def kill(self) -> None:
        raise NotImplementedError

    def recovered(self) -> bool:
        return self.front.health()[0] == 200

    def stop(self) -> list[str]:
        """Stop every process; the orphans found (ServeProcess.stop checks the descendants)."""
        orphans = []
        for server in reversed(self.servers):
            try:
                server.stop()
            except AssertionError as exc:
                orphans.append(str(exc))
        return orphans


class EngineKind(Deployment):
    kind = "engine"

    def start(self):
        size = str(self.args.data_parallel_size)
        self.front = self.front_end("--restart-dead-engines", "--data-parallel-size", size)
        return self.front

    def engine_pid(self) -> int:
        return self.front.health()[1]["engines"][-1]["pid"]

    def kill(self):
        self.victim = self.engine_pid()
        os.kill(self.victim, signal.SIGKILL)

    def recovered(self):
        status, body = self.front.health()
        return (
            status == 200
            and body["status"] == "healthy"
            and body["engines"][-1]["pid"] != self.victim
        )


class WorkerKind(EngineKind):
    kind = "worker"

    def model_flags(self):
        model = save_tiny_parallel_llama(os.path.join(self.tmp, "tiny-tp"))
        from kvserve.services.worker.model_loader import resolve_model

        return [model, "--tokenizer", resolve_model(None), "--tensor-parallel-size", "2"]

    def prompt(self):
        return [1, 2, 3, 4, 5, 6, 7, 8]  # the TP model's vocabulary is 128 ids

    def kill(self):
        self.victim = self.engine_pid()
        workers = psutil.Process(self.victim).children()
        workers[-1].kill()


class CoordinatorKind(Deployment):
    kind = "coordinator"

    def start(self):
        self.front = self.front_end("--data-parallel-size", "2")
        return self.front

    def kill(self):
        pids = re.findall(
            r"(?:started DP coordinator process|restarted DP coordinator) \(pid (\d+)",
            self.front.log(),
        )
        self.num_before = len(pids)
        os.kill(int(pids[-1]), signal.SIGKILL)

    def recovered(self):
        log = self.front.log()
        n = len(
            re.findall(r"(?:started DP coordinator process|restarted DP coordinator) \(pid", log)
        )
        return n > self.num_before and self.front.health()[0] == 200


class KvStoreKind(Deployment):
    kind = "kv_store"

    def start(self):
        self.front = self.front_end(
            "--prefill-size", "1", "--decode-size", "1", "--kv-store-size", "256M"
        )
        return self.front

    def kill(self):
        pids = re.findall(r"started KV store process KvStore \(pid (\d+)\)", self.front.log())
        self.num_before = len(pids)
        os.kill(int(pids[-1]), signal.SIGKILL)

    def recovered(self):
        n = len(re.findall(r"started KV store process KvStore \(pid", self.front.log()))
        return n > self.num_before and self.front.health()[0] == 200


class HeadlessKind(Deployment):
    kind = "headless"

    def start(self):
        # Across nodes the sockets are tcp://, which need keys (CURVE): one pair for both.
        keys = os.path.join(self.tmp, "keys")
        if not os.path.exists(keys):
            subprocess.run(
                [sys.executable, "-m", "kvserve.cli", "keys", "generate", keys],
                check=True,
                capture_output=True,
            )
        os.environ["KVSERVE_TRANSPORT_KEYS"] = keys
        self.rpc_port = free_port()
        self.dp_flags = [
            "--data-parallel-size",
            "2",
            "--data-parallel-size-local",
            "1",
            "--data-parallel-address",
            "127.0.0.1",
            "--data-parallel-rpc-port",
            str(self.rpc_port),
        ]
        self.node = self.start_node()
        self.front = self.front_end(*self.dp_flags)
        return self.front

    def start_node(self) -> ServeProcess:
        return self.serve(
            *self.model_flags(),
            "--headless",
            "--kv-cache-memory",
            KV_CACHE,
            *self.dp_flags,
            "--data-parallel-start-rank",
            "1",
            port=None,
            name=f"node-{len(self.servers)}",
        )

    def kill(self):
        os.killpg(self.node.process.pid, signal.SIGKILL)
        self.node.process.wait()
        # Its supervisor (systemd, compose) starts it again once the front end noticed.
        wait_until(lambda: self.front.health()[1]["status"] != "healthy", timeout_s=10)
        self.node = self.start_node()

    def recovered(self):
        status, body = self.front.health()
        return status == 200 and body["status"] == "healthy"


class ApiKind(Deployment):
    kind = "api"

    def start(self):
        self.front = self.front_end()
        return self.front

    def kill(self):
        self.left = psutil.Process(self.front.process.pid).children(recursive=True)
        os.kill(self.front.process.pid, signal.SIGKILL)

    def recovered(self):
        return not [p for p in self.left if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]


DEPLOYMENTS = {
    cls.kind: cls
    for cls in (EngineKind, WorkerKind, CoordinatorKind, KvStoreKind, HeadlessKind, ApiKind)
}


# ---------------------------------------------------------------------- one kind


def _health_status(deployment: Deployment) -> int | None:
    try:
        return deployment.front.health()[0]
    except (httpx.HTTPError, ValueError):
        return None


def run_kind(kind: str, args: argparse.Namespace) -> dict:
    tmp = tempfile.mkdtemp(prefix=f"kvserve-faults-{kind}-")
    kills: list[dict] = []
    orphans: list[str] = []
    loads: list[Load] = []
    logs: list[str] = []
    fresh_each_time = kind == "api"
    deployment = None
    try:
        for repeat in range(args.repeats):
            if deployment is None or fresh_each_time:
                deployment = DEPLOYMENTS[kind](args, tmp)
                deployment.start().wait_healthy()
                load = Load(
                    deployment.front.url, args.concurrency, args.max_tokens, deployment.prompt()
                )
                load.start()
                loads.append(load)
            time.sleep(args.settle_s)  # a steady load first
            kill_time = time.monotonic()
            deployment.kill()
            statuses = []
            deadline = kill_time + args.recovery_timeout_s
            while time.monotonic() < deadline:
                statuses.append((time.monotonic(), _health_status(deployment)))
                if deployment.recovered():
                    break
                time.sleep(0.2)
            recovered_time = time.monotonic()
            unhealthy = [t for t, status in statuses if status not in (200, None)]
            kills.append(
                {
                    "repeat": repeat,
                    "kill_time": kill_time,
                    "recovered_time": recovered_time,
                    "unhealthy_s": round(recovered_time - unhealthy[0], 1) if unhealthy else 0.0,
                    "recovery_s": round(recovered_time - kill_time, 1),
                    "recovered": deployment.recovered(),
                }
            )
            print(f"{kind} kill {repeat + 1}/{args.repeats}: {kills[-1]}", flush=True)
            if fresh_each_time:
                load.finish()
                logs.append(deployment.front.log())
                orphans += deployment.stop()
        time.sleep(args.settle_s)
    finally:
        for load in loads:
            load.finish()
        if deployment is not None:
            logs.append(deployment.front.log())
            orphans += deployment.stop()
    moved = set(re.findall(r"request (\S+) moved to engine core", "\n".join(logs)))
    outcomes = [o for load in loads for o in load.outcomes]
    return summarize(kind, kills, outcomes, orphans, moved)


def summarize(
    kind: str,
    kills: list[dict],
    outcomes: list[Outcome],
    orphans: list[str],
    moved: Collection[str] = (),
) -> dict:
    """Once every request ended: which ones each kill hit, the streams that moved to a live
    engine core (their request ids in `moved`) and what that added, and the totals."""
    for k in kills:
        in_flight = [o for o in outcomes if o.start < k["kill_time"] <= o.end]
        hit = [o for o in in_flight if o.kind != "completed"]
        k["in_flight"], k["hit"] = len(in_flight), len(hit)
        k["error_after_s"] = round(max((o.end - k["kill_time"] for o in hit), default=0.0), 2)
    hit_ids = {
        id(o)
        for o in outcomes
        if o.kind != "completed" and any(o.start < k["kill_time"] <= o.end for k in kills)
    }
    refused = [
        o
        for o in outcomes
        if o.kind in ("error", "broken")
        and id(o) not in hit_ids
        and any(k["kill_time"] < o.start <= k["recovered_time"] for k in kills)
    ]
    counts = {
        k: sum(o.kind == k for o in outcomes) for k in ("completed", "error", "broken", "lost")
    }
    counts["hit_by_a_kill"] = len(hit_ids)
    counts["refused_while_recovering"] = len(refused)
    counts["other_errors"] = (
        counts["error"] + counts["broken"] - len(refused) - counts["hit_by_a_kill"]
    )
    undisturbed = [
        o.end - o.start
        for o in outcomes
        if o.kind == "completed" and not any(o.start < k["kill_time"] <= o.end for k in kills)
    ]
    migrated = [o for o in outcomes if o.request_id in moved]
    counts["migrated"] = len(migrated)
    counts["migrated_completed"] = sum(o.kind == "completed" for o in migrated)
    median_added_s = None
    if migrated and undisturbed:
        baseline = statistics.median(undisturbed)
        median_added_s = round(statistics.median(o.end - o.start - baseline for o in migrated), 2)
    max_error_after_s = max((k["error_after_s"] for k in kills if k["hit"]), default=0.0)
    all_recovered = all(k["recovered"] for k in kills)
    return {
        "kind": kind,
        "kills": kills,
        "requests": counts,
        "max_error_after_s": max_error_after_s,
        "median_migration_added_s": median_added_s,
        "median_unhealthy_s": statistics.median(k["unhealthy_s"] for k in kills),
        "median_recovery_s": statistics.median(k["recovery_s"] for k in kills),
        "all_recovered": all_recovered,
        "orphans": orphans,
        "ok": counts["lost"] == 0
        and not orphans
        and all_recovered
        and max_error_after_s <= ERROR_BOUND_S,
    }


TABLE_HEADER = (
    "| kind | kills | requests under load | moved to a live engine core (median added "
    "latency) | longest kill -> client error | median /health non-200 | median kill -> "
    "serving again | orphans | as defined |\n"
    "|---|---|---|---|---|---|---|---|---|"
)


def table_row(result: dict) -> str:
    counts = result["requests"]
    added_s = result["median_migration_added_s"]
    added = "-" if added_s is None else f"+{added_s:.1f} s"
    return (
        f"| {result['kind']} | {len(result['kills'])} | {counts['completed']} completed; "
        f"{counts['hit_by_a_kill']} in flight at a kill ended in an error the client got; "
        f"{counts['refused_while_recovering']} refused (503 or connection refused) while it "
        f"recovered; {counts['other_errors']} other errors; {counts['lost']} lost | "
        f"{counts['migrated']} ({counts['migrated_completed']} completed; {added}) | "
        f"{result['max_error_after_s']:.1f} s | {result['median_unhealthy_s']:.1f} s | "
        f"{result['median_recovery_s']:.1f} s | {len(result['orphans'])} | "
        f"{'yes' if result['ok'] else 'NO'} |"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--kinds", default=",".join(KINDS))
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--concurrency", type=int, default=6)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--model", default=None, help="default: the embedded default model")
    parser.add_argument(
        "--data-parallel-size",
        type=int,
        default=1,
        help="engine cores of the engine and worker kinds",
    )
    # Longer than the supervisor's RESTART_WINDOW_S (10 s): each kill is then a fault of a
    # process that was serving, not a crash loop (which backs off, 1 s doubling to 30 s).
    parser.add_argument("--settle-s", type=float, default=11.0)
    parser.add_argument("--recovery-timeout-s", type=float, default=180.0)
    parser.add_argument("--output-json", default=None)
    args = parser.parse_args()
    kinds = args.kinds.split(",")
    for kind in kinds:
        if kind not in KINDS:
            parser.error(f"unknown kind {kind!r}: one of {', '.join(KINDS)}")
    results = [run_kind(kind, args) for kind in kinds]
    print()
    print(TABLE_HEADER)
    for result in results:
        print(table_row(result))
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(results, f, indent=1)
    return 0 if all(r["ok"] for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
