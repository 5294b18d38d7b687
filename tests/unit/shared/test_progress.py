"""ProcessProgress and SilenceWatch on real child processes: a sleeping one (blocked), a
SIGSTOPped one, a busy one, one that shares a CPU with another busy one, and one held to a
sliver of a CPU by a cgroup quota (when this machine lets a test make one)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator

import psutil
import pytest

from kvserve.shared.progress import ProcessProgress, SilenceWatch, _sign_of_life, _throttled_along
from tests.support.cgroups import cpu_quota, quota_unavailable

BUSY = [sys.executable, "-c", "while True: pass"]
SLEEPING = ["sleep", "600"]
LOOK_INTERVAL_S = 0.1
HUNG_TIMEOUT_S = 1.0


@contextlib.contextmanager
def child(args: list[str], cpu: int | None = None) -> Iterator[subprocess.Popen]:
    """A child process, killed on exit; pinned to one CPU when `cpu` is given."""
    process = subprocess.Popen(args)
    try:
        if cpu is not None:
            os.sched_setaffinity(process.pid, {cpu})
        time.sleep(0.2)  # started and settled (the interpreter loaded)
        yield process
    finally:
        process.kill()
        process.wait()


def _watch(pid: int, seconds: float) -> tuple[SilenceWatch, float]:
    """A SilenceWatch of pid, looked through every LOOK_INTERVAL_S for `seconds` of silence;
    (the watch, the time of its last look)."""
    start = time.monotonic()
    watch = SilenceWatch([ProcessProgress(pid)], now=start)
    now = start
    while now - start < seconds:
        time.sleep(LOOK_INTERVAL_S)
        now = time.monotonic()
        watch.look(now)
    return watch, now


def test_a_busy_process_gains_cpu_time_and_a_sleeping_one_none():
    with child(BUSY) as busy, child(SLEEPING) as sleeping:
        busy_progress, sleeping_progress = ProcessProgress(busy.pid), ProcessProgress(sleeping.pid)
        assert busy_progress.has_wait and sleeping_progress.has_wait  # /proc schedstat here
        before = busy_progress.sample(), sleeping_progress.sample()
        time.sleep(0.5)
        after = busy_progress.sample(), sleeping_progress.sample()
    # A runnable process is on a CPU or waiting for one all the time, however loaded the
    # host; a blocked one (nanosleep) is neither.
    cpu_ns, wait_ns = after[0].cpu_ns - before[0].cpu_ns, after[0].wait_ns - before[0].wait_ns
    assert cpu_ns > 0 and cpu_ns + wait_ns > 400_000_000, (before, after)
    assert after[1] == before[1]


def test_a_process_that_shares_its_cpu_waits_on_the_run_queue():
    cpu = sorted(os.sched_getaffinity(0))[0]
    with child(BUSY, cpu) as hog, child(BUSY, cpu) as victim:
        del hog  # only there to compete
        progress = ProcessProgress(victim.pid)
        before = progress.sample()
        time.sleep(0.5)
        after = progress.sample()
    # Two busy loops on one CPU: each runs at most about half the time and waits the rest.
    cpu_ns, wait_ns = after.cpu_ns - before.cpu_ns, after.wait_ns - before.wait_ns
    assert cpu_ns > 0 and wait_ns > 150_000_000 and cpu_ns + wait_ns > 400_000_000, (
        before,
        after,
    )


def test_a_gone_process_raises_no_such_process():
    with child(SLEEPING) as sleeping:
        progress = ProcessProgress(sleeping.pid)
    with pytest.raises(psutil.NoSuchProcess):
        progress.sample()


def test_without_schedstat_cpu_times_stand_in():
    with child(BUSY) as busy:
        progress = ProcessProgress(busy.pid)
        progress.has_wait = False  # as where /proc schedstat cannot be read
        before = progress.sample()
        time.sleep(0.5)
        after = progress.sample()
    assert after.cpu_ns > before.cpu_ns and after.wait_ns == before.wait_ns == 0


def test_a_stopped_process_is_hung_once_the_budget_passed_without_progress():
    with child(BUSY) as busy:
        busy.send_signal(signal.SIGSTOP)
        watch, now = _watch(busy.pid, HUNG_TIMEOUT_S / 2)
        assert not watch.is_hung(now, HUNG_TIMEOUT_S)  # not yet the whole budget
        assert watch.finding.startswith("it used no CPU time and waited for none")
        watch, now = _watch(busy.pid, HUNG_TIMEOUT_S * 1.5)
        assert watch.is_hung(now, HUNG_TIMEOUT_S), watch.finding
        assert watch.quiet_s(now) > HUNG_TIMEOUT_S

        # It speaks: the silence is over, and so is the verdict.
        watch.heard(time.monotonic())
        assert not watch.is_hung(time.monotonic(), HUNG_TIMEOUT_S) and watch.finding == ""


def test_a_blocked_process_is_hung_too():
    with child(SLEEPING) as sleeping:
        watch, now = _watch(sleeping.pid, HUNG_TIMEOUT_S * 1.5)
    assert watch.is_hung(now, HUNG_TIMEOUT_S), watch.finding


def test_a_busy_process_is_never_hung_however_long_it_is_silent():
    with child(BUSY) as busy:
        watch, now = _watch(busy.pid, HUNG_TIMEOUT_S * 2)
    assert watch.silent_s(now) > HUNG_TIMEOUT_S * 2
    assert not watch.is_hung(now, HUNG_TIMEOUT_S)
    assert watch.finding.startswith("it runs, slowly"), watch.finding


def test_a_process_that_resumes_is_no_longer_hung():
    with child(BUSY) as busy:
        busy.send_signal(signal.SIGSTOP)
        watch = SilenceWatch([ProcessProgress(busy.pid)], now=time.monotonic())
        deadline = time.monotonic() + HUNG_TIMEOUT_S * 1.5
        while time.monotonic() < deadline:
            time.sleep(LOOK_INTERVAL_S)
            watch.look(time.monotonic())
        assert watch.is_hung(time.monotonic(), HUNG_TIMEOUT_S)
        busy.send_signal(signal.SIGCONT)
        time.sleep(LOOK_INTERVAL_S)
        watch.look(time.monotonic())
        assert not watch.is_hung(time.monotonic(), HUNG_TIMEOUT_S)
        assert watch.finding.startswith("it runs, slowly"), watch.finding


def test_a_remote_peer_is_hung_after_the_budget_of_silence_alone():
    start = time.monotonic()
    watch = SilenceWatch([], now=start)
    watch.look(start + HUNG_TIMEOUT_S / 2)
    assert not watch.is_hung(start + HUNG_TIMEOUT_S / 2, HUNG_TIMEOUT_S)
    assert "only its silence is known" in watch.finding
    assert watch.is_hung(start + HUNG_TIMEOUT_S * 1.1, HUNG_TIMEOUT_S)
    watch.heard(start + HUNG_TIMEOUT_S)  # a heartbeat is not silence
    assert not watch.is_hung(start + HUNG_TIMEOUT_S * 1.1, HUNG_TIMEOUT_S)


@pytest.mark.skipif(quota_unavailable() is not None, reason=str(quota_unavailable()))
def test_a_process_throttled_by_a_cgroup_quota_is_starved_not_hung():
    # 1 ms of CPU a second: most looks see it wait for a CPU and get none.
    with child(BUSY) as busy, cpu_quota([busy.pid], fraction=0.001, period_us=1_000_000):
        watch = SilenceWatch([ProcessProgress(busy.pid)], now=time.monotonic())
        findings = []
        deadline = time.monotonic() + HUNG_TIMEOUT_S * 2
        while time.monotonic() < deadline:
            time.sleep(LOOK_INTERVAL_S)
            watch.look(time.monotonic())
            findings.append(watch.finding)
            assert not watch.is_hung(time.monotonic(), HUNG_TIMEOUT_S), findings
    assert any(finding.startswith("it is starved of CPU") for finding in findings), findings


def test_throttled_time_is_read_from_the_group_and_its_ancestors(tmp_path):
    # v2 counts microseconds (throttled_usec), v1 nanoseconds (throttled_time); a limit set
    # on a parent (a pod) holds back the children under it, so every level counts.
    (tmp_path / "pod" / "container").mkdir(parents=True)
    (tmp_path / "cpu.stat").write_text("usage_usec 99\n")  # the root has no quota
    (tmp_path / "pod" / "cpu.stat").write_text("nr_throttled 3\nthrottled_usec 250\n")
    (tmp_path / "pod" / "container" / "cpu.stat").write_text("throttled_usec 1000\n")
    assert _throttled_along(str(tmp_path), "/pod/container") == 1_250_000
    assert _throttled_along(str(tmp_path), "/pod") == 250_000
    assert _throttled_along(str(tmp_path), "/elsewhere") == 0  # no cpu.stat there: only root
    (tmp_path / "v1").mkdir()
    (tmp_path / "v1" / "cpu.stat").write_text("nr_periods 9\nthrottled_time 4200\n")
    assert _throttled_along(str(tmp_path), "/v1") == 4200


def test_a_sliver_of_cpu_with_a_thread_waiting_is_starved_not_slow():
    # One look's growth (cpu ms, wait ms, throttled ms, runnable threads, interval s).
    # What CI saw of an engine core under a 1 ms-a-second quota: 2 ms in 0.5 s, threads in R.
    assert _sign_of_life(2, 0, 0, 2, 0.5).startswith("it is starved of CPU (2 runnable")
    # The same sliver with no thread wanting a CPU: it ran what it had to (slow, not starved).
    assert _sign_of_life(2, 0, 0, 0, 0.5).startswith("it runs, slowly (2 ms")
    # A fair share of a contended CPU is slow, and so is 2% of one (a busy process's tenth
    # of a second on a loaded machine).
    assert _sign_of_life(2, 0, 0, 1, 0.1).startswith("it runs, slowly (2 ms")
    assert _sign_of_life(200, 300, 0, 1, 0.5).startswith("it runs, slowly (200 ms")
    # A quota's throttling is named as such, whatever else grew.
    assert "CPU quota held it back for 900 ms" in _sign_of_life(3, 0, 900, 1, 1.0)
    # No CPU time, but waiting for one; then nothing at all.
    assert _sign_of_life(0, 0, 0, 1, 0.5).startswith("it is starved of CPU (1 runnable")
    assert _sign_of_life(0, 5, 0, 0, 0.5).startswith("it is starved of CPU (0 runnable")
    assert _sign_of_life(0, 0, 0, 0, 0.5) is None
