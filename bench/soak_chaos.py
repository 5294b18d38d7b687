"""The soak's chaos schedule and its watchers.

`Chaos` runs a seeded schedule: after a pause of 30-90 s (scaled for short runs) it takes the
next target of a shuffled cycle over TARGETS and SIGKILLs it, or SIGSTOPs it for 10-40 s
(scaled) and then SIGCONTs it; the key file target is edited and SIGHUPed to the api. The
next pause starts once the deployment serves again (/health 200 with every engine core
serving), so faults do not pile up: each event is one fault of a deployment that was whole.

`Watcher` samples, every few seconds, RSS, open fds and threads of every process of the
deployment (by pid, with its role), and every second how many engine cores /health says
serve: the windows with none are when a 503 is the documented answer.
"""

from __future__ import annotations

import os
import random
import signal
import threading
import time
from dataclasses import asdict, dataclass, field

import psutil

from bench.soak_deploy import Deployment

TARGETS = ("engine", "worker", "kv_store", "coordinator", "api_helper", "key_file")
RECOVERY_TIMEOUT_S = 240.0


@dataclass
class ChaosEvent:
    """One fault. Times are seconds since the soak started.

    Args:
        target: one of TARGETS.
        action: kill | stop (then cont) | hup.
        pid: the process signalled (the api's for hup).
        stop_s: how long a stopped process stayed stopped.
        recovered_s: from the signal until the deployment served again (None: it did not).
    """

    at: float
    target: str
    action: str
    pid: int = 0
    stop_s: float = 0.0
    recovered_s: float | None = None
    note: str = ""


@dataclass
class Chaos:
    """Args: deployment: what to hit; seed: the schedule's; scale: 1 for 30-90 s pauses and
    10-40 s freezes, less for shorter runs; t0: the soak's start (time.monotonic())."""

    deployment: Deployment
    seed: int
    scale: float
    t0: float
    events: list[ChaosEvent] = field(default_factory=list)

    def run(self, stop: threading.Event) -> None:
        """Faults until `stop` is set (the current one still heals)."""
        rng = random.Random(self.seed)
        cycle: list[str] = []
        while not stop.wait(rng.uniform(30, 90) * self.scale):
            if not cycle:
                cycle = rng.sample(TARGETS, len(TARGETS))
            self.events.append(self.hit(cycle.pop(0), rng))
            self.wait_recovered(self.events[-1])

    def hit(self, target: str, rng: random.Random) -> ChaosEvent:
        event = ChaosEvent(round(time.monotonic() - self.t0, 1), target, "hup")
        if target == "key_file":
            self.deployment.edit_key_file()
            event.pid = self.deployment.front.process.pid  # type: ignore[union-attr]
            os.kill(event.pid, signal.SIGHUP)
            return event
        victims = self.deployment.roles()[target]
        if not victims:
            event.action, event.note = "none", f"no {target} process found"
            return event
        victim = rng.choice(victims)
        event.pid, event.action = victim.pid, rng.choice(("kill", "stop"))
        if event.action == "kill":
            victim.send_signal(signal.SIGKILL)
        else:
            event.stop_s = round(rng.uniform(10, 40) * self.scale, 1)
            self.freeze(victim, event.stop_s)
        return event

    def freeze(self, victim: psutil.Process, stop_s: float) -> None:
        """SIGSTOP, then SIGCONT after stop_s (the process may have been killed meanwhile:
        a hung engine core's supervisor does that)."""
        self.deployment.stopped_pids.add(victim.pid)
        victim.send_signal(signal.SIGSTOP)
        time.sleep(stop_s)
        try:
            victim.send_signal(signal.SIGCONT)
        except psutil.NoSuchProcess:
            pass
        self.deployment.stopped_pids.discard(victim.pid)

    def wait_recovered(self, event: ChaosEvent) -> None:
        """Until /health is 200 with every engine core serving (the dp variant's store
        started again by this soak, as its supervisor would)."""
        start = self.t0 + event.at
        deadline = time.monotonic() + RECOVERY_TIMEOUT_S
        while time.monotonic() < deadline:
            time.sleep(0.5)
            self.deployment.restart_store_if_dead()
            if serving(self.deployment.health()):
                event.recovered_s = round(time.monotonic() - start, 1)
                return


def serving(health: dict) -> bool:
    engines = health.get("engines", [])
    return health.get("status") == "healthy" and all(e["state"] == "serving" for e in engines)


def num_serving(health: dict) -> int:
    """Engine cores serving; with P/D, those of the stage that has fewer."""
    stages: dict[bool, int] = {}
    for engine in health.get("engines", []):
        stage = engine.get("kv_role") == "kv_producer"
        stages[stage] = stages.get(stage, 0) + (engine["state"] == "serving")
    return min(stages.values(), default=0)


# ---------------------------------------------------------------------- the watcher


@dataclass
class ProcessSeries:
    """One process's samples: (seconds since the soak started, RSS bytes, fds, threads)."""

    pid: int
    role: str
    started: float
    samples: list[tuple[float, int, int, int]] = field(default_factory=list)


@dataclass
class Watcher:
    """Args: deployment: what to watch; t0: the soak's start; interval_s: between resource
    samples."""

    deployment: Deployment
    t0: float
    interval_s: float = 5.0
    series: dict[int, ProcessSeries] = field(default_factory=dict)
    serving_samples: list[tuple[float, int]] = field(default_factory=list)

    def run(self, stop: threading.Event) -> None:
        next_sample = 0.0
        while not stop.wait(1.0):
            now = time.monotonic() - self.t0
            self.serving_samples.append((round(now, 1), num_serving(self.deployment.health())))
            if now >= next_sample:
                self.sample(now)
                next_sample = now + self.interval_s

    def sample(self, now: float) -> None:
        for role, processes in self.deployment.roles().items():
            for process in processes:
                try:
                    with process.oneshot():
                        figures = (process.memory_info().rss, process.num_fds())
                        threads = process.num_threads()
                        started = process.create_time()
                except (psutil.NoSuchProcess, psutil.ZombieProcess, psutil.AccessDenied):
                    continue
                entry = self.series.setdefault(
                    process.pid,
                    ProcessSeries(process.pid, role, round(started - time.time() + now, 1)),
                )
                if role != "other":  # an engine core's start, readmitted since
                    entry.role = role
                entry.samples.append((round(now, 1), *figures, threads))

    def no_engine_windows(self) -> list[tuple[float, float]]:
        """The spans (start, end; seconds since the soak started) when no engine core
        served, by the one-second health samples."""
        windows: list[tuple[float, float]] = []
        for (t, n), (t_next, _) in zip(self.serving_samples, self.serving_samples[1:]):
            if n == 0:
                if windows and windows[-1][1] >= t - 1.5:
                    windows[-1] = (windows[-1][0], t_next)
                else:
                    windows.append((t - 1.0, t_next))
        return windows


def events_json(events: list[ChaosEvent]) -> list[dict]:
    return [asdict(event) for event in events]
