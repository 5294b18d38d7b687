"""The engine's typed configuration: one frozen struct per area, composed into EngineConfig.

ModelConfig, CacheConfig, SchedulerConfig, ParallelConfig, LoRAConfig,
StructuredOutputsConfig, SpeculativeConfig and KVTransferConfig make up EngineConfig: what
`LLM(**kwargs)` and every engine process take. The api process's options are in
shared/api_config.py, what each command launches (data parallelism, P/D, sockets) in
shared/launch_options.py, and the vLLM flags kvserve refuses in shared/refused_flags.py.

Every field carries a description (`flag_doc`) that shared/cli_args.py turns into the flag's
--help text: each command's flags are generated from its options struct. Facts learned at
start-up (number of KV blocks, the effective max_model_len) never patch these structs: they
travel in the engine's ready message.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, get_args

import msgspec

from kvserve.shared.cli_args import flag_doc
from kvserve.shared.parser_names import REASONING_PARSER_NAMES
from kvserve.shared.spec_config import SpeculativeConfig

GiB = 1 << 30
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


class ModelConfig(msgspec.Struct, frozen=True, kw_only=True):
    """The model and its numerics."""

    model: Annotated[
        str | None, flag_doc("HF folder, GGUF file, or None for the embedded SmolLM2-135M-Instruct")
    ] = None
    tokenizer: Annotated[str | None, flag_doc("tokenizer folder (default: the model's)")] = None
    dtype: Annotated[
        Literal["auto", "float32", "float", "bfloat16", "float16", "half"],
        flag_doc(
            "weight and activation dtype (half = float16, float = float32); auto = the "
            "checkpoint's dtype, float32 when it names none (on a GPU bfloat16 for a float32 "
            "checkpoint; on a CPU bfloat16 for a float16 one)"
        ),
    ] = "auto"
    max_model_len: Annotated[
        int | None,
        flag_doc(
            "longest prompt + output in tokens, e.g. 32k = 32000, 32K = 32768 (default: the "
            "model's context length)",
            parse="tokens",
        ),
    ] = None
    seed: Annotated[int, flag_doc("seed of the engine's random state")] = 0
    served_model_name: Annotated[str | None, flag_doc("model name the API reports")] = None
    max_logprobs: Annotated[
        int, flag_doc("most logprobs (and prompt_logprobs) a request may ask for per token")
    ] = 20
    enforce_eager: Annotated[
        bool,
        flag_doc(
            "capture no CUDA graphs: every step runs eagerly (on a GPU, pure-decode steps "
            "otherwise replay a graph captured at start-up; a CPU always runs eagerly)"
        ),
    ] = False
    enable_sleep_mode: Annotated[
        bool,
        flag_doc(
            "serve POST /sleep?level=1|2, POST /wake_up and GET /is_sleeping (vLLM's routes): "
            "free the KV cache (and the weights at level 2) between jobs"
        ),
    ] = False
    cuda_graph_sizes: Annotated[
        list[int] | None,
        flag_doc(
            "decode batch sizes to capture a CUDA graph for, e.g. 1 2 4 8 (a decode step is "
            "padded to the nearest captured size); default: 1 2 4 and every multiple of 8 up "
            "to 256, capped at max_num_seqs; an empty list captures none"
        ),
    ] = None
    cpu_gemm: Annotated[
        Literal["auto", "torch", "onednn", "native", "widened"],
        flag_doc(
            "GEMM path of the linear layers on CPU: auto times torch's (MKL), oneDNN's with "
            "a prepacked weight, kvserve's native GEMV and (bfloat16) the widened path, "
            "bfloat16 weights computed in float32, for each layer shape at start-up "
            "(cached per machine) and keeps the fastest per row count"
        ),
    ] = "auto"
    quantization: Annotated[
        Literal["gguf", "int8", "mxfp4", "none", "awq", "gptq", "compressed-tensors", "fp8"] | None,
        flag_doc(
            "weights held quantized: gguf keeps a .gguf file's Q8_0/Q4_0/Q4_1/Q4_K blocks "
            "(other types expand to float), int8 quantizes a float checkpoint per output "
            "channel at load, mxfp4 keeps an MXFP4 checkpoint's MoE expert blocks (gpt-oss), "
            "compressed-tensors and fp8 read an 8-bit checkpoint (int8 W8A8 held as stored, "
            "FP8 expanded to float at load); awq, gptq and compressed-tensors read a 4-bit "
            "checkpoint (AWQ GEMM, GPTQ, W4A16 pack-quantized) as stored; "
            "none expands whatever the checkpoint holds to float; default: a checkpoint's "
            "config.json quantization_config, else none (a .gguf file expands to float32)",
            aliases=["-q"],
        ),
    ] = None
    trust_remote_code: Annotated[
        bool,
        flag_doc("accepted for vLLM's scripts: kvserve never runs a checkpoint's own code"),
    ] = False

    def __post_init__(self) -> None:
        if self.max_logprobs < 0:
            raise ValueError(f"max_logprobs must be >= 0, got {self.max_logprobs}")
        if self.cuda_graph_sizes is not None and any(n < 1 for n in self.cuda_graph_sizes):
            raise ValueError(f"cuda_graph_sizes must be positive, got {self.cuda_graph_sizes}")

    @property
    def dtype_name(self) -> str:
        """dtype with vLLM's aliases spelled out (half -> float16, float -> float32)."""
        return {"half": "float16", "float": "float32"}.get(self.dtype, self.dtype)

    @property
    def served_name(self) -> str:
        """--served-model-name, else the MODEL argument, else the embedded model's name."""
        return self.served_model_name or self.model or DEFAULT_MODEL_NAME


