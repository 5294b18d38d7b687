"""Engine configuration: one frozen struct per area, composed into `EngineConfig`.

Every field carries a description (msgspec.Meta) that the CLI turns into its --help text.
Facts learned at start-up (number of KV blocks, the effective max_model_len) never patch these
structs: they travel in the engine's ready message.
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

GiB = 1 << 30
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


def _doc(text: str) -> msgspec.Meta:
    return msgspec.Meta(description=text)


class ModelConfig(msgspec.Struct, frozen=True, kw_only=True):
    model: Annotated[str | None, _doc(
        "HF folder, GGUF file, or None for the embedded SmolLM2-135M-Instruct")] = None
    tokenizer: Annotated[str | None, _doc("tokenizer folder (default: the model's)")] = None
    dtype: Annotated[Literal["auto", "float32", "bfloat16", "float16"], _doc(
        "weight and activation dtype; auto = float32 on CPU, bfloat16 on GPU")] = "auto"
    max_model_len: Annotated[int | None, _doc(
        "longest prompt + output in tokens (default: the model's context length)")] = None
    seed: Annotated[int, _doc("seed of the engine's random state")] = 0
    served_model_name: Annotated[str | None, _doc("model name the API reports")] = None

    @property
    def served_name(self) -> str:
        """--served-model-name, else the MODEL argument, else the embedded model's name."""
        return self.served_model_name or self.model or DEFAULT_MODEL_NAME


class CacheConfig(msgspec.Struct, frozen=True, kw_only=True):
    block_size: Annotated[int, _doc("tokens per KV-cache block")] = 16
    enable_prefix_caching: Annotated[bool, _doc("reuse KV blocks of shared prefixes")] = True
    prefix_caching_hash_algo: Annotated[Literal["sha256", "xxhash"], _doc(
        "block hash: sha256 or a fast 128-bit xxhash")] = "sha256"
    kv_cache_memory: Annotated[int | None, _doc(
        "bytes for the KV cache on CPU (default 4 GiB)")] = None
    gpu_memory_utilization: Annotated[float, _doc(
        "fraction of GPU memory for weights, activations and KV cache")] = 0.9
    num_gpu_blocks_override: Annotated[int | None, _doc(
        "force the number of KV blocks (testing)")] = None

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")

    @property
    def kv_cache_bytes(self) -> int:
        return self.kv_cache_memory if self.kv_cache_memory is not None else 4 * GiB


class SchedulerConfig(msgspec.Struct, frozen=True, kw_only=True):
    max_num_batched_tokens: Annotated[int, _doc("token budget of one engine step")] = 2048
    max_num_seqs: Annotated[int, _doc("requests in one engine step at most")] = 256
    enable_chunked_prefill: Annotated[bool, _doc(
        "split long prompts across steps")] = True
    long_prefill_token_threshold: Annotated[int, _doc(
        "cap on one request's prompt tokens per step (0 = none)")] = 0
    scheduling_policy: Annotated[Literal["fcfs", "priority"], _doc(
        "fcfs, or priority (lower value first, then arrival)")] = "fcfs"

    def __post_init__(self) -> None:
        if self.max_num_batched_tokens < 1:
            raise ValueError("max_num_batched_tokens must be positive")
        if self.max_num_seqs < 1:
            raise ValueError("max_num_seqs must be positive")


class ParallelConfig(msgspec.Struct, frozen=True, kw_only=True):
    tensor_parallel_size: Annotated[int, _doc("tensor-parallel ranks")] = 1
    pipeline_parallel_size: Annotated[int, _doc("pipeline-parallel stages")] = 1
    data_parallel_size: Annotated[int, _doc("data-parallel engine cores")] = 1
    distributed_executor_backend: Annotated[Literal["uni", "mp"] | None, _doc(
        "uni: worker in the engine process; mp: one process per rank "
        "(default: uni when TP x PP = 1)")] = None
    master_addr: Annotated[str, _doc(
        "address the TP/PP worker ranks rendezvous at (torch.distributed TCP store)")] = \
        "127.0.0.1"
    master_port: Annotated[int | None, _doc(
        "port of that rendezvous (default: a free port picked at start-up)")] = None

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def executor(self) -> str:
        if self.distributed_executor_backend is not None:
            return self.distributed_executor_backend
        return "uni" if self.world_size == 1 else "mp"


class EngineConfig(msgspec.Struct, frozen=True, kw_only=True):
    model: ModelConfig = msgspec.field(default_factory=ModelConfig)
    cache: CacheConfig = msgspec.field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = msgspec.field(default_factory=SchedulerConfig)
    parallel: ParallelConfig = msgspec.field(default_factory=ParallelConfig)


def field_descriptions(struct_type: type) -> dict[str, str]:
    """Map each field of a config struct to its description (for CLI help)."""
    out = {}
    for f in msgspec.inspect.type_info(struct_type).fields:
        schema = getattr(f.type, "extra_json_schema", None) or {}
        out[f.name] = schema.get("description", "")
    return out
