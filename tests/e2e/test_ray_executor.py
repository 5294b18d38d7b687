"""The ray executor on a Ray cluster of two one-CPU nodes on this machine (real raylets,
real actors, gloo between them): TP = 2 and PP = 2 give the single-rank tokens with one
rank per node, a killed actor fails the running request and kills the engine (the api
answers 503), a killed engine takes its actors with it, and without a cluster the executor
says how to start one. Nothing imports ray unless asked.

The cluster (tests/support/ray_cluster.py) comes up once for the module, ~12 s; each engine
start adds ~10-14 s (two actors import torch and meet over gloo on two cores). The module
takes ~70 s here.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time

import pytest

from kvserve import LLM, SamplingParams
from tests.support import REPO_ROOT
from tests.support.kv import assert_no_leaked_blocks
from tests.support.models import save_tiny_parallel_llama
from tests.support.ports import free_port
from tests.support.processes import wait_gone
from tests.support.ray_cluster import local_ray_cluster, ray_on_loopback, require_ray
from tests.support.server import ServeProcess, health_status, stream_completion
from tests.support.waiting import wait_until

NUM_TOKENS = 16
# Token-id prompts: the tiny model borrows the default model's tokenizer (test_parallel.py).
TINY_PROMPTS = [[5, 17, 99, 3, 42], [7] * 11, list(range(20, 60)), [100, 101]]
_RANK_LINE = re.compile(r"rank (\d+) is Ray actor pid (\d+) on node \S+ (\w+)")


@pytest.fixture(scope="module")
def ray_cluster():
    require_ray()
    with local_ray_cluster(num_nodes=2, num_cpus_per_node=1) as cluster:
        yield cluster


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory) -> str:
    return save_tiny_parallel_llama(str(tmp_path_factory.mktemp("tiny-ray-llama")))


def _llm(model: str, tokenizer: str, tp: int = 1, pp: int = 1, **kwargs) -> LLM:
    return LLM(
        model,
        tokenizer=tokenizer,
        dtype="float32",
        tensor_parallel_size=tp,
        pipeline_parallel_size=pp,
        kv_cache_memory=64 << 20,
        max_model_len=256,
        **kwargs,
    )


def _greedy(llm: LLM) -> list[list[int]]:
    prompts = [{"prompt_token_ids": ids} for ids in TINY_PROMPTS]
    params = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.fixture(scope="module")
def single_rank_tokens(tiny_llama, default_model_dir) -> list[list[int]]:
    llm = _llm(tiny_llama, default_model_dir)  # the uni executor: no Ray at all
    try:
        tokens = _greedy(llm)
    finally:
        llm.engine_core.shutdown()
    assert len({tuple(ids) for ids in tokens}) == len(TINY_PROMPTS), "degenerate model"
    return tokens


@pytest.mark.slow
@pytest.mark.parametrize("tp, pp", [(2, 1), (1, 2)])
def test_ranks_on_two_nodes_give_the_single_rank_tokens(
    ray_cluster, tiny_llama, default_model_dir, single_rank_tokens, tp, pp
):
    import ray

    from kvserve.services.scheduler.executors.ray_executor import RayExecutor

    llm = _llm(tiny_llama, default_model_dir, tp, pp, distributed_executor_backend="ray")
    executor = llm.engine_core.executor
    assert isinstance(executor, RayExecutor)
    pids = [placement.pid for placement in executor.placements]
    try:
        # Two bundles of one CPU, nodes of one CPU each: one rank per node.
        assert sorted(p.node_id for p in executor.placements) == sorted(ray_cluster.node_ids)
        assert os.getpid() not in pids
        assert _greedy(llm) == single_rank_tokens
        assert_no_leaked_blocks(llm.engine_core.scheduler)
    finally:
        llm.engine_core.shutdown()
    assert not wait_gone(pids, timeout_s=10), "Ray actors outlived shutdown"
    assert not ray.is_initialized(), "the executor stayed connected to the cluster it joined"


@pytest.mark.slow
def test_killed_actor_fails_the_running_request_and_the_engine(
    ray_cluster, tiny_llama, default_model_dir, tmp_path
):
    port = free_port()
    server = ServeProcess(
        [
            tiny_llama,
            "--tokenizer",
            default_model_dir,
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--dtype",
            "float32",
            "--max-model-len",
            "256",
            "--kv-cache-memory",
            str(64 << 20),
            "--tensor-parallel-size",
            "2",
            "--distributed-executor-backend",
            "ray",
            "--uvicorn-log-level",
            "warning",
        ],
        str(tmp_path / "serve.log"),
        port,
        served_model_name=tiny_llama,
    )
    try:
        server.wait_healthy()
        ranks = {int(r): (int(pid), node) for r, pid, node in _RANK_LINE.findall(server.log())}
        assert sorted(ranks) == [0, 1], server.log()
        assert ranks[0][1] != ranks[1][1], "both ranks on one node"
        events: list = []
        first_data = threading.Event()
        body = {"model": tiny_llama, "prompt": [5, 17, 99], "max_tokens": 240}
        body |= {"temperature": 0, "ignore_eos": True}
        client = threading.Thread(
            target=stream_completion, args=(server.url, body, events, first_data)
        )
        client.start()
        assert first_data.wait(60), server.log()

        os.kill(ranks[1][0], signal.SIGKILL)
        killed_at = time.monotonic()
        client.join(timeout=30)
        assert not client.is_alive(), "the stream went on after the kill"
        errors = [(t, c) for t, c in events if isinstance(c, str) and '"error"' in c]
        assert errors, f"no error in the stream: {events[-3:]}"
        when, error = errors[0]
        assert "worker rank 1" in error and "died" in error, error
        assert when - killed_at < 5.0, f"the error came {when - killed_at:.1f} s after the kill"
        assert not any('"finish_reason":"length"' in str(c).replace(" ", "") for _, c in events)
        assert wait_until(lambda: health_status(port) != 200, timeout_s=5), "still healthy"
        # The engine core died with it: the server exits, and Ray reaps rank 0's actor.
        assert server.process.wait(timeout=60) == 1, server.log()
        assert not wait_gone([ranks[0][0]], timeout_s=15), "rank 0's actor outlived its engine"
    finally:
        server.stop()


_ENGINE_THAT_DIES = """
import sys, time
from kvserve.shared.config import CacheConfig, EngineConfig, ParallelConfig
from kvserve.services.scheduler.executors.ray_executor import RayExecutor
parallel = ParallelConfig(distributed_executor_backend="ray", tensor_parallel_size=2)
config = EngineConfig(cache=CacheConfig(num_gpu_blocks_override=16), parallel=parallel)
executor = RayExecutor(config, sys.argv[1])
print(*[placement.pid for placement in executor.placements], flush=True)
time.sleep(120)
"""


@pytest.mark.slow
def test_actors_exit_when_the_engine_process_dies(ray_cluster, tiny_llama):
    # The engine is the actors' owner (a Ray driver): its death makes Ray kill them.
    engine = subprocess.Popen(
        [sys.executable, "-c", _ENGINE_THAT_DIES, tiny_llama],
        cwd=REPO_ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        actor_pids = [int(pid) for pid in engine.stdout.readline().split()]
        assert len(actor_pids) == 2, "the engine did not start its actors"
        os.kill(engine.pid, signal.SIGKILL)
        engine.wait(10)
        assert not wait_gone(actor_pids, timeout_s=15), "orphaned actors kept running"
    finally:
        if engine.poll() is None:
            engine.kill()
            engine.wait()


_NO_RAY_ON_IMPORT = """
import sys
import kvserve.services.scheduler.engine.engine_core
import kvserve.cli
assert "ray" not in sys.modules, "ray imported without --distributed-executor-backend ray"
"""


def test_nothing_imports_ray_unless_asked():
    subprocess.run([sys.executable, "-c", _NO_RAY_ON_IMPORT], cwd=REPO_ROOT, check=True)


def test_without_a_cluster_the_error_says_how_to_start_one(tiny_llama, monkeypatch):
    require_ray()
    import ray

    from kvserve.services.scheduler.executors.ray_executor import RayExecutor
    from kvserve.shared.config import EngineConfig

    assert not ray.is_initialized()
    config = EngineConfig.from_kwargs(distributed_executor_backend="ray", tensor_parallel_size=2)
    # Nothing listens there: ray.init would retry for minutes, the executor fails at once.
    monkeypatch.setenv("RAY_ADDRESS", f"127.0.0.1:{free_port()}")
    start = time.monotonic()
    with ray_on_loopback(), pytest.raises(RuntimeError, match=r"ray start --head"):
        RayExecutor(config, tiny_llama)
    assert time.monotonic() - start < 15
    assert not ray.is_initialized()
