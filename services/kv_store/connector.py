"""The KV connector seam: how an engine's paged cache meets something outside it (vLLM's
KV-connector shape).

A connector is two objects, one per process kind, that talk to each other through bytes the
core never reads:

- `SchedulerConnector` (engine core): answers how many of a waiting request's full prompt
  blocks, past its local prefix hits, it can load (external hits); the scheduler then gives
  the request slots for them and parks it (`start_load`). Each step the connector encodes
  what the workers move (`build_connector_meta` -> `SchedulerOutput.kv_connector_metadata`)
  and reads their answer back (`update_from_output` -> blocks loaded per request). It owns
  its own bookkeeping (what was saved, what is loading) and its stats.
- `WorkerConnector` (each worker rank): the runner calls `before_forward(metadata)` and
  `after_forward(metadata) -> bytes` (`ModelRunnerOutput.kv_connector_output`, rank 0's
  reaches the scheduler). Under TP the ranks agree among themselves on what loaded.

Connectors are chosen by `KVTransferConfig.kv_connector` from registry.py, where a new one
registers its two classes. The built-in ones move blocks to and from a store
(scheduler_connector.py, worker_connector.py, backends.py).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvserve.services.scheduler.core.kv_cache_manager import KVCacheManager
    from kvserve.services.scheduler.core.request import Request
    from kvserve.services.scheduler.core.step_plan import StepPlan


class SchedulerConnector(ABC):
    """The engine core's half of a KV connector; the scheduler calls it at fixed points.

    A subclass is built as `cls(config, fingerprint, block_size)`: the KVTransferConfig, TP
    rank 0's KvFingerprint, and tokens per block.
    """

    def bind(self, kv_cache_manager: KVCacheManager) -> None:
        """The scheduler's cache, given once before the first step (for block ids, and the
        evicted blocks an offloading connector saves)."""
        self.kv_cache_manager = kv_cache_manager

    @abstractmethod
    def num_external_blocks(self, request: Request, num_local_blocks: int) -> int:
        """Full prompt blocks past the local hits that this connector can load, from the
        first block the engine lacks (0: none; the request computes as usual).

        Args:
            request: a waiting request (its block hashes are known).
            num_local_blocks: blocks the engine's own prefix cache already gives.
        """

    @abstractmethod
    def start_load(self, request: Request, first_block: int, num_blocks: int) -> None:
        """The request now holds slots for blocks [first_block, first_block + num_blocks)
        and waits for them: list the load in this step's metadata."""

    @abstractmethod
    def build_connector_meta(self, plan: StepPlan) -> bytes:
        """This step's metadata for the workers (b"": nothing to do). Called once per step,
        after the batch is decided and before num_computed_tokens advances."""

    @abstractmethod
    def update_from_output(self, metadata: bytes, output: bytes) -> dict[str, int]:
        """Blocks loaded per request whose load `metadata` listed and that still waits
        (fewer than asked: the rest is recomputed).

        Args:
            metadata: the step's `build_connector_meta` bytes.
            output: rank 0's `WorkerConnector.after_forward` bytes (b"" when the workers
                did not run the step).
        """

    def pin_blocks(  # noqa: B027 - an optional hook
        self, block_hashes: list[bytes], block_ids: list[int], ttl_s: float, save: bool
    ) -> None:
        """A prompt pin (scheduler/core/prompt_pins.py): keep these blocks in the store for
        `ttl_s`, writing them through first when `save` (a new pin; a hit only refreshes)."""

    def request_finished(self, request: Request) -> None:  # noqa: B027 - an optional hook
        """A request ended (finished, aborted, or failed): forget it."""

    def take_stats(self) -> dict:
        """SchedulerStats fields since the last call (then reset)."""
        return {}

    def close(self) -> None:  # noqa: B027 - an optional hook
        """Release what the connector holds (its store connection)."""


class WorkerConnector(ABC):
    """A worker rank's half of a KV connector: the runner calls it around the forward.

    A subclass is built as `cls(config, fingerprint, kv_caches)`: the KVTransferConfig, this
    rank's KvFingerprint, and its paged caches (one [2, num_blocks, block_size, heads, head]
    tensor per layer).
    """

    @abstractmethod
    def before_forward(self, metadata: bytes) -> None:
        """Move what must be in place before the forward (loads; blocks the step rewrites)."""

    @abstractmethod
    def after_forward(self, metadata: bytes) -> bytes:
        """Move what the forward computed; the answer for the scheduler-side connector."""

    def close(self) -> None:  # noqa: B027 - an optional hook
        """Release what the connector holds."""
