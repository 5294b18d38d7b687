"""Executors run the workers for an engine core: `uni` in-process, `mp` one process per rank,
`ray` one Ray actor per rank across nodes (ray_executor.py, imported only when asked).

Besides the hot step (`execute_model`), an executor has one generic call to its workers,
`collective_rpc`: run a named public `Worker` method on some ranks and return what each
answered. Facts a worker learns at start-up (GEMM plan, step costs, KV layout) come back
through it, asked for by name in the engine core, so a new fact touches only the worker
(its method) and the one place that asks for it, never an executor or a message.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Literal

import msgspec

from kvserve.shared.config import EngineConfig
from kvserve.shared.messages import ModelRunnerOutput, SchedulerOutput, WorkerReady

# Which ranks run a collective_rpc: None every rank, "driver" the driver rank (TP rank 0 of
# the last pipeline stage), or a list of global ranks.
Ranks = list[int] | Literal["driver"] | None


class Executor:
    """What the engine core needs from its workers, whatever process they live in."""

    max_model_len: int
    world_size: int = 1
    driver_rank: int = 0  # the rank that samples and answers execute_model

    @property
    def worker_pids(self) -> list[int]:
        """Processes to watch for liveness besides the engine core's own (none in-process)."""
        return []

    def collective_rpc(
        self,
        method: str,
        args: Sequence[Any] = (),
        kwargs: Mapping[str, Any] | None = None,
        ranks: Ranks = None,
        result_type: Any = Any,
        timeout_s: float | None = None,
    ) -> list[Any]:
        """Run the public Worker method `method` on `ranks` and return their answers.

        Arguments and answers cross as msgpack in every executor, in-process too, so a
        method that works under uni works under mp and ray. A method that runs collectives
        (torch.distributed) must run on every rank (ranks=None).

        Args:
            method: the name of a public method of services/worker/worker.py's Worker.
            args: positional arguments, msgspec-encodable.
            kwargs: keyword arguments, msgspec-encodable.
            ranks: None (every rank), "driver", or a list of distinct global ranks.
            result_type: the type each answer is decoded as (Any: plain msgpack values).
            timeout_s: limit for the answers (the executor's start-up limit by default).

        Returns:
            One answer per rank asked, in the order asked (rank order for None).

        Raises:
            RuntimeError: a rank raised, died or froze (the executor stays dead, as after a
                failed step).
        """
        raise NotImplementedError

    def resolve_ranks(self, ranks: Ranks) -> list[int]:
        """The global ranks `ranks` names, checked against the world size."""
        if ranks is None:
            return list(range(self.world_size))
        if ranks == "driver":
            return [self.driver_rank]
        if len(set(ranks)) != len(ranks) or not all(0 <= r < self.world_size for r in ranks):
            raise ValueError(f"ranks {ranks} are not distinct ranks of 0..{self.world_size - 1}")
        return list(ranks)

    def determine_num_blocks(self) -> int:
        raise NotImplementedError

    def initialize_kv_cache(self, num_blocks: int) -> None:
        """Have every rank allocate its KV cache; returns once all have."""
        self.collective_rpc("initialize_kv_cache", (num_blocks,))

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        raise NotImplementedError

    def check_health(self) -> None:
        """Raise RuntimeError when a worker is dead or frozen (called while idle too)."""

    def shutdown(self) -> None:
        pass


class RankedExecutor(Executor):
    """An executor of worker ranks in other processes (`mp`, `ray`), each of which reports a
    WorkerReady at start-up: what the executor needs is taken from those reports."""

    def _take_readies(self, readies: list[WorkerReady]) -> None:
        """The ranks' start-up reports, by rank."""
        self.max_model_len = min(r.max_model_len for r in readies)
        self._num_blocks = min(r.num_blocks for r in readies)

    def determine_num_blocks(self) -> int:
        """KV blocks that fit every rank: the smallest of their start-up reports."""
        return self._num_blocks


class UniExecutor(Executor):
    """The single worker runs inside the engine-core process: no IPC at all.

    Args:
        config: the engine config (TP x PP = 1).
        model_dir: a resolved HF-style model folder.
        worker_cls: the Worker class to run (a subclass adds methods; tests use one).
    """

    def __init__(self, config: EngineConfig, model_dir: str, worker_cls: type | None = None):
        if worker_cls is None:
            from kvserve.services.worker.worker import Worker  # the one allowed in-process import

            worker_cls = Worker
        self.worker = worker_cls(config, model_dir, rank=0)
        self.max_model_len = self.worker.max_model_len

    def collective_rpc(
        self,
        method: str,
        args: Sequence[Any] = (),
        kwargs: Mapping[str, Any] | None = None,
        ranks: Ranks = None,
        result_type: Any = Any,
        timeout_s: float | None = None,
    ) -> list[Any]:
        """A direct call of the one worker; arguments and answer still round-trip through
        msgpack, so the method sees (and returns) what it would across processes."""
        self.resolve_ranks(ranks)
        plain_args, plain_kwargs = msgspec.msgpack.decode(
            msgspec.msgpack.encode((list(args), dict(kwargs or {})))
        )
        result = self.worker.call(method, plain_args, plain_kwargs)
        return [msgspec.msgpack.decode(msgspec.msgpack.encode(result), type=result_type)]

    def determine_num_blocks(self) -> int:
        return self.worker.determine_num_blocks()

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.worker.initialize_kv_cache(num_blocks)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.worker.execute_model(scheduler_output)
