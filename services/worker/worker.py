"""Worker: one per device (TP/PP rank). Owns the device, the model runner and the KV cache."""

from __future__ import annotations

import inspect
import os
import typing
from collections.abc import Mapping, Sequence
from typing import Any

import msgspec
import torch

from kvserve.kernels.dispatch import describe
from kvserve.services.worker.model_runner import ModelRunner
from kvserve.services.worker.parallel_check import load_hf_config, verify_parallel_sizes
from kvserve.services.worker.parallel_state import (
    destroy_distributed_environment,
    init_distributed_environment,
    initialize_model_parallel,
)
from kvserve.services.worker.sleep import HostWeights, release_memory
from kvserve.shared.config import EngineConfig
from kvserve.shared.kv_cache_groups import KVCacheGroupSpec
from kvserve.shared.logging import init_logger
from kvserve.shared.messages import KvFingerprint, ModelRunnerOutput, SchedulerOutput, WorkerReady
from kvserve.shared.wire import SLEEP_KV_CACHE, SLEEP_WEIGHTS, check_sleep_tags

logger = init_logger(__name__)

_VARIADIC = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)


class Worker:
    """
    Args:
        config: the engine config.
        model_dir: a resolved HF-style model folder.
        rank: this worker's global rank (TP-major; see parallel_state).
        distributed_init_method: the torch.distributed rendezvous (tcp://host:port); needed
            when TP x PP > 1, where the constructor joins the world group and builds the
            TP and PP groups before it builds this rank's shard of the model.
    """

    def __init__(
        self,
        config: EngineConfig,
        model_dir: str,
        rank: int = 0,
        distributed_init_method: str | None = None,
    ):
        self.config = config
        self.model_dir = model_dir
        self.rank = rank
        self.num_blocks = 0  # of the KV cache, once bound (a wake_up binds as many again)
        # Sleep mode: the weights moved to host memory (level 1 on CUDA), else None.
        self.host_weights: HostWeights | None = None
        parallel = config.parallel
        self.world_size = parallel.world_size
        if torch.cuda.is_available():
            self.device = torch.device("cuda", rank % torch.cuda.device_count())
            torch.cuda.set_device(self.device)
        else:
            self.device = torch.device("cpu")
        if self.world_size > 1:
            if distributed_init_method is None:
                raise ValueError(
                    f"TP x PP = {self.world_size} needs a rendezvous address "
                    "(distributed_init_method)"
                )
            # Before the rendezvous: every rank fails alike, none waits for the others.
            verify_parallel_sizes(
                load_hf_config(model_dir),
                parallel.tensor_parallel_size,
                parallel.pipeline_parallel_size,
            )
            backend = "nccl" if self.device.type == "cuda" else "gloo"
            init_distributed_environment(self.world_size, rank, distributed_init_method, backend)
            initialize_model_parallel(
                parallel.tensor_parallel_size, parallel.pipeline_parallel_size
            )
            logger.info(
                "worker rank %d joined %s over %s (TP %d x PP %d)",
                rank,
                distributed_init_method,
                backend,
                parallel.tensor_parallel_size,
                parallel.pipeline_parallel_size,
            )
        # The RNG unseeded requests draw from (only the driver rank samples; see ModelRunner).
        torch.manual_seed(config.model.seed)
        self._runner: ModelRunner | None = ModelRunner(config, model_dir, self.device)
        if rank == 0:
            logger.info(
                "kernels for %s: %s", self.runner.dtype, describe(self.device, self.runner.dtype)
            )

    @property
    def runner(self) -> ModelRunner:
        """The model runner (a sleep at level 2 drops it until wake_up loads the weights)."""
        if self._runner is None:
            raise RuntimeError("the worker is asleep (level 2): wake_up loads the weights")
        return self._runner

    @property
    def max_model_len(self) -> int:
        return self.runner.max_model_len

    def call(
        self, method: str, args: Sequence[Any] = (), kwargs: Mapping[str, Any] | None = None
    ) -> Any:
        """Run this worker's public method `method`: the far end of Executor.collective_rpc.

        Arguments arrive as plain msgpack values (lists, dicts); each is converted to its
        parameter's annotated type (a Struct, a tuple), so a method sees the same values
        in-process and in a worker process. A method that raises fails this rank, as a
        failed step does.
        """
        function = getattr(self, method, None) if not method.startswith("_") else None
        if not callable(function):
            raise AttributeError(f"Worker has no public method {method!r}")
        signature = inspect.signature(function)
        parameters = signature.parameters
        bound = signature.bind(*args, **(kwargs or {}))
        hints = typing.get_type_hints(function)
        for name, value in bound.arguments.items():
            if name in hints and parameters[name].kind not in _VARIADIC:
                bound.arguments[name] = msgspec.convert(value, hints[name])
        return function(*bound.args, **bound.kwargs)

    # ---------------------------------------------------- start-up facts (collective_rpc)

    def gemm_plan(self) -> dict[str, str]:
        """This rank's CPU GEMM path per layer shape ({} off CPU)."""
        plan = self.runner.gemm_plan
        return plan.summary() if plan is not None else {}

    def kv_cache_groups(self) -> list[KVCacheGroupSpec]:
        """The model's KV cache groups (shared/kv_cache_groups.py), as the scheduler needs them."""
        return self.runner.kv_cache_groups

    def kv_fingerprint(self) -> KvFingerprint | None:
        """This rank's KV block layout when a KV connector is configured, else None."""
        if self.config.kv_transfer_config is None:
            return None
        return self.runner.kv_fingerprint()

    def prompt_keys_per_token(self) -> float:
        """Attended keys worth one prompt token's linear layers (ModelRunner's)."""
        return self.runner.prompt_keys_per_token()

    def measure_step_costs(self) -> list[tuple[int, float]]:
        """Forward times by query tokens, for adaptive speculation (see ModelRunner); every
        rank must run it (its forwards run collectives), before the KV cache exists."""
        return self.runner.measure_step_costs()

    def determine_num_blocks(self) -> int:
        """KV blocks that fit the memory budget (plus the null block 0)."""
        cache = self.config.cache
        if cache.num_gpu_blocks_override is not None:
            return cache.num_gpu_blocks_override
        per_block = self.runner.kv_cache_bytes_per_block()
        if per_block == 0:  # an encoder: blocks are bookkeeping, enough for every row
            max_blocks_per_req = -(-self.runner.max_model_len // cache.block_size)
            return self.config.scheduler.max_num_seqs * max_blocks_per_req + 1
        if self.device.type == "cuda" and cache.kv_cache_memory_bytes is None:
            budget = self._profile_cuda_budget(cache.gpu_memory_utilization)
        else:
            budget = cache.kv_cache_bytes
        num_blocks = budget // per_block
        if num_blocks < 2:
            flag = "--gpu-memory-utilization" if self.device.type == "cuda" else "--kv-cache-memory"
            raise ValueError(
                f"the KV cache budget of {budget} bytes holds no block of "
                f"{per_block} bytes; raise {flag}"
            )
        return num_blocks

    def _profile_cuda_budget(self, utilization: float) -> int:
        """Run the largest step without a cache and measure what is left for KV blocks."""
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        self.runner.profile_run()
        torch.cuda.synchronize(self.device)
        free, total = torch.cuda.mem_get_info(self.device)
        peak_torch = torch.cuda.max_memory_allocated(self.device)
        non_torch = (total - free) - torch.cuda.memory_reserved(self.device)
        budget = kv_cache_budget(total, utilization, peak_torch, non_torch)
        logger.info(
            "memory profile: %.2f GiB total x %.2f; weights + peak activations "
            "%.2f GiB, non-torch %.2f GiB; KV cache %.2f GiB",
            total / 2**30,
            utilization,
            peak_torch / 2**30,
            non_torch / 2**30,
            budget / 2**30,
        )
        return budget

    def ready_message(self) -> WorkerReady:
        """What this rank reports once its model is loaded (the mp and ray executors'
        start-up answer; it runs the KV memory profile)."""
        return WorkerReady(self.rank, os.getpid(), self.max_model_len, self.determine_num_blocks())

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.runner.initialize_kv_cache(num_blocks)

    # ---------------------------------------------- sleep mode (services/worker/sleep.py)

    def sleep(self, level: int) -> int:
        """Free the KV cache (level 1; on CUDA the weights also move to pinned host memory)
        or the KV cache and the weights (level 2). Returns the bytes freed on the device."""
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 or 2, got {level}")
        runner = self.runner
        if not runner.kv_caches:
            raise RuntimeError("the worker is already asleep")
        freed = sum(cache.numel() * cache.element_size() for cache in runner.kv_caches)
        runner.free_kv_cache()
        if level == 2:
            freed += sum(
                t.numel() * t.element_size()
                for t in {
                    id(t): t for t in runner.model.state_dict(keep_vars=True).values()
                }.values()
            )
            self._runner = None
            del runner
        elif self.device.type == "cuda":
            self.host_weights = HostWeights(runner.model)
            freed += self.host_weights.num_bytes
        release_memory(self.device)
        logger.info(
            "worker rank %d asleep at level %d: %.1f MiB freed", self.rank, level, freed / 2**20
        )
        return freed

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Restore what sleep freed: the weights (copied back, or loaded again from the
        checkpoint), then the KV cache (bound as at start-up; CUDA graphs captured again)."""
        for tag in check_sleep_tags(tags):
            if tag == SLEEP_WEIGHTS:
                if self._runner is None:
                    self._runner = ModelRunner(self.config, self.model_dir, self.device)
                elif self.host_weights is not None:
                    self.host_weights.restore(self.device)
                    self.host_weights = None
            else:
                assert tag == SLEEP_KV_CACHE
                if self._runner is None or self.host_weights is not None:
                    raise RuntimeError("wake the weights before the KV cache (tags=weights)")
                if not self._runner.kv_caches:
                    self._runner.initialize_kv_cache(self.num_blocks)
        logger.info("worker rank %d woke up: %s", self.rank, ", ".join(check_sleep_tags(tags)))

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.runner.execute_model(scheduler_output)

    def shutdown(self) -> None:
        """Leave the process groups (a no-op for a single rank)."""
        if self.world_size > 1:
            destroy_distributed_environment()


def kv_cache_budget(
    total_bytes: int, utilization: float, peak_torch_bytes: int, non_torch_bytes: int
) -> int:
    """Bytes for the KV cache: --gpu-memory-utilization is the fraction of the whole device
    for weights, activations and KV cache together (as in vLLM), so the cache gets that share
    less the profile run's peak (weights + activations) and what non-torch code (CUDA
    context, NCCL) holds. Never negative."""
    if not 0 < utilization <= 1:
        raise ValueError(f"--gpu-memory-utilization must be in (0, 1], got {utilization}")
    return max(0, int(total_bytes * utilization) - peak_torch_bytes - max(0, non_torch_bytes))
