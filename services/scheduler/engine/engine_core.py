"""EngineCore: the scheduler and the executor, stepped together.

One step is `schedule() -> execute_model() -> update_from_output()`. The in-process form here
serves the offline `LLM`; the engine-core process wraps the same object with IO threads.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time

import msgspec

from kvserve.services.scheduler.core.features import SchedulerFeatures
from kvserve.services.scheduler.core.scheduler import Scheduler
from kvserve.services.scheduler.engine.request_checks import (
    RequestChecker,
    queue_full_error,
)
from kvserve.services.scheduler.executors.executor import Executor, UniExecutor
from kvserve.services.scheduler.structured_output.manager import StructuredOutputManager
from kvserve.shared.config import CacheConfig, EngineConfig
from kvserve.shared.env import FAULT_POISON_TOKEN_ID
from kvserve.shared.kv_cache_groups import KVCacheGroupSpec
from kvserve.shared.kv_events import KVEventBatch
from kvserve.shared.logging import init_logger
from kvserve.shared.messages import (
    EngineCoreOutputs,
    EngineCoreRequest,
    KvFingerprint,
    ModelRunnerOutput,
)
from kvserve.shared.model_dir import is_encoder_model, model_config, model_vocab_size
from kvserve.shared.wire import (
    SLEEP_KV_CACHE,
    SLEEP_TAGS,
    SLEEP_WEIGHTS,
    EngineReady,
    check_sleep_tags,
    this_hostname,
)

logger = init_logger(__name__)

# An engine whose only requests wait for their grammars blocks this long for a compile at a
# time, instead of stepping idle (new inputs wait at most this long).
_GRAMMAR_WAIT_S = 0.01


def make_executor(config: EngineConfig, model_dir: str) -> Executor:
    """The executor --distributed-executor-backend names (uni when TP x PP = 1)."""
    kind = config.parallel.executor
    if kind == "uni":
        if config.parallel.world_size != 1:
            raise ValueError(
                f"the uni executor runs one in-process worker, but TP x PP = "
                f"{config.parallel.world_size}: use --executor mp"
            )
        return UniExecutor(config, model_dir)
    if kind == "mp":
        from kvserve.services.scheduler.executors.mp_executor import MpExecutor

        return MpExecutor(config, model_dir)
    if kind == "ray":
        # Lazily: only an engine asked for ray imports it (an optional dependency).
        from kvserve.services.scheduler.executors.ray_executor import RayExecutor

        return RayExecutor(config, model_dir)
    raise ValueError(f"unknown executor {kind!r}; use 'uni', 'mp' or 'ray'")


def _check_sleep_mode(config: EngineConfig) -> None:
    """--enable-sleep-mode frees and rebinds the target model's KV cache and weights only:
    refused beside the parts that hold their own (a draft model, a KV connector, LoRA)."""
    if not config.model.enable_sleep_mode:
        return
    others = {
        "--speculative-config": config.speculative_config is not None,
        "--kv-transfer-config / --kv-offloading-size": config.kv_transfer_config is not None,
        "--enable-lora": config.lora.enable_lora,
    }
    for flag, used in others.items():
        if used:
            raise ValueError(f"--enable-sleep-mode does not run with {flag}")


def encoder_engine_config(config: EngineConfig, model_dir: str) -> EngineConfig:
    """An encoder's engine config: each request computed whole in one step and never kept.

    Its attention is bidirectional, so a prompt split over steps (chunked prefill) or
    started from cached blocks (prefix caching) would see only part of itself: both are
    off, and the step budget holds the longest input. Its KV blocks are bookkeeping only
    (no layer has a cache): allocated when the request is scheduled, freed when it ends
    at the end of that same step.
    """
    max_len = config.model.max_model_len or model_config(model_dir).get(
        "max_position_embeddings", 512
    )
    scheduler = msgspec.structs.replace(
        config.scheduler,
        enable_chunked_prefill=False,
        max_num_batched_tokens=max(config.scheduler.max_num_batched_tokens, max_len),
    )
    cache = msgspec.structs.replace(config.cache, enable_prefix_caching=False)
    if config.parallel.world_size != 1 or config.speculative_config is not None:
        raise ValueError("an encoder model runs on one rank, without speculative decoding")
    logger.info(
        "encoder model: chunked prefill and prefix caching off, step budget %d tokens",
        scheduler.max_num_batched_tokens,
    )
    return msgspec.structs.replace(config, scheduler=scheduler, cache=cache)


def cache_config_info(cache: CacheConfig, num_blocks: int) -> dict[str, str]:
    """The cache config as vLLM reports it in `cache_config_info`: each field as a string
    ("None" when unset), and the KV block count the memory profile found."""
    info = {name: str(value) for name, value in msgspec.structs.asdict(cache).items()}
    info["num_gpu_blocks"] = str(num_blocks)
    return info


class EngineCore:
    """
    Args:
        config: the engine config.
        model_dir: a resolved HF-style model folder.
        engine_index: this engine core's data-parallel index.
        bound_waiting: refuse requests past --max-waiting-requests (the engine process);
            the offline `LLM` queues all of its prompts.
    """

    def __init__(
        self,
        config: EngineConfig,
        model_dir: str,
        engine_index: int = 0,
        *,
        bound_waiting: bool = False,
    ):
        start = time.perf_counter()
        self._offload_store: subprocess.Popen | None = None
        if config.cache.kv_offloading_size is not None:
            config = self._start_offload_tier(config, engine_index)
        _check_sleep_mode(config)
        if is_encoder_model(model_dir):
            config = encoder_engine_config(config, model_dir)
        self.config = config
        # Sleep mode: the level slept at (0: awake) and what wake_up has yet to restore.
        self.sleep_level = 0
        self.sleeping_tags: list[str] = []
        self.poison_token_id = FAULT_POISON_TOKEN_ID.get()  # tests only (shared/env.py)
        self.executor = make_executor(config, model_dir)
        num_blocks = self.executor.determine_num_blocks()
        (gemm_plan,) = self.executor.collective_rpc(
            "gemm_plan", ranks="driver", result_type=dict[str, str]
        )
        self.executor.initialize_kv_cache(num_blocks)
        self._init_scheduler(config, model_dir, num_blocks)
        self.kv_event_publisher = self._make_kv_event_publisher(config, engine_index)
        self.vocab_size = model_vocab_size(model_dir)
        self.bound_waiting = bound_waiting
        self.request_checker = RequestChecker(
            self.vocab_size,
            config.model.max_logprobs,
            self.scheduler.max_model_len,
            structured_outputs=True,
            lora_config=config.lora,
            speculative=config.speculative_config is not None,
            pooling_only=is_encoder_model(model_dir),
        )
        self.ready = self._make_ready(config, engine_index, num_blocks, gemm_plan)
        logger.info(
            "engine core ready in %.1f s: %d KV blocks, max_model_len %d",
            time.perf_counter() - start,
            num_blocks,
            self.ready.max_model_len,
        )

    def _init_scheduler(self, config: EngineConfig, model_dir: str, num_blocks: int) -> None:
        """The scheduler over the bound KV cache, with what the workers learned at start-up
        (asked for by name, Executor.collective_rpc) and the grammar compiler."""
        (kv_cache_groups,) = self.executor.collective_rpc(
            "kv_cache_groups", ranks="driver", result_type=list[KVCacheGroupSpec]
        )
        # Every rank measures the step costs (their forwards run collectives), once the KV
        # cache is bound, so the steps run the path real ones take; the driver's figures count.
        step_costs = self.executor.collective_rpc(
            "measure_step_costs", result_type=list[tuple[int, float]]
        )[self.executor.driver_rank]
        (prompt_keys_per_token,) = self.executor.collective_rpc(
            "prompt_keys_per_token", ranks="driver", result_type=float
        )
        self.structured_output_manager = StructuredOutputManager(
            model_dir,
            config.model.tokenizer or model_dir,
            config.structured_outputs_config,
            config.scheduler.max_num_seqs,
        )
        self.scheduler = Scheduler(
            config.scheduler,
            config.cache,
            num_blocks,
            self.executor.max_model_len,
            features=SchedulerFeatures(
                structured_output_manager=self.structured_output_manager,
                lora_config=config.lora,
                speculative_config=config.speculative_config,
                step_costs=step_costs,
                prompt_keys_per_token=prompt_keys_per_token,
                kv_connector=self._make_kv_connector(config),
                kv_cache_groups=kv_cache_groups,
            ),
        )

    def _make_ready(
        self, config: EngineConfig, engine_index: int, num_blocks: int, gemm_plan: dict[str, str]
    ) -> EngineReady:
        """The READY message: what the api needs to know of this engine."""
        # The scheduler may cap max_model_len to what the KV cache holds.
        return EngineReady(
            engine_index=engine_index,
            num_blocks=num_blocks,
            max_model_len=self.scheduler.max_model_len,
            block_size=config.cache.block_size,
            hostname=this_hostname(),
            pid=os.getpid(),
            worker_pids=self.executor.worker_pids,
            enable_prefix_caching=config.cache.enable_prefix_caching,
            prefix_caching_hash_algo=config.cache.prefix_caching_hash_algo,
            max_logprobs=config.model.max_logprobs,
            max_waiting_requests=config.scheduler.max_waiting_requests,
            cache_config_info=cache_config_info(config.cache, num_blocks),
            gemm_plan=gemm_plan,
            kv_role=config.kv_transfer_config.kv_role if config.kv_transfer_config else None,
            enable_sleep_mode=config.model.enable_sleep_mode,
        )

    def _start_offload_tier(self, config: EngineConfig, engine_index: int) -> EngineConfig:
        """--kv-offloading-size: start this engine's own store and connect through the
        OffloadingConnector; its disk tier (--kv-offloading-disk-path) is a folder of this
        engine's own, since a store locks its folder and DP engines each start one."""
        from kvserve.services.kv_store.offload import start_offload_store

        if config.kv_transfer_config is not None:
            raise ValueError("use --kv-offloading-size or --kv-transfer-config, not both")
        cache = config.cache
        assert cache.kv_offloading_size is not None
        size = int(cache.kv_offloading_size * 2**30)
        disk_path = cache.kv_offloading_disk_path
        if disk_path is not None:
            disk_path = os.path.join(disk_path, f"engine-{engine_index}")
        self._offload_store, transfer = start_offload_store(
            size, disk_path, cache.kv_offloading_disk_bytes
        )
        return msgspec.structs.replace(config, kv_transfer_config=transfer)

    def _make_kv_connector(self, config: EngineConfig):
        if config.kv_transfer_config is None:
            return None
        from kvserve.services.kv_store.registry import make_scheduler_connector

        (fingerprint,) = self.executor.collective_rpc(
            "kv_fingerprint", ranks=[0], result_type=KvFingerprint | None
        )
        assert fingerprint is not None, "workers report their layout with a KV connector"
        logger.info(
            "KV connector %s (%s) for layout %s",
            config.kv_transfer_config.kv_connector,
            config.kv_transfer_config.kv_role,
            fingerprint,
        )
        return make_scheduler_connector(
            config.kv_transfer_config, fingerprint, config.cache.block_size
        )

    def _make_kv_event_publisher(self, config: EngineConfig, engine_index: int):
        events_config = config.kv_events_config
        if events_config is None or not events_config.is_publishing:
            return None
        from kvserve.services.scheduler.engine.kv_event_publisher import KVEventPublisher

        self.scheduler.kv_cache_manager.enable_kv_events()
        return KVEventPublisher(events_config, engine_index)

    def _publish_kv_events(self) -> None:
        """This step's prefix-cache changes as one batch (none: nothing is sent)."""
        if self.kv_event_publisher is None:
            return
        events = self.scheduler.kv_cache_manager.take_events()
        if events:
            self.kv_event_publisher.publish(KVEventBatch(ts=time.time(), events=events))

    def add_request(self, request: EngineCoreRequest) -> None:
        """Queue a request, or refuse it with an ERROR output (in the next step's outputs):
        a bad one (request_checks), or, with bound_waiting, any past --max-waiting-requests."""
        error = self.request_checker.check(
            request, id_in_use=request.request_id in self.scheduler.requests
        )
        max_waiting = self.config.scheduler.max_waiting_requests
        if error is None and self.sleep_level:
            error = f"the engine is asleep (level {self.sleep_level}): POST /wake_up first"
        if error is None and self.bound_waiting and self.num_waiting_requests >= max_waiting:
            error = queue_full_error(max_waiting)
        if error is None:
            if (
                self.poison_token_id is not None
                and self.poison_token_id in request.prompt_token_ids
            ):
                logger.error(
                    "request %s is poison (test hook): killing this engine core", request.request_id
                )
                os.kill(os.getpid(), signal.SIGKILL)
            self.scheduler.add_request(request)
        else:
            self.scheduler.reject(request.request_id, error)

    @property
    def num_waiting_requests(self) -> int:
        return len(self.scheduler.waiting) + len(self.scheduler.waiting_for_grammar)

    def abort_requests(self, request_ids: list[str]) -> None:
        from kvserve.services.scheduler.core.request import RequestStatus

        self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)

    def has_work(self) -> bool:
        """True while a step is needed: running/waiting requests, or outputs to deliver."""
        return self.scheduler.has_requests()

    def step(self) -> EngineCoreOutputs:
        """Run one engine step; outputs of every request that advanced or ended."""
        if self.scheduler.only_waiting_for_grammars():
            self.structured_output_manager.wait_any(
                self.scheduler.pending_grammar_futures(), _GRAMMAR_WAIT_S
            )
        start = time.perf_counter()
        scheduler_output = self.scheduler.schedule()
        if scheduler_output.is_empty:
            runner_output = ModelRunnerOutput()  # nothing for the workers to do or drop
        else:
            runner_output = self.executor.execute_model(scheduler_output)
        outputs = self.scheduler.update_from_output(scheduler_output, runner_output)
        self.scheduler.record_step_time(scheduler_output, time.perf_counter() - start)
        self._publish_kv_events()
        return EngineCoreOutputs(
            outputs=outputs, scheduler_stats=self.scheduler.make_stats(), timestamp=time.monotonic()
        )

    def reset_prefix_cache(self) -> bool:
        reset = self.scheduler.reset_prefix_cache()
        self._publish_kv_events()
        return reset

    # ------------------------------------------------ sleep mode (--enable-sleep-mode)

    def sleep(self, level: int) -> bool:
        """Free the KV cache (level 1; on CUDA the weights move to pinned host memory) or
        the KV cache and the weights (level 2) on every worker, once no request is in flight:
        False (nothing freed) while one is. The block pool is reset (every block free, no
        cached prefix), so waking starts from an empty cache."""
        self._check_sleep_enabled()
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 or 2, got {level}")
        if self.sleep_level:
            logger.info("engine core already asleep at level %d", self.sleep_level)
            return True
        if self.scheduler.get_num_unfinished_requests():
            return False
        if not self.scheduler.reset_prefix_cache():
            return False
        # Every rank frees its own shard (no collective runs: any order is fine).
        freed = self.executor.collective_rpc("sleep", (level,), result_type=int)
        self.sleep_level = level
        self.sleeping_tags = list(SLEEP_TAGS)
        logger.info(
            "engine core asleep at level %d: %.1f MiB freed over %d workers",
            level,
            sum(freed) / 2**20,
            len(freed),
        )
        return True

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Restore what sleep freed on every worker: `tags` among "weights" and "kv_cache"
        (None: both; the weights first). Serving resumes once both are back."""
        self._check_sleep_enabled()
        woken = [tag for tag in check_sleep_tags(tags) if tag in self.sleeping_tags]
        if not woken:
            return
        if woken == [SLEEP_KV_CACHE] and SLEEP_WEIGHTS in self.sleeping_tags:
            raise ValueError("wake the weights before the KV cache (tags=weights)")
        start = time.perf_counter()
        # A forward may run (the CUDA graph capture, the CPU measurements): every rank.
        self.executor.collective_rpc("wake_up", (woken,))
        self.sleeping_tags = [tag for tag in self.sleeping_tags if tag not in woken]
        if not self.sleeping_tags:
            self.sleep_level = 0
        logger.info(
            "engine core woke %s in %.1f s%s",
            " and ".join(woken),
            time.perf_counter() - start,
            "" if self.sleep_level else ": serving",
        )

    def _check_sleep_enabled(self) -> None:
        if not self.config.model.enable_sleep_mode:
            raise RuntimeError("sleep mode is off: start the engine with --enable-sleep-mode")

    def shutdown(self) -> None:
        if self.kv_event_publisher is not None:
            self.kv_event_publisher.shutdown()
        self.structured_output_manager.shutdown()
        self.executor.shutdown()
        if self.scheduler.kv_connector is not None:
            self.scheduler.kv_connector.close()
        if self._offload_store is not None:
            from kvserve.services.kv_store.offload import stop_offload_store

            stop_offload_store(self._offload_store)