# --kv-cache-dtype's values (vLLM's names; fp8 is fp8_e4m3).
KvCacheDtype = Literal["auto", "fp8", "fp8_e4m3", "fp8_e5m2"]


class CacheConfig(msgspec.Struct, frozen=True, kw_only=True):
    """The paged KV cache."""

    block_size: Annotated[int, flag_doc("tokens per KV-cache block")] = 16
    enable_prefix_caching: Annotated[bool, flag_doc("reuse KV blocks of shared prefixes")] = True
    prefix_caching_hash_algo: Annotated[
        Literal["sha256", "xxhash"], flag_doc("block hash: sha256 or a fast 128-bit xxhash")
    ] = "sha256"
    kv_cache_memory_bytes: Annotated[
        int | None,
        flag_doc(
            "bytes for the KV cache, e.g. 4G (on CPU, default 4 GiB; on a GPU it replaces "
            "--gpu-memory-utilization)",
            parse="size",
            aliases=["--kv-cache-memory"],
        ),
    ] = None
    gpu_memory_utilization: Annotated[
        float,
        flag_doc(
            "fraction of the GPU's whole memory for weights, activations and KV cache (the KV "
            "cache gets it less a profile run's peak)"
        ),
    ] = 0.9
    num_gpu_blocks_override: Annotated[
        int | None, flag_doc("force the number of KV blocks (testing)")
    ] = None
    kv_offloading_size: Annotated[
        float | None,
        flag_doc(
            "GiB of CPU memory for a KV offload tier: evicted prefix blocks go to a KV store "
            "of this size and load back on a later hit (the engine starts the store)"
        ),
    ] = None
    kv_offloading_backend: Annotated[
        Literal["native"], flag_doc("the offload tier's store: native (kvserve's kv-store)")
    ] = "native"
    kv_offloading_disk_path: Annotated[
        str | None,
        flag_doc(
            "folder of a disk tier under the offload store (its --disk-path; engine N uses "
            "DIR/engine-N): evicted blocks spill there, pinned ones outlive a restart"
        ),
    ] = None
    kv_offloading_disk_bytes: Annotated[
        int,
        flag_doc("bytes of block files each offload store's disk tier holds at most", parse="size"),
    ] = 16 * GiB
    cache_dtype: Annotated[
        KvCacheDtype,
        flag_doc(
            "KV cache dtype: auto (the model's) or 8-bit floats with a per-layer scale for K and "
            "for V, the checkpoint's or 1.0 (fp8 = fp8_e4m3; fp8_e5m2)",
            aliases=["--kv-cache-dtype"],
        ),
    ] = "auto"
    max_pinned_cache_fraction: Annotated[float, flag_doc("prompt pins' KV share (0..1)")] = 0.5

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if self.cache_dtype not in get_args(KvCacheDtype):
            raise ValueError(
                f"kv_cache_dtype {self.cache_dtype!r} is not one of {list(get_args(KvCacheDtype))}"
            )
        if self.kv_offloading_size is not None and self.kv_offloading_size <= 0:
            raise ValueError(f"kv_offloading_size must be positive, got {self.kv_offloading_size}")
        if self.kv_offloading_disk_path is not None and self.kv_offloading_size is None:
            raise ValueError("--kv-offloading-disk-path needs --kv-offloading-size")
        if self.kv_offloading_disk_bytes <= 0:
            raise ValueError(
                f"kv_offloading_disk_bytes must be positive, got {self.kv_offloading_disk_bytes}"
            )

    @property
    def kv_cache_bytes(self) -> int:
        return self.kv_cache_memory_bytes if self.kv_cache_memory_bytes is not None else 4 * GiB


