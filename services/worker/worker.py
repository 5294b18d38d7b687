"""Worker: one per device (TP/PP rank). Owns the device, the model runner and the KV cache."""

from __future__ import annotations

import torch

from shared.config import EngineConfig
from shared.logging import init_logger
from shared.messages import ModelRunnerOutput, SchedulerOutput
from services.worker.model_runner import ModelRunner

logger = init_logger(__name__)


class Worker:
    """Args:
        config: the engine config.
        model_dir: a resolved HF-style model folder.
        rank: this worker's global rank (0 answers the engine core).
    """

    def __init__(self, config: EngineConfig, model_dir: str, rank: int = 0):
        self.config = config
        self.rank = rank
        self.device = torch.device("cuda", rank) if torch.cuda.is_available() \
            else torch.device("cpu")
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
