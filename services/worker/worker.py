"""Worker: one per device (TP/PP rank). Owns the device, the model runner and the KV cache."""

from __future__ import annotations

import torch

from kvserve.shared.config import EngineConfig
from kvserve.shared.logging import init_logger
from kvserve.shared.messages import ModelRunnerOutput, SchedulerOutput
from kvserve.services.worker.model_runner import ModelRunner
from kvserve.services.worker.parallel_check import load_hf_config, verify_parallel_sizes
from kvserve.services.worker.parallel_state import (
    destroy_distributed_environment,
    init_distributed_environment,
    initialize_model_parallel,
)

logger = init_logger(__name__)


class Worker:
    """Args:
        config: the engine config.
        model_dir: a resolved HF-style model folder.
        rank: this worker's global rank (TP-major; see parallel_state).
        distributed_init_method: the torch.distributed rendezvous (tcp://host:port); needed
            when TP x PP > 1, where the constructor joins the world group and builds the
            TP and PP groups before it builds this rank's shard of the model.
    """

    def __init__(self, config: EngineConfig, model_dir: str, rank: int = 0,
                 distributed_init_method: str | None = None):
        self.config = config
        self.rank = rank
        parallel = config.parallel
        self.world_size = parallel.world_size
        if torch.cuda.is_available():
            self.device = torch.device("cuda", rank % torch.cuda.device_count())
            torch.cuda.set_device(self.device)
        else:
            self.device = torch.device("cpu")
        if self.world_size > 1:
            if distributed_init_method is None:
                raise ValueError(f"TP x PP = {self.world_size} needs a rendezvous address "
                                 "(distributed_init_method)")
            # Before the rendezvous: every rank fails alike, none waits for the others.
            verify_parallel_sizes(load_hf_config(model_dir), parallel.tensor_parallel_size,
                                  parallel.pipeline_parallel_size)
            backend = "nccl" if self.device.type == "cuda" else "gloo"
            init_distributed_environment(self.world_size, rank, distributed_init_method,
                                         backend)
            initialize_model_parallel(parallel.tensor_parallel_size,
                                      parallel.pipeline_parallel_size)
            logger.info("worker rank %d joined %s over %s (TP %d x PP %d)", rank,
                        distributed_init_method, backend, parallel.tensor_parallel_size,
                        parallel.pipeline_parallel_size)
        # The RNG unseeded requests draw from (only the driver rank samples; see ModelRunner).
        torch.manual_seed(config.model.seed)
        self.runner = ModelRunner(config, model_dir, self.device)

    @property
    def max_model_len(self) -> int:
        return self.runner.max_model_len

    def determine_num_blocks(self) -> int:
        """KV blocks that fit the memory budget (plus the null block 0)."""
        cache = self.config.cache
        if cache.num_gpu_blocks_override is not None:
            return cache.num_gpu_blocks_override
        per_block = self.runner.kv_cache_bytes_per_block()
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            budget = int(free * cache.gpu_memory_utilization)
        else:
            budget = cache.kv_cache_bytes
        num_blocks = budget // per_block
        if num_blocks < 2:
            raise ValueError(f"the KV cache budget of {budget} bytes holds no block of "
                             f"{per_block} bytes; raise --kv-cache-memory")
        return num_blocks

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.runner.initialize_kv_cache(num_blocks)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.runner.execute_model(scheduler_output)

    def shutdown(self) -> None:
        """Leave the process groups (a no-op for a single rank)."""
        if self.world_size > 1:
            destroy_distributed_environment()
