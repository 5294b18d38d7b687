"""A real engine-core process, spawned as `kvserve serve` spawns it, and its client."""

from __future__ import annotations

from kvserve.launch.engines import EngineLaunch, start_engine_process
from kvserve.services.api.engine_client.mp_client import EngineChannel, MPEngineClient
from kvserve.services.api.serving.tokenizer import TokenizerInfo
from kvserve.shared.config import CacheConfig, EngineConfig, ParallelConfig
from kvserve.shared.transport import EngineAddresses
from tests.support.models import TINY_KV_CACHE_MEMORY

ENGINE_READY_TIMEOUT_S = 300  # torch import + model load on a loaded 2-core machine


async def start_engine(
    model_dir: str, tokenizer_info: TokenizerInfo, executor: str = "uni"
) -> tuple[MPEngineClient, object]:
    """(connected MPEngineClient, engine process) over model_dir with a tiny KV cache.

    Args:
        model_dir: a small model folder (tests.support.models.build_tiny_llama).
        tokenizer_info: the api side's tokenizer of that model.
        executor: "uni" (the model in the engine process) or "mp" (a worker process).
    """
    config = EngineConfig(
        cache=CacheConfig(kv_cache_memory_bytes=TINY_KV_CACHE_MEMORY),
        parallel=ParallelConfig(distributed_executor_backend=executor),
    )
    channel = EngineChannel(EngineAddresses.local())
    process = start_engine_process(
        config, EngineLaunch(model_dir=model_dir, addresses=channel.addresses)
    )
    try:
        client = await MPEngineClient.connect(
            channel, tokenizer_info, "tiny", process, ready_timeout_s=ENGINE_READY_TIMEOUT_S
        )
    except BaseException:
        channel.close()
        process.kill()
        process.join()
        raise
    return client, process
