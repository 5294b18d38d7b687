"""Executor.collective_rpc: a named Worker method runs on the ranks asked, through the uni and
mp executors alike, and a rank that fails, dies or hangs during a call raises the same
RuntimeError a step would, while one frozen for less than the hung budget only delays the
call (those tests start worker processes of their own: slow).

The workers here are a Worker subclass with no model (`FactWorker`): a new start-up fact is
one method on the worker and one collective_rpc where it is wanted, nothing in between.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
import time
from collections.abc import Iterator

import msgspec
import pytest
import torch
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvserve.services.scheduler.executors.executor import UniExecutor
from kvserve.services.scheduler.executors.mp_executor import MpExecutor
from kvserve.services.worker import worker_proc
from kvserve.services.worker.worker import Worker
from kvserve.shared.config import CacheConfig, EngineConfig, ParallelConfig
from kvserve.shared.env import WORKER_HEARTBEAT_TIMEOUT_S, WORKER_HUNG_TIMEOUT_S
from kvserve.shared.messages import WorkerCallResult
from tests.support.processes import wait_gone
from tests.support.waiting import wait_until


class Point(msgspec.Struct, frozen=True):
    x: int
    y: int


UNIT = Point(1, 2)


class Fact(msgspec.Struct, frozen=True):
    """A made-up start-up fact."""

    rank: int
    pid: int
    scaled: list[int]


class FactWorker(Worker):
    """A Worker without a model: the executors' transport is under test, not the model."""

    max_model_len = 64

    def __init__(self, config, model_dir, rank=0, distributed_init_method=None):
        self.config = config
        self.rank = rank
        self.world_size = config.parallel.world_size
        self.device = torch.device("cpu")
        self.num_blocks = 0

    def determine_num_blocks(self) -> int:
        return 16 + self.rank

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks

    def shutdown(self) -> None:
        pass

    # ------------------------------------------------------------ the made-up methods

    def made_up_fact(self, scale: int, point: Point = UNIT) -> Fact:
        assert isinstance(point, Point), "arguments arrive as their annotated types"
        return Fact(self.rank, os.getpid(), [scale * point.x, scale * point.y])

    def allocated_blocks(self) -> int:
        return self.num_blocks

    def fail(self) -> None:
        raise ValueError(f"made-up failure on rank {self.rank}")

    def sleep(self, seconds: float) -> None:
        time.sleep(seconds)


def _config(pipeline_parallel_size: int = 1, executor: str = "uni") -> EngineConfig:
    return EngineConfig(
        cache=CacheConfig(num_gpu_blocks_override=16),
        parallel=ParallelConfig(
            pipeline_parallel_size=pipeline_parallel_size, distributed_executor_backend=executor
        ),
    )


def _mp_executor(model_dir: str) -> MpExecutor:
    """Two pipeline stages, so the driver (rank 1) is not rank 0."""
    return MpExecutor(_config(2, "mp"), model_dir, start_timeout_s=60, worker_cls=FactWorker)


def _assert_released(executor: MpExecutor) -> None:
    assert not wait_gone(executor.worker_pids, timeout_s=10), "worker processes outlived shutdown"


# ---------------------------------------------------------------------------------- uni


def test_uni_runs_a_made_up_method_with_typed_arguments_and_answer():
    executor = UniExecutor(_config(), "unused", worker_cls=FactWorker)
    (fact,) = executor.collective_rpc(
        "made_up_fact", (3,), {"point": Point(4, 5)}, result_type=Fact
    )
    assert fact == Fact(0, os.getpid(), [12, 15])
    # Without a result type the answer is what msgpack makes of it, as across processes.
    assert executor.collective_rpc("made_up_fact", (1,), ranks="driver") == [
        {"rank": 0, "pid": os.getpid(), "scaled": [1, 2]}
    ]
    assert executor.collective_rpc("made_up_fact", (2,), ranks=[0], result_type=Fact)[0].scaled == [
        2,
        4,
    ]
    executor.initialize_kv_cache(9)
    assert executor.collective_rpc("allocated_blocks") == [9]


def test_uni_refuses_ranks_it_lacks_and_methods_the_worker_lacks():
    executor = UniExecutor(_config(), "unused", worker_cls=FactWorker)
    with pytest.raises(ValueError, match="ranks"):
        executor.collective_rpc("made_up_fact", (1,), ranks=[1])
    with pytest.raises(AttributeError, match="no public method 'no_such_method'"):
        executor.collective_rpc("no_such_method")
    with pytest.raises(AttributeError, match="no public method '_config'"):
        executor.collective_rpc("_config")


