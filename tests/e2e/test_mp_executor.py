"""The mp executor: worker processes fed by the shared-memory ring give the uni executor's
tokens, every rank follows every step, and a dead or failing worker fails the next step fast.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import msgspec
import pytest

from kvserve import LLM, SamplingParams
from kvserve.services.scheduler.executors.mp_executor import MpExecutor
from kvserve.shared.config import EngineConfig, ParallelConfig
from kvserve.shared.messages import CachedRequestData, SchedulerOutput
from tests.support import REPO_ROOT
from tests.support.kv import assert_no_leaked_blocks
from tests.support.models import DEFAULT_MODEL_KV_CACHE_MEMORY
from tests.support.processes import wait_gone
from tests.support.waiting import wait_until

pytestmark = pytest.mark.slow

PROMPTS = [
    "The capital of France is",
    "Write a haiku about the sea.",
    "1, 2, 3, 4,",
    "def fibonacci(n):",
]
# More steps than the ring has chunks (8), so a rank that skipped messages would stall it.
MAX_TOKENS = 20


def _greedy(llm: LLM) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]


def _assert_released(executor: MpExecutor) -> None:
    assert not wait_gone(executor.worker_pids, timeout_s=10), "worker processes outlived shutdown"
    assert not os.path.exists(f"/dev/shm/{executor.ring_handle.name}"), "ring segment leaked"


@pytest.fixture(scope="module")
def uni_tokens() -> list[list[int]]:
    llm = LLM(dtype="float32", kv_cache_memory=DEFAULT_MODEL_KV_CACHE_MEMORY)
    try:
        return _greedy(llm)
    finally:
        llm.engine_core.shutdown()


def test_mp_gives_the_same_tokens_as_uni(uni_tokens):
    llm = LLM(
        dtype="float32",
        kv_cache_memory=DEFAULT_MODEL_KV_CACHE_MEMORY,
        distributed_executor_backend="mp",
    )
    executor = llm.engine_core.executor
    assert isinstance(executor, MpExecutor)
    assert all(pid != os.getpid() for pid in executor.worker_pids)
    try:
        assert _greedy(llm) == uni_tokens
        assert_no_leaked_blocks(llm.engine_core.scheduler)
    finally:
        llm.engine_core.shutdown()
    _assert_released(executor)


def test_killed_worker_fails_the_next_step_fast():
    llm = LLM(dtype="float32", distributed_executor_backend="mp", num_gpu_blocks_override=256)
    executor = llm.engine_core.executor
    params = SamplingParams(temperature=0.0, max_tokens=4)
    try:
        llm.generate(PROMPTS[0], params, use_tqdm=False)
        os.kill(executor.worker_pids[0], signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(
            RuntimeError,
            match=r"worker rank 0 \(pid \d+\) died: killed by "
            r"SIGKILL",
        ):
            llm.generate(PROMPTS[1], params, use_tqdm=False)
        assert time.monotonic() - start < 5.0
        # Dead stays dead: later calls fail at once with the same reason.
        with pytest.raises(RuntimeError, match="worker rank 0"):
            executor.execute_model(SchedulerOutput())
    finally:
        start = time.monotonic()
        llm.engine_core.shutdown()
    assert time.monotonic() - start < 10.0
    _assert_released(executor)


def test_worker_exception_comes_back_with_its_traceback(default_model_dir):
    config = EngineConfig(parallel=ParallelConfig(distributed_executor_backend="mp"))
    config = msgspec.structs.replace(
        config, cache=msgspec.structs.replace(config.cache, num_gpu_blocks_override=64)
    )
    executor = MpExecutor(config, default_model_dir)
    try:
        assert executor.determine_num_blocks() == 64
        executor.initialize_kv_cache(64)
        # A step for a request the worker never saw: the worker raises and reports it.
        bogus = SchedulerOutput(
            scheduled_cached_reqs=CachedRequestData(["no-such-request"], [[1]], [5]),
            num_scheduled_tokens={"no-such-request": 1},
            total_num_scheduled_tokens=1,
        )
        with pytest.raises(RuntimeError, match=r"(?s)worker rank 0 failed:.*Traceback"):
            executor.execute_model(bogus)
    finally:
        executor.shutdown()
    _assert_released(executor)


_ENGINE_THAT_DIES = """
import time
from kvserve.shared.config import EngineConfig, CacheConfig, ParallelConfig
from kvserve.services.scheduler.executors.mp_executor import MpExecutor
from kvserve.services.worker.model_loader import resolve_model
config = EngineConfig(cache=CacheConfig(num_gpu_blocks_override=16),
                      parallel=ParallelConfig(distributed_executor_backend="mp"))
executor = MpExecutor(config, resolve_model(None))
print(executor.worker_pids[0], executor.ring_handle.name, flush=True)
time.sleep(120)
"""


def test_workers_exit_when_the_engine_process_dies():
    # A SIGKILLed engine cannot remove its ipc socket folder: keep it in one we remove.
    tmp_dir = tempfile.mkdtemp(prefix="kvserve-test-")
    engine = subprocess.Popen(
        [sys.executable, "-c", _ENGINE_THAT_DIES],
        cwd=REPO_ROOT,
        env={**os.environ, "TMPDIR": tmp_dir},
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        worker_pid, ring_name = engine.stdout.readline().split()
        os.kill(engine.pid, signal.SIGKILL)
        engine.wait(10)
        # The orphaned worker notices it was reparented and exits; nothing holds the ring.
        assert not wait_gone([int(worker_pid)], timeout_s=10), "orphaned worker kept running"
        assert wait_until(lambda: not os.path.exists(f"/dev/shm/{ring_name}"), timeout_s=10), (
            "ring segment leaked"
        )
    finally:
        if engine.poll() is None:
            engine.kill()
        shutil.rmtree(tmp_dir, ignore_errors=True)