class SchedulerConfig(msgspec.Struct, frozen=True, kw_only=True):
    """Continuous batching: what one engine step may hold."""

    max_num_batched_tokens: Annotated[int, flag_doc("token budget of one engine step")] = 2048
    max_num_seqs: Annotated[int, flag_doc("requests in one engine step at most")] = 256
    enable_chunked_prefill: Annotated[bool, flag_doc("split long prompts across steps")] = True
    long_prefill_token_threshold: Annotated[
        int, flag_doc("cap on one request's prompt tokens per step (0 = none)")
    ] = 0
    scheduling_policy: Annotated[
        Literal["fcfs", "priority", "fair"],
        flag_doc(
            "fcfs; priority (lower value first, then arrival); or fair (tenants served by "
            "their weighted token counters, priority inside a tenant)"
        ),
    ] = "fcfs"
    max_waiting_requests: Annotated[
        int,
        flag_doc(
            "requests one engine core queues at most (n > 1 counts n); past it the api "
            "answers 429 with Retry-After and the engine refuses the request"
        ),
    ] = 4096
    max_num_encoder_input_tokens: Annotated[
        int,
        flag_doc(
            "image tokens the vision encoder may compute in one engine step, and the "
            "encoder outputs kept until their tokens are computed (0 = "
            "max_num_batched_tokens); an image larger than it runs alone in its step"
        ),
    ] = 0
    slo_ttft_ms: Annotated[
        float | None,
        flag_doc(
            "default time-to-first-token target in ms of a request that names none (its "
            "tenant's or its own win): waiting requests go earliest deadline first and a "
            "waiting target's prompt is kept room in the next step (none: no target)"
        ),
    ] = None
    slo_tpot_ms: Annotated[
        float | None,
        flag_doc(
            "default time-per-output-token target in ms of a request that names none: while "
            "a running request has one, a step holds only the tokens whose predicted time "
            "fits the tightest (none: no target, steps of max_num_batched_tokens)"
        ),
    ] = None
    slo_aging_ms: Annotated[
        float,
        flag_doc(
            "with latency targets, a waiting request without a TTFT target counts as due "
            "this long after its arrival, so targeted requests cannot starve it; past it, "
            "its prompt may use the time the decodes banked under their TPOT targets"
        ),
    ] = 5000.0
    slo_step_timing: Annotated[
        bool,
        flag_doc(
            "time a few prompt steps at start-up (about a second for a 135M model on a "
            "CPU), so the latency targets size the first steps from this machine's "
            "figures instead of a GPU's guess; on by itself with --slo-ttft-ms, "
            "--slo-tpot-ms, or a key file whose lines set slo_ttft_ms= or slo_tpot_ms="
        ),
    ] = False

    @property
    def expects_targets(self) -> bool:
        """Whether latency targets are configured for this engine (its defaults or a key
        file's, slo_step_timing): the workers then time prompt steps at start-up."""
        return self.slo_step_timing or self.slo_ttft_ms is not None or self.slo_tpot_ms is not None

    @property
    def encoder_token_budget(self) -> int:
        return self.max_num_encoder_input_tokens or self.max_num_batched_tokens

    def __post_init__(self) -> None:
        if self.max_num_encoder_input_tokens < 0:
            raise ValueError("max_num_encoder_input_tokens must be 0 or positive")
        if self.max_num_batched_tokens < 1:
            raise ValueError("max_num_batched_tokens must be positive")
        if self.max_num_seqs < 1:
            raise ValueError("max_num_seqs must be positive")
        if self.max_waiting_requests < 1:
            raise ValueError("max_waiting_requests must be positive")
        for name in ("slo_ttft_ms", "slo_tpot_ms", "slo_aging_ms"):
            value = getattr(self, name)
            if value is not None and not value > 0:  # not NaN either
                raise ValueError(f"{name} must be a positive number of ms, got {value}")