# ----------------------------------------------------------------------------------- mp


@pytest.fixture(scope="module")
def mp_executor(tiny_llama_dir):
    executor = _mp_executor(tiny_llama_dir)
    yield executor
    executor.shutdown()
    _assert_released(executor)


def test_mp_runs_a_made_up_method_on_the_ranks_asked(mp_executor):
    pids = mp_executor.worker_pids
    everyone = mp_executor.collective_rpc(
        "made_up_fact", (3,), {"point": Point(4, 5)}, result_type=Fact
    )
    assert everyone == [Fact(0, pids[0], [12, 15]), Fact(1, pids[1], [12, 15])]
    assert mp_executor.driver_rank == 1
    (driver,) = mp_executor.collective_rpc("made_up_fact", (1,), ranks="driver", result_type=Fact)
    assert driver.rank == 1
    answers = mp_executor.collective_rpc("made_up_fact", (1,), ranks=[1, 0], result_type=Fact)
    assert [fact.rank for fact in answers] == [1, 0]  # in the order asked


def test_mp_start_up_reports_and_kv_cache_go_through_the_ranks(mp_executor):
    assert mp_executor.max_model_len == 64
    assert mp_executor.determine_num_blocks() == 16  # the smallest rank's
    mp_executor.initialize_kv_cache(12)
    assert mp_executor.collective_rpc("allocated_blocks") == [12, 12]


def test_mp_refuses_bad_ranks_before_sending(mp_executor):
    with pytest.raises(ValueError, match="ranks"):
        mp_executor.collective_rpc("made_up_fact", (1,), ranks=[0, 0])
    with pytest.raises(ValueError, match="ranks"):
        mp_executor.collective_rpc("made_up_fact", (1,), ranks=[2])
    # Nothing was sent: the ranks answer the next call in step.
    assert (
        mp_executor.collective_rpc("made_up_fact", (1,), ranks=[0], result_type=Fact)[0].rank == 0
    )


@pytest.mark.slow  # a fresh pair of worker processes each
def test_mp_method_that_raises_fails_its_rank_with_the_traceback(tiny_llama_dir):
    executor = _mp_executor(tiny_llama_dir)
    try:
        with pytest.raises(
            RuntimeError, match=r"(?s)worker rank 1 failed:.*made-up failure on rank 1"
        ):
            executor.collective_rpc("fail", ranks=[1])
        with pytest.raises(RuntimeError, match="worker rank 1 failed"):  # dead stays dead
            executor.collective_rpc("allocated_blocks")
    finally:
        executor.shutdown()
    _assert_released(executor)


@pytest.mark.slow  # a fresh pair of worker processes each
def test_mp_rank_killed_during_a_call_fails_it_fast(tiny_llama_dir):
    executor = _mp_executor(tiny_llama_dir)
    try:
        # Rank 0 dies while rank 1 runs the call: the call names rank 0 all the same.
        killer = threading.Timer(0.5, os.kill, (executor.worker_pids[0], signal.SIGKILL))
        killer.start()
        start = time.monotonic()
        with pytest.raises(
            RuntimeError, match=r"worker rank 0 \(pid \d+\) died: killed by SIGKILL"
        ):
            executor.collective_rpc("sleep", (10.0,), ranks=[1])
        assert time.monotonic() - start < 5.0
        killer.join()
    finally:
        executor.shutdown()
    _assert_released(executor)


@pytest.mark.slow  # a fresh pair of worker processes each
def test_mp_rank_frozen_during_a_call_is_suspect_then_hung(tiny_llama_dir, monkeypatch, caplog):
    monkeypatch.setenv(WORKER_HEARTBEAT_TIMEOUT_S.name, "2")
    monkeypatch.setenv(WORKER_HUNG_TIMEOUT_S.name, "5")
    executor = _mp_executor(tiny_llama_dir)
    try:
        os.kill(executor.worker_pids[1], signal.SIGSTOP)
        start = time.monotonic()
        with pytest.raises(
            RuntimeError,
            match=r"worker rank 1 \(pid \d+\) has not beaten for \d+ s and used no CPU time "
            r"and waited for none for \d+ s \(limit 5 s, KVSERVE_WORKER_HUNG_TIMEOUT_S\): it "
            r"is hung",
        ):
            executor.collective_rpc("allocated_blocks", timeout_s=60)
        # The hung budget counts from the first look at its CPU use, which comes once a beat
        # (every second) is missing.
        assert 5.0 <= time.monotonic() - start < 12.0
        assert "worker rank 1 (pid" in caplog.text and "suspect" in caplog.text, caplog.text
    finally:
        executor.shutdown()
    _assert_released(executor)


