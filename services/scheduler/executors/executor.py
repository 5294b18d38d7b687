"""Executors run the workers for an engine core: `uni` in-process, `mp` one process per rank,
`ray` one Ray actor per rank across nodes (ray_executor.py, imported only when asked)."""

from __future__ import annotations

from kvserve.shared.config import EngineConfig
from kvserve.shared.messages import (
    KvFingerprint,
    ModelRunnerOutput,
    SchedulerOutput,
    WorkerReady,
)


class Executor:
    """What the engine core needs from its workers, whatever process they live in."""

    max_model_len: int

    @property
    def worker_pids(self) -> list[int]:
        """Processes to watch for liveness besides the engine core's own (none in-process)."""
        return []

    @property
    def gemm_plan(self) -> dict[str, str]:
        """The driver rank's CPU GEMM path per layer shape (kernels/gemm.py)."""
        return {}

    @property
    def step_costs(self) -> list[tuple[int, float]]:
        """The driver's forward times by query tokens (adaptive speculation; else empty)."""
        return []

    @property
    def kv_fingerprint(self) -> KvFingerprint | None:
        """TP rank 0's KV block layout (with a KV connector; else None)."""
        return None

    def determine_num_blocks(self) -> int:
        raise NotImplementedError

    def initialize_kv_cache(self, num_blocks: int) -> None:
        raise NotImplementedError

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        raise NotImplementedError

    def check_health(self) -> None:
        """Raise RuntimeError when a worker is dead or frozen (called while idle too)."""

    def shutdown(self) -> None:
        pass


class RankedExecutor(Executor):
    """An executor of worker ranks in other processes (`mp`, `ray`), each of which reports a
    WorkerReady at start-up: what the engine needs is taken from those reports."""

    def _take_readies(self, readies: list[WorkerReady]) -> None:
        """The ranks' start-up reports, by rank (the driver's GEMM plan and step costs)."""
        self.max_model_len = min(r.max_model_len for r in readies)
        self._gemm_plan = readies[0].gemm_plan
        self._step_costs = [(int(n), float(t)) for n, t in readies[0].step_costs]
        self._kv_fingerprint = readies[0].kv_fingerprint
        self._num_blocks = min(r.num_blocks for r in readies)

    @property
    def gemm_plan(self) -> dict[str, str]:
        return self._gemm_plan

    @property
    def step_costs(self) -> list[tuple[int, float]]:
        return self._step_costs

    @property
    def kv_fingerprint(self) -> KvFingerprint | None:
        return self._kv_fingerprint

    def determine_num_blocks(self) -> int:
        """KV blocks that fit every rank: the smallest of their start-up reports."""
        return self._num_blocks


class UniExecutor(Executor):
    """The single worker runs inside the engine-core process: no IPC at all."""

    def __init__(self, config: EngineConfig, model_dir: str):
        from kvserve.services.worker.worker import Worker  # the one allowed in-process import

        self.worker = Worker(config, model_dir, rank=0)
        self.max_model_len = self.worker.max_model_len
        self._step_costs = self.worker.measure_step_costs()

    @property
    def step_costs(self) -> list[tuple[int, float]]:
        return self._step_costs

    @property
    def kv_fingerprint(self) -> KvFingerprint | None:
        return self.worker.kv_fingerprint

    @property
    def gemm_plan(self) -> dict[str, str]:
        return self.worker.gemm_plan

    def determine_num_blocks(self) -> int:
        return self.worker.determine_num_blocks()

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.worker.initialize_kv_cache(num_blocks)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.worker.execute_model(scheduler_output)