class ParallelConfig(msgspec.Struct, frozen=True, kw_only=True):
    """Tensor, pipeline and data parallelism."""

    tensor_parallel_size: Annotated[int, flag_doc("tensor-parallel ranks", aliases=["-tp"])] = 1
    pipeline_parallel_size: Annotated[
        int, flag_doc("pipeline-parallel stages", aliases=["-pp"])
    ] = 1
    data_parallel_size: Annotated[int, flag_doc("data-parallel engine cores", aliases=["-dp"])] = 1
    distributed_executor_backend: Annotated[
        Literal["uni", "mp", "ray"] | None,
        flag_doc(
            "uni: worker in the engine process; mp: one process per rank; ray: one Ray actor "
            "per rank on a running Ray cluster, across nodes (`pip install kvserve[ray]`, "
            "`ray start`) (default: uni when TP x PP = 1, else mp)",
            aliases=["--executor"],
        ),
    ] = None
    ray_placement_strategy: Annotated[
        Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"],
        flag_doc(
            "ray executor: how the placement group lays the ranks' bundles over the nodes "
            "(PACK: as few nodes as fit; SPREAD: as many as possible)"
        ),
    ] = "PACK"
    master_addr: Annotated[
        str,
        flag_doc(
            "address the TP/PP worker ranks rendezvous at (torch.distributed TCP store; the "
            "ray executor uses the address of rank 0's node instead)"
        ),
    ] = "127.0.0.1"
    master_port: Annotated[
        int | None, flag_doc("port of that rendezvous (default: a free port picked at start-up)")
    ] = None
    disable_custom_all_reduce: Annotated[
        bool,
        flag_doc("accepted for vLLM's scripts: kvserve's all-reduce is torch.distributed's own"),
    ] = False

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def executor(self) -> str:
        if self.distributed_executor_backend is not None:
            return self.distributed_executor_backend
        return "uni" if self.world_size == 1 else "mp"


class StructuredOutputsConfig(msgspec.Struct, frozen=True, kw_only=True):
    """Structured outputs (vLLM's --structured-outputs-config): grammars compile with
    xgrammar in the engine core.

    Args:
        backend: auto or xgrammar (the one backend; vLLM's others are refused).
        disable_any_whitespace: JSON outputs without optional whitespace, for every request.
        disable_additional_properties: accepted: xgrammar never emits unlisted properties.
        disable_fallback: accepted: there is no other backend to fall back to.
        reasoning_parser: accepted empty or naming a known parser (REASONING_PARSER_NAMES):
            the api's --reasoning-parser splits the thinking and tells the engine, per
            request, the tokens that end it (after which the grammar applies).
    """

    backend: str = "auto"
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    disable_fallback: bool = False
    reasoning_parser: str = ""

    def __post_init__(self) -> None:
        if self.backend not in ("auto", "xgrammar"):
            raise ValueError(
                f"structured outputs backend {self.backend!r} is not supported: kvserve "
                f"compiles grammars with xgrammar (backend auto or xgrammar)"
            )
        if self.reasoning_parser and self.reasoning_parser not in REASONING_PARSER_NAMES:
            raise ValueError(
                f"reasoning_parser {self.reasoning_parser!r} is not one of "
                f"{', '.join(REASONING_PARSER_NAMES)}"
            )


KVConnectorName = Literal["KvStoreConnector", "SharedStorageConnector", "OffloadingConnector"]
KVRole = Literal["kv_producer", "kv_consumer", "kv_both"]


class KVTransferConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """KV transfer between engines and the KV-cache store (vLLM's --kv-transfer-config).

    Args:
        kv_connector: KvStoreConnector (the `kvserve kv-store` service), SharedStorageConnector
            (blocks as files in a folder, for debugging) or OffloadingConnector (a store used
            as a CPU tier for blocks the engine's prefix cache evicts).
        kv_role: kv_producer saves the full blocks it computes, kv_consumer loads the
            blocks the store holds before computing, kv_both does both.
        kv_connector_extra_config: the connector's own settings: `store_address` (the
            store's ipc:// or tcp:// address) and `timeout_s` for KvStoreConnector and
            OffloadingConnector, `shared_storage_path` for SharedStorageConnector.
    """

    kv_connector: KVConnectorName
    kv_role: KVRole = "kv_both"
    kv_connector_extra_config: dict[str, Any] = {}

    def __post_init__(self) -> None:
        extra = self.kv_connector_extra_config
        if self.kv_connector == "SharedStorageConnector":
            if not extra.get("shared_storage_path"):
                raise ValueError("SharedStorageConnector needs shared_storage_path")
        elif not extra.get("store_address"):
            raise ValueError(f"{self.kv_connector} needs store_address (the kv-store's address)")

    @property
    def store_address(self) -> str | None:
        """The KV store's ipc:// or tcp:// address (None for SharedStorageConnector)."""
        address = self.kv_connector_extra_config.get("store_address")
        return None if address is None else str(address)

    @property
    def is_producer(self) -> bool:
        return self.kv_role in ("kv_producer", "kv_both")

    @property
    def is_consumer(self) -> bool:
        return self.kv_role in ("kv_consumer", "kv_both")


class KVEventsConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """KV cache events for external routers (vLLM's --kv-events-config, same fields).

    Args:
        enable_kv_cache_events: publish at all (off: no events are even collected).
        publisher: "zmq" (a PUB socket plus an optional replay ROUTER) or "null" (none).
        endpoint: the PUB address; a wildcard (tcp://*:PORT), ipc:// or inproc:// binds,
            any other tcp:// connects. Engine i of data parallelism uses PORT + i.
        replay_endpoint: a ROUTER address (always bound) where a subscriber sends an
            8-byte big-endian sequence number and gets every buffered batch from it.
        buffer_steps: batches kept for replay.
        hwm: the PUB socket's send high-water mark (messages).
        max_queue_size: batches waiting for the publisher thread at most.
        topic: the first frame of every message.
    """

    enable_kv_cache_events: bool = False
    publisher: Literal["zmq", "null"] = "null"
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""

    def __post_init__(self) -> None:
        for name in ("buffer_steps", "hwm", "max_queue_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"kv_events_config.{name} must be >= 1")
        for addr in (self.endpoint, self.replay_endpoint):
            if addr is not None and not addr.startswith(("tcp://", "ipc://", "inproc://")):
                raise ValueError(
                    f"kv_events_config address {addr!r}: use tcp://, ipc:// or inproc://"
                )

    @property
    def is_publishing(self) -> bool:
        return self.enable_kv_cache_events and self.publisher == "zmq"


class LoRAConfig(msgspec.Struct, frozen=True, kw_only=True):
    """LoRA adapters: many in one batch, each request with its own (or none)."""

    enable_lora: Annotated[
        bool, flag_doc("serve LoRA adapters (PEFT folders) beside the model")
    ] = False
    max_loras: Annotated[
        int,
        flag_doc(
            "distinct adapters in one batch at most (the worker's adapter slots); requests "
            "for others wait"
        ),
    ] = 1
    max_lora_rank: Annotated[int, flag_doc("highest adapter rank (slots are padded to it)")] = 16
    max_cpu_loras: Annotated[
        int | None,
        flag_doc("adapters kept in host memory, least recently used out (default: max_loras)"),
    ] = None

    def __post_init__(self) -> None:
        if self.max_loras < 1:
            raise ValueError(f"max_loras must be >= 1, got {self.max_loras}")
        if self.max_lora_rank < 1:
            raise ValueError(f"max_lora_rank must be >= 1, got {self.max_lora_rank}")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(
                f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras ({self.max_loras})"
            )

    @property
    def cpu_cache_size(self) -> int:
        return self.max_cpu_loras if self.max_cpu_loras is not None else self.max_loras


class EngineConfig(msgspec.Struct, frozen=True, kw_only=True):
    """One engine core's whole configuration."""

    model: ModelConfig = msgspec.field(default_factory=ModelConfig)
    cache: CacheConfig = msgspec.field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = msgspec.field(default_factory=SchedulerConfig)
    parallel: ParallelConfig = msgspec.field(default_factory=ParallelConfig)
    lora: LoRAConfig = msgspec.field(default_factory=LoRAConfig)
    structured_outputs_config: Annotated[
        StructuredOutputsConfig,
        flag_doc(
            'structured outputs, as JSON: {"backend": "xgrammar", "disable_any_whitespace": false}',
            parse="json",
        ),
    ] = msgspec.field(default_factory=StructuredOutputsConfig)
    speculative_config: Annotated[
        SpeculativeConfig | None,
        flag_doc(
            'speculative decoding, as JSON: {"method": "ngram", "num_speculative_tokens": 4, '
            '"prompt_lookup_min": 2, "prompt_lookup_max": 4} (methods: ngram, draft_model, '
            "medusa)",
            parse="json",
        ),
    ] = None
    kv_transfer_config: Annotated[
        KVTransferConfig | None,
        flag_doc(
            'KV transfer, as JSON: {"kv_connector": "KvStoreConnector", "kv_role": '
            '"kv_consumer", "kv_connector_extra_config": {"store_address": "ipc:///tmp/kv"}} '
            "(connectors: KvStoreConnector, SharedStorageConnector, OffloadingConnector)",
            parse="json",
        ),
    ] = None
    kv_events_config: Annotated[
        KVEventsConfig | None,
        flag_doc(
            'KV cache events for external routers, as JSON: {"enable_kv_cache_events": true, '
            '"publisher": "zmq", "endpoint": "tcp://*:5557", "replay_endpoint": '
            '"tcp://*:5558", "topic": ""} (vLLM\'s wire format; engine i uses PORT + i)',
            parse="json",
        ),
    ] = None

    def __post_init__(self) -> None:
        events = self.kv_events_config
        if events is not None and events.is_publishing and not self.cache.enable_prefix_caching:
            raise ValueError(
                "--kv-events-config reports the prefix cache's blocks: it needs prefix caching "
                "(drop --no-enable-prefix-caching)"
            )

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> EngineConfig:
        """Split vLLM-style keyword arguments (`LLM(model, dtype=..., max_num_seqs=...)`)
        over the area structs; an unknown one is a ValueError that lists the known ones.
        `structured_outputs_config` may be a StructuredOutputsConfig or a dict of its fields."""
        areas = {
            name: _ENGINE_AREAS[name] for name in cls.__struct_fields__ if name in _ENGINE_AREAS
        }
        kwargs = {_RENAMED_KWARGS.get(key, key): value for key, value in kwargs.items()}
        whole: dict[str, Any] = {}
        if "structured_outputs_config" in kwargs:
            value = kwargs.pop("structured_outputs_config")
            if isinstance(value, dict):
                value = StructuredOutputsConfig(**value)
            whole["structured_outputs_config"] = value
        if "speculative_config" in kwargs:
            spec = kwargs.pop("speculative_config")
            if isinstance(spec, dict):
                spec = msgspec.convert(spec, SpeculativeConfig)
            whole["speculative_config"] = spec
        if "kv_events_config" in kwargs:
            events = kwargs.pop("kv_events_config")
            if isinstance(events, dict):
                events = msgspec.convert(events, KVEventsConfig)
            whole["kv_events_config"] = events
        if "kv_transfer_config" in kwargs:
            transfer = kwargs.pop("kv_transfer_config")
            if isinstance(transfer, dict):
                transfer = msgspec.convert(transfer, KVTransferConfig)
            whole["kv_transfer_config"] = transfer
        parts: dict[str, dict[str, Any]] = {name: {} for name in areas}
        for key, value in kwargs.items():
            owner = next(
                (name for name, area in areas.items() if key in area.__struct_fields__), None
            )
            if owner is None:
                known = sorted(f for area in areas.values() for f in area.__struct_fields__)
                raise ValueError(f"unknown engine argument {key!r}; known ones: {known}")
            parts[owner][key] = value
        # Each field gets the area struct of its own name, a pairing mypy cannot follow.
        area_structs: dict[str, Any] = {name: areas[name](**parts[name]) for name in areas}
        return cls(**area_structs, **whole)


# Engine arguments known by an older name too.
_RENAMED_KWARGS = {"kv_cache_memory": "kv_cache_memory_bytes", "kv_cache_dtype": "cache_dtype"}
_ENGINE_AREAS: dict[str, type[msgspec.Struct]] = {
    "model": ModelConfig,
    "cache": CacheConfig,
    "scheduler": SchedulerConfig,
    "parallel": ParallelConfig,
    "lora": LoRAConfig,
}