@pytest.mark.slow  # a fresh pair of worker processes each
def test_mp_rank_frozen_for_less_than_the_hung_budget_only_delays_a_call(
    tiny_llama_dir, monkeypatch, caplog
):
    monkeypatch.setenv(WORKER_HEARTBEAT_TIMEOUT_S.name, "2")
    monkeypatch.setenv(WORKER_HUNG_TIMEOUT_S.name, "30")
    executor = _mp_executor(tiny_llama_dir)
    try:
        executor.initialize_kv_cache(12)
        frozen = executor.worker_pids[1]
        os.kill(frozen, signal.SIGSTOP)
        thaw = threading.Timer(5.0, os.kill, (frozen, signal.SIGCONT))
        thaw.start()
        start = time.monotonic()
        assert executor.collective_rpc("allocated_blocks", timeout_s=60) == [12, 12]
        assert time.monotonic() - start >= 4.5  # it waited for the frozen rank
        thaw.join()
        assert f"worker rank 1 (pid {frozen}) has not beaten for" in caplog.text, caplog.text
        # It beats again: healthy (check_health would raise for a dead executor).
        assert wait_until(
            lambda: executor.check_health() or "worker rank 1 beats again: healthy" in caplog.text,
            timeout_s=5,
        ), caplog.text
        assert executor.collective_rpc("allocated_blocks") == [12, 12]
    finally:
        executor.shutdown()
    _assert_released(executor)


# A result message that is none of the workers' (a peer on the result socket, a truncated
# frame): any frame count, an unknown kind, or a known kind whose body does not decode. A
# FAILURE is left out (a real one rightly ends the executor), and so are whole bodies of the
# kinds a call waits for (they would be answers).
_WHOLE_REPLY = msgspec.msgpack.encode(
    WorkerCallResult(0, msgspec.Raw(msgspec.msgpack.encode(Fact(0, 1, [1, 2]))))
)
_MALFORMED_RESULTS = st.one_of(
    st.lists(st.binary(max_size=16), min_size=1, max_size=4).filter(lambda f: len(f) != 2),
    st.tuples(
        st.binary(min_size=1, max_size=2).filter(lambda k: k != worker_proc.FAILURE),
        st.binary(max_size=32),
    ).filter(lambda f: f[0] not in (worker_proc.REPLY, worker_proc.OUTPUT, worker_proc.READY)),
    st.tuples(
        st.sampled_from([worker_proc.REPLY, worker_proc.OUTPUT, worker_proc.READY]),
        st.integers(0, len(_WHOLE_REPLY) - 1).map(lambda n: _WHOLE_REPLY[:n]),  # truncated
    ),
).map(list)


@pytest.fixture(scope="module")
def result_peer(mp_executor) -> Iterator[zmq.Socket]:
    """A PUSH to the executor's result socket, connected once (its first messages would
    otherwise wait for the connection)."""
    ctx = zmq.Context()
    peer = ctx.socket(zmq.PUSH)
    peer.linger = 0
    peer.connect(mp_executor.result_addr)
    yield peer
    ctx.destroy(linger=0)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(messages=st.lists(_MALFORMED_RESULTS, min_size=1, max_size=3))
def test_mp_drops_malformed_result_messages_and_serves_on(mp_executor, result_peer, messages):
    with _dropped_lines() as dropped:
        for frames in messages:
            result_peer.send_multipart(frames)
        # Each call reads what is queued; the malformed messages go by in its waits.
        deadline = time.monotonic() + 10
        while len(dropped) < len(messages) and time.monotonic() < deadline:
            answer = mp_executor.collective_rpc("made_up_fact", (1,), ranks=[0], result_type=Fact)
            assert answer[0].rank == 0 and answer[0].scaled == [1, 2]
        assert len(dropped) == len(messages), dropped  # one line each


class _DroppedLines(logging.Handler):
    def __init__(self):
        super().__init__(logging.ERROR)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.getMessage().startswith("mp executor: dropped"):
            self.lines.append(record.getMessage())


@contextlib.contextmanager
def _dropped_lines():
    """The executor's 'dropped' log lines while the block runs (caplog is function-scoped,
    and hypothesis runs the test body many times in one call)."""
    handler = _DroppedLines()
    logger = logging.getLogger("kvserve.services.scheduler.executors.mp_executor")
    logger.addHandler(handler)
    try:
        yield handler.lines
    finally:
        logger.removeHandler(handler)
