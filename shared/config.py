"""Every typed option of kvserve: the engine's configuration and each process kind's launch
options, one frozen struct per area.

- Engine: ModelConfig, CacheConfig, SchedulerConfig, ParallelConfig and
  StructuredOutputsConfig, composed into EngineConfig (what `LLM(**kwargs)` and every engine
  process take).
- Launch: HTTPConfig, DataParallelConfig, EngineSockets, TransportConfig, composed into one
  options struct per process kind (ServeOptions, APIOptions, EngineOptions,
  CoordinatorOptions, KvStoreOptions, WorkerOptions, GenerateOptions).

Every field carries a description (msgspec.Meta) that shared/cli_args.py turns into the flag's
--help text: each command's flags are generated from its options struct. Facts learned at
start-up (number of KV blocks, the effective max_model_len) never patch these structs: they
travel in the engine's ready message.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec

from kvserve.shared.cli_args import RefusedFlag
from kvserve.shared.env import API_KEY, INSECURE_TRANSPORT, TRANSPORT_KEYS, VLLM_API_KEY
from kvserve.shared.lora import LoRAModulePath
from kvserve.shared.shm_ring import ShmRingHandle

GiB = 1 << 30
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


def _doc(text: str, **extra: Any) -> msgspec.Meta:
    """A field's description (its --help text); `extra` holds flag details (cli_args)."""
    return msgspec.Meta(description=text, extra=extra or None)


class ModelConfig(msgspec.Struct, frozen=True, kw_only=True):
    """The model and its numerics."""

    model: Annotated[
        str | None, _doc("HF folder, GGUF file, or None for the embedded SmolLM2-135M-Instruct")
    ] = None
    tokenizer: Annotated[str | None, _doc("tokenizer folder (default: the model's)")] = None
    dtype: Annotated[
        Literal["auto", "float32", "float", "bfloat16", "float16", "half"],
        _doc(
            "weight and activation dtype (half = float16, float = float32); auto = the "
            "checkpoint's dtype, float32 when it names none (on a GPU bfloat16 for a float32 "
            "checkpoint; on a CPU bfloat16 for a float16 one)"
        ),
    ] = "auto"
    max_model_len: Annotated[
        int | None,
        _doc(
            "longest prompt + output in tokens, e.g. 32k = 32000, 32K = 32768 (default: the "
            "model's context length)",
            parse="tokens",
        ),
    ] = None
    seed: Annotated[int, _doc("seed of the engine's random state")] = 0
    served_model_name: Annotated[str | None, _doc("model name the API reports")] = None
    max_logprobs: Annotated[
        int, _doc("most logprobs (and prompt_logprobs) a request may ask for per token")
    ] = 20
    enforce_eager: Annotated[
        bool,
        _doc(
            "capture no CUDA graphs: every step runs eagerly (on a GPU, pure-decode steps "
            "otherwise replay a graph captured at start-up; a CPU always runs eagerly)"
        ),
    ] = False
    cuda_graph_sizes: Annotated[
        list[int] | None,
        _doc(
            "decode batch sizes to capture a CUDA graph for, e.g. 1 2 4 8 (a decode step is "
            "padded to the nearest captured size); default: 1 2 4 and every multiple of 8 up "
            "to 256, capped at max_num_seqs; an empty list captures none"
        ),
    ] = None
    cpu_gemm: Annotated[
        Literal["auto", "torch", "onednn"],
        _doc(
            "GEMM path of the linear layers on CPU: auto times torch's (MKL) and oneDNN's with "
            "a prepacked weight for each layer shape at start-up (cached per machine) and "
            "keeps the faster per row count"
        ),
    ] = "auto"
    quantization: Annotated[
        Literal["gguf", "int8"] | None,
        _doc(
            "weights held quantized: gguf keeps a .gguf file's Q8_0/Q4_0/Q4_1/Q4_K blocks "
            "(other types expand to float), int8 quantizes a float checkpoint per output "
            "channel at load; default: a checkpoint's config.json quantization_config, else "
            "none (a .gguf file expands to float32)",
            aliases=["-q"],
        ),
    ] = None
    trust_remote_code: Annotated[
        bool,
        _doc("accepted for vLLM's scripts: kvserve never runs a checkpoint's own code"),
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


class CacheConfig(msgspec.Struct, frozen=True, kw_only=True):
    """The paged KV cache."""

    block_size: Annotated[int, _doc("tokens per KV-cache block")] = 16
    enable_prefix_caching: Annotated[bool, _doc("reuse KV blocks of shared prefixes")] = True
    prefix_caching_hash_algo: Annotated[
        Literal["sha256", "xxhash"], _doc("block hash: sha256 or a fast 128-bit xxhash")
    ] = "sha256"
    kv_cache_memory_bytes: Annotated[
        int | None,
        _doc(
            "bytes for the KV cache, e.g. 4G (on CPU, default 4 GiB; on a GPU it replaces "
            "--gpu-memory-utilization)",
            parse="size",
            aliases=["--kv-cache-memory"],
        ),
    ] = None
    gpu_memory_utilization: Annotated[
        float,
        _doc(
            "fraction of the GPU's whole memory for weights, activations and KV cache (the KV "
            "cache gets it less a profile run's peak)"
        ),
    ] = 0.9
    num_gpu_blocks_override: Annotated[
        int | None, _doc("force the number of KV blocks (testing)")
    ] = None
    kv_offloading_size: Annotated[
        float | None,
        _doc(
            "GiB of CPU memory for a KV offload tier: evicted prefix blocks go to a KV store "
            "of this size and load back on a later hit (the engine starts the store)"
        ),
    ] = None
    kv_offloading_backend: Annotated[
        Literal["native"], _doc("the offload tier's store: native (kvserve's kv-store)")
    ] = "native"

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if self.kv_offloading_size is not None and self.kv_offloading_size <= 0:
            raise ValueError(f"kv_offloading_size must be positive, got {self.kv_offloading_size}")

    @property
    def kv_cache_bytes(self) -> int:
        return self.kv_cache_memory_bytes if self.kv_cache_memory_bytes is not None else 4 * GiB


class SchedulerConfig(msgspec.Struct, frozen=True, kw_only=True):
    """Continuous batching: what one engine step may hold."""

    max_num_batched_tokens: Annotated[int, _doc("token budget of one engine step")] = 2048
    max_num_seqs: Annotated[int, _doc("requests in one engine step at most")] = 256
    enable_chunked_prefill: Annotated[bool, _doc("split long prompts across steps")] = True
    long_prefill_token_threshold: Annotated[
        int, _doc("cap on one request's prompt tokens per step (0 = none)")
    ] = 0
    scheduling_policy: Annotated[
        Literal["fcfs", "priority"], _doc("fcfs, or priority (lower value first, then arrival)")
    ] = "fcfs"
    max_waiting_requests: Annotated[
        int,
        _doc(
            "requests one engine core queues at most (n > 1 counts n); past it the api "
            "answers 429 with Retry-After and the engine refuses the request"
        ),
    ] = 4096

    def __post_init__(self) -> None:
        if self.max_num_batched_tokens < 1:
            raise ValueError("max_num_batched_tokens must be positive")
        if self.max_num_seqs < 1:
            raise ValueError("max_num_seqs must be positive")
        if self.max_waiting_requests < 1:
            raise ValueError("max_waiting_requests must be positive")


class ParallelConfig(msgspec.Struct, frozen=True, kw_only=True):
    """Tensor, pipeline and data parallelism."""

    tensor_parallel_size: Annotated[int, _doc("tensor-parallel ranks", aliases=["-tp"])] = 1
    pipeline_parallel_size: Annotated[int, _doc("pipeline-parallel stages", aliases=["-pp"])] = 1
    data_parallel_size: Annotated[int, _doc("data-parallel engine cores", aliases=["-dp"])] = 1
    distributed_executor_backend: Annotated[
        Literal["uni", "mp", "ray"] | None,
        _doc(
            "uni: worker in the engine process; mp: one process per rank; ray: one Ray actor "
            "per rank on a running Ray cluster, across nodes (`pip install kvserve[ray]`, "
            "`ray start`) (default: uni when TP x PP = 1, else mp)",
            aliases=["--executor"],
        ),
    ] = None
    ray_placement_strategy: Annotated[
        Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"],
        _doc(
            "ray executor: how the placement group lays the ranks' bundles over the nodes "
            "(PACK: as few nodes as fit; SPREAD: as many as possible)"
        ),
    ] = "PACK"
    master_addr: Annotated[
        str,
        _doc(
            "address the TP/PP worker ranks rendezvous at (torch.distributed TCP store; the "
            "ray executor uses the address of rank 0's node instead)"
        ),
    ] = "127.0.0.1"
    master_port: Annotated[
        int | None, _doc("port of that rendezvous (default: a free port picked at start-up)")
    ] = None
    disable_custom_all_reduce: Annotated[
        bool,
        _doc("accepted for vLLM's scripts: kvserve's all-reduce is torch.distributed's own"),
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
        reasoning_parser: must stay empty (reasoning parsers are not built).
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
        if self.reasoning_parser:
            raise ValueError("reasoning parsers are not built yet (reasoning_parser must be '')")


SpecMethod = Literal["ngram", "draft_model", "eagle", "medusa"]


class SpeculativeConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Speculative decoding (vLLM's --speculative-config / speculative_config).

    Args:
        method: ngram (prompt lookup over the request's own tokens), draft_model (a smaller
            model with the target's vocabulary, or the target's first num_draft_layers
            layers as a self-draft), eagle (EAGLE-1: one decoder layer over the target's
            hidden state and the next token) or medusa (residual heads over the last hidden
            state).
        num_speculative_tokens: drafts per step at most (k).
        prompt_lookup_min, prompt_lookup_max: ngram: the n-gram lengths matched, longest
            first.
        model: draft_model: the draft's folder or GGUF file (absent: the target itself,
            truncated to num_draft_layers); medusa: the heads' folder.
        num_draft_layers: draft_model: run only the draft's first L layers (then its final
            norm and LM head). Without `model` the draft shares the target's weights and
            KV cache, so it costs no memory and no extra prefill.
        disable_by_batch_size: no speculation in a step with at least this many running
            requests (vLLM's key); None: no such cap.
        adaptive: each request's k follows its measured acceptance, and speculation turns
            itself off when a batch is large enough that extra tokens are not free (the rule
            is in services/scheduler/core/spec_decode.py).
    """

    method: SpecMethod
    num_speculative_tokens: int
    prompt_lookup_min: int | None = None
    prompt_lookup_max: int | None = None
    model: str | None = None
    num_draft_layers: int | None = None
    disable_by_batch_size: int | None = None
    adaptive: bool = True

    def __post_init__(self) -> None:
        if not 1 <= self.num_speculative_tokens <= 16:
            raise ValueError(
                f"num_speculative_tokens must be in [1, 16], got {self.num_speculative_tokens}"
            )
        if self.method == "ngram":
            low, high = self.ngram_range
            if not 1 <= low <= high:
                raise ValueError(
                    f"ngram needs 1 <= prompt_lookup_min <= prompt_lookup_max, got {low}, {high}"
                )
        elif self.prompt_lookup_min is not None or self.prompt_lookup_max is not None:
            raise ValueError("prompt_lookup_min/max apply to the ngram method only")
        if self.method == "draft_model":
            if self.model is None and self.num_draft_layers is None:
                raise ValueError(
                    "draft_model needs a draft `model`, or `num_draft_layers` for a self-draft "
                    "made of the target's first layers"
                )
            if self.num_draft_layers is not None and self.num_draft_layers < 1:
                raise ValueError(f"num_draft_layers must be >= 1, got {self.num_draft_layers}")
        elif self.num_draft_layers is not None:
            raise ValueError("num_draft_layers applies to the draft_model method only")
        if self.method in ("medusa", "eagle") and self.model is None:
            raise ValueError(f"{self.method} needs `model`: the folder of the draft head")
        if self.method == "ngram" and self.model is not None:
            raise ValueError("the ngram method takes no model")

    @property
    def ngram_range(self) -> tuple[int, int]:
        """(prompt_lookup_min, prompt_lookup_max), each defaulting to the other (vLLM)."""
        low, high = self.prompt_lookup_min, self.prompt_lookup_max
        if low is None and high is None:
            return 5, 5  # vLLM's defaults
        return (low or high or 1), (high or low or 1)

    @property
    def uses_lookahead_slots(self) -> bool:
        """The proposer writes K/V past the verified tokens (a draft model's own steps), so
        the scheduler reserves num_speculative_tokens more slots per request."""
        return self.method in ("draft_model", "eagle")


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


class LoRAConfig(msgspec.Struct, frozen=True, kw_only=True):
    """LoRA adapters: many in one batch, each request with its own (or none)."""

    enable_lora: Annotated[bool, _doc("serve LoRA adapters (PEFT folders) beside the model")] = (
        False
    )
    max_loras: Annotated[
        int,
        _doc(
            "distinct adapters in one batch at most (the worker's adapter slots); requests "
            "for others wait"
        ),
    ] = 1
    max_lora_rank: Annotated[int, _doc("highest adapter rank (slots are padded to it)")] = 16
    max_cpu_loras: Annotated[
        int | None,
        _doc("adapters kept in host memory, least recently used out (default: max_loras)"),
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
        _doc(
            'structured outputs, as JSON: {"backend": "xgrammar", "disable_any_whitespace": false}',
            parse="json",
        ),
    ] = msgspec.field(default_factory=StructuredOutputsConfig)
    speculative_config: Annotated[
        SpeculativeConfig | None,
        _doc(
            'speculative decoding, as JSON: {"method": "ngram", "num_speculative_tokens": 4, '
            '"prompt_lookup_min": 2, "prompt_lookup_max": 4} (methods: ngram, draft_model, '
            "medusa)",
            parse="json",
        ),
    ] = None
    kv_transfer_config: Annotated[
        KVTransferConfig | None,
        _doc(
            'KV transfer, as JSON: {"kv_connector": "KvStoreConnector", "kv_role": '
            '"kv_consumer", "kv_connector_extra_config": {"store_address": "ipc:///tmp/kv"}} '
            "(connectors: KvStoreConnector, SharedStorageConnector, OffloadingConnector)",
            parse="json",
        ),
    ] = None

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
_RENAMED_KWARGS = {"kv_cache_memory": "kv_cache_memory_bytes"}
_ENGINE_AREAS: dict[str, type[msgspec.Struct]] = {
    "model": ModelConfig,
    "cache": CacheConfig,
    "scheduler": SchedulerConfig,
    "parallel": ParallelConfig,
    "lora": LoRAConfig,
}


# ---------------------------------------------------------------------- launch options

DPRouting = Literal["load", "prefix"]
DPRoutingOption = Annotated[
    DPRouting,
    _doc(
        "load: lowest 4 x waiting + running; prefix: prefer the engine holding the prompt's "
        "prefix blocks, within a load slack"
    ),
]


class HTTPConfig(msgspec.Struct, frozen=True, kw_only=True):
    """The HTTP server."""

    host: Annotated[str, _doc("interface to listen on")] = "0.0.0.0"
    port: Annotated[int, _doc("port to listen on")] = 8000
    api_key: Annotated[
        str | None,
        _doc(
            f"require this bearer token on /v1/* (default: ${API_KEY.name}, else "
            f"${VLLM_API_KEY.name})"
        ),
    ] = None
    api_key_file: Annotated[
        str | None,
        _doc(
            "a file of 'name:key' lines: each key is accepted on /v1/*, and its name shows in "
            "the request log and the kvserve:api_key_requests_total metric"
        ),
    ] = None
    shutdown_timeout: Annotated[
        float, _doc("seconds SIGTERM/SIGINT waits for in-flight requests")
    ] = 30.0
    uvicorn_log_level: Annotated[
        Literal["critical", "error", "warning", "info", "debug", "trace"],
        _doc("uvicorn's log level"),
    ] = "info"

    root_path: Annotated[
        str | None, _doc("the path prefix a proxy serves the app under (ASGI root_path)")
    ] = None
    ssl_keyfile: Annotated[str | None, _doc("TLS private key file (PEM); serve https")] = None
    ssl_certfile: Annotated[str | None, _doc("TLS certificate file (PEM)")] = None
    ssl_ca_certs: Annotated[str | None, _doc("CA certificates file for client certificates")] = None
    ssl_cert_reqs: Annotated[
        int, _doc("client certificates: 0 none, 1 optional, 2 required (Python's ssl module)")
    ] = 0
    allowed_origins: Annotated[list[str], _doc("CORS: allowed origins, as JSON", parse="json")] = (
        msgspec.field(default_factory=lambda: ["*"])
    )
    allow_credentials: Annotated[bool, _doc("CORS: allow credentials")] = False
    allowed_methods: Annotated[list[str], _doc("CORS: allowed methods, as JSON", parse="json")] = (
        msgspec.field(default_factory=lambda: ["*"])
    )
    allowed_headers: Annotated[list[str], _doc("CORS: allowed headers, as JSON", parse="json")] = (
        msgspec.field(default_factory=lambda: ["*"])
    )
    disable_uvicorn_access_log: Annotated[bool, _doc("no access log line per request")] = False

    def __post_init__(self) -> None:
        if (self.ssl_keyfile is None) != (self.ssl_certfile is None):
            raise ValueError("TLS needs both --ssl-keyfile and --ssl-certfile")

    @property
    def effective_api_key(self) -> str | None:
        """--api-key, else $KVSERVE_API_KEY, else $VLLM_API_KEY, else None."""
        if self.api_key is not None:
            return self.api_key
        return API_KEY.get() or VLLM_API_KEY.get()


class LimitsConfig(msgspec.Struct, frozen=True, kw_only=True):
    """What one request may ask for: past a limit the api answers 400 naming it, before
    anything is tokenized or queued (services/api/limits.py)."""

    max_request_body_bytes: Annotated[
        int, _doc("bytes of a request body at most (413 past it, unparsed)", parse="size")
    ] = 16 << 20
    max_prompt_chars: Annotated[
        int | None,
        _doc("characters of a prompt or of all messages at most (default: 32 x max_model_len)"),
    ] = None
    max_n: Annotated[int, _doc("completions per prompt (`n`) at most")] = 128
    max_prompts: Annotated[int, _doc("prompts in one /v1/completions batch at most")] = 1024
    max_stop_strings: Annotated[int, _doc("stop strings of a request at most")] = 64
    max_stop_string_chars: Annotated[int, _doc("characters of one stop string at most")] = 512
    max_messages: Annotated[int, _doc("messages of a chat request at most")] = 2048
    max_tools: Annotated[int, _doc("tools of a chat request at most (OpenAI's limit)")] = 128
    max_token_id_list: Annotated[
        int,
        _doc("entries of stop_token_ids, allowed_token_ids, logit_bias and bad_words at most"),
    ] = 4096
    max_json_depth: Annotated[int, _doc("nesting of a JSON body at most")] = 64

    def __post_init__(self) -> None:
        for name in self.__struct_fields__:
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be positive, got {value}")


class FrontendConfig(msgspec.Struct, frozen=True, kw_only=True):
    """The OpenAI front end: chat template, request defaults, API details, request logs."""

    chat_template: Annotated[
        str | None,
        _doc("a Jinja chat template: a file, or the template itself (default: the tokenizer's)"),
    ] = None
    generation_config: Annotated[
        str,
        _doc(
            "request defaults: auto = the model's generation_config.json (temperature, top_p, "
            "top_k, min_p, repetition_penalty, max_new_tokens), vllm = kvserve's own, or a "
            "folder holding a generation_config.json"
        ),
    ] = "auto"
    enable_prompt_tokens_details: Annotated[
        bool, _doc("report usage.prompt_tokens_details.cached_tokens (prefix-cache hits)")
    ] = False
    return_tokens_as_token_ids: Annotated[
        bool, _doc("logprobs name tokens as 'token_id:N' (for tokens that do not decode alone)")
    ] = False
    enable_request_id_headers: Annotated[
        bool, _doc("echo the request id in an X-Request-Id response header")
    ] = False
    enable_log_requests: Annotated[bool, _doc("log each request's parameters and prompt")] = False
    max_log_len: Annotated[
        int | None, _doc("characters (and token ids) of a prompt that --enable-log-requests logs")
    ] = None
    disable_log_stats: Annotated[
        bool, _doc("no periodic throughput / KV-cache log line from the front end")
    ] = False
    enable_auto_tool_choice: Annotated[
        bool,
        _doc('tool_choice "auto": the model decides, --tool-call-parser reads its tool calls'),
    ] = False
    tool_call_parser: Annotated[
        Literal["hermes", "llama3_json", "pythonic"] | None,
        _doc(
            "how tool calls look in the model's text: hermes (JSON in <tool_call> tags), "
            "llama3_json (JSON objects), pythonic ([f(a=1), g()])"
        ),
    ] = None
    exclude_tools_when_tool_choice_none: Annotated[
        bool, _doc('leave the tools out of the chat template when tool_choice is "none"')
    ] = False
    lora_modules: Annotated[
        list[LoRAModulePath],
        _doc(
            "LoRA adapters served at start-up (needs --enable-lora): name=path ..., or vLLM's "
            'JSON {"name": ..., "path": ..., "base_model_name": ...}',
            parse="items",
        ),
    ] = msgspec.field(default_factory=list)
    limits: LimitsConfig = msgspec.field(default_factory=LimitsConfig)

    def __post_init__(self) -> None:
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("--enable-auto-tool-choice needs --tool-call-parser")


class DataParallelConfig(msgspec.Struct, frozen=True, kw_only=True):
    """Where the data-parallel engine cores run (their count is --data-parallel-size)."""

    data_parallel_size_local: Annotated[
        int | None, _doc("engine cores on this node (default: --data-parallel-size, one node)")
    ] = None
    data_parallel_start_rank: Annotated[
        int, _doc("index of this node's first engine core (--headless nodes)")
    ] = 0
    data_parallel_address: Annotated[
        str | None, _doc("IP or host name of the front-end node, which other nodes reach")
    ] = None
    data_parallel_rpc_port: Annotated[
        int, _doc("front-end port where headless nodes register their engines")
    ] = 29550
    headless: Annotated[
        bool, _doc("run engine cores only, registering with the front-end node")
    ] = False
    dp_routing: DPRoutingOption = "load"
    restart_dead_engines: Annotated[
        bool,
        _doc(
            "restart an engine core process of this node that dies (backing off 1 s to 30 s "
            "while it keeps dying young); the api readmits it once it is READY and answers "
            "503 while no engine core serves"
        ),
    ] = False

    def layout(self, size: int) -> DPLayout:
        """The checked layout of `size` engine cores in all."""
        local = self.data_parallel_size_local
        layout = DPLayout(
            size=size,
            size_local=size if local is None else local,
            start_rank=self.data_parallel_start_rank,
            address=self.data_parallel_address,
            rpc_port=self.data_parallel_rpc_port,
        )
        layout.validate(self.headless)
        return layout


class DPLayout(msgspec.Struct, frozen=True, kw_only=True):
    """Where the data-parallel engine cores run, derived from DataParallelConfig.

    Args:
        size: N, engine cores in all.
        size_local: engine cores on this node.
        start_rank: the first engine index on this node (0 on the front end).
        address: the front end's address, for other nodes (multi-node only).
        rpc_port: the front end's registration port (multi-node only).
    """

    size: int
    size_local: int
    start_rank: int = 0
    address: str | None = None
    rpc_port: int | None = None

    @property
    def multi_node(self) -> bool:
        return self.size_local < self.size

    def validate(self, headless: bool) -> None:
        if self.size < 1:
            raise ValueError(f"--data-parallel-size must be >= 1, got {self.size}")
        if not 0 <= self.size_local <= self.size:
            raise ValueError(
                f"--data-parallel-size-local must be in [0, {self.size}] "
                f"(--data-parallel-size), got {self.size_local}"
            )
        if not headless and self.start_rank != 0:
            raise ValueError(
                "--data-parallel-start-rank is for --headless nodes: the front "
                "end runs engines 0..L-1"
            )
        if headless and (
            self.size_local < 1
            or self.start_rank + self.size_local > self.size
            or self.start_rank < 1
        ):
            raise ValueError(
                f"a --headless node runs engines start_rank..start_rank+L-1, "
                f"within 1..{self.size - 1}: got --data-parallel-start-rank "
                f"{self.start_rank} and --data-parallel-size-local "
                f"{self.size_local}"
            )
        if (self.multi_node or headless) and (self.address is None or self.rpc_port is None):
            raise ValueError(
                "engines on other nodes need --data-parallel-address (the front "
                "end's IP or host name) and --data-parallel-rpc-port"
            )


class PDConfig(msgspec.Struct, frozen=True, kw_only=True):
    """Prefill/decode disaggregation on one node: N prefill and M decode engine cores and a
    KV store between them (`kvserve serve --prefill-size N --decode-size M`)."""

    prefill_size: Annotated[
        int, _doc("prefill engine cores (kv_producer); P/D needs --decode-size too")
    ] = 0
    decode_size: Annotated[
        int, _doc("decode engine cores (kv_consumer); P/D needs --prefill-size too")
    ] = 0
    kv_store_size: Annotated[
        int, _doc("bytes of KV blocks the P/D KV store holds at most (8G, 512M)", parse="size")
    ] = 4 * GiB

    @property
    def enabled(self) -> bool:
        return self.prefill_size > 0 or self.decode_size > 0

    @property
    def num_engines(self) -> int:
        return self.prefill_size + self.decode_size

    def kv_role(self, engine_index: int) -> KVRole:
        """Engines 0..N-1 prefill, N..N+M-1 decode."""
        return "kv_producer" if engine_index < self.prefill_size else "kv_consumer"

    def validate(self, engine: EngineConfig, data_parallel: DataParallelConfig) -> None:
        if not self.enabled:
            return
        if self.prefill_size < 1 or self.decode_size < 1:
            raise ValueError(
                f"P/D disaggregation needs both --prefill-size and --decode-size >= 1, got "
                f"{self.prefill_size} and {self.decode_size}"
            )
        if engine.parallel.data_parallel_size > 1 or data_parallel.data_parallel_size_local:
            raise ValueError(
                "--prefill-size/--decode-size set the number of engine cores themselves: "
                "drop --data-parallel-size and --data-parallel-size-local"
            )
        if data_parallel.headless:
            raise ValueError(
                "--prefill-size/--decode-size run the api, the KV store and the engines on "
                "one node; a --headless node takes a role from --kv-transfer-config instead"
            )
        if engine.kv_transfer_config is not None:
            raise ValueError(
                "--prefill-size/--decode-size configure each engine's KV transfer (a "
                "KvStoreConnector to their own KV store): drop --kv-transfer-config"
            )
        if self.kv_store_size <= 0:
            raise ValueError(f"--kv-store-size must be positive, got {self.kv_store_size}")


class EngineSockets(msgspec.Struct, frozen=True, kw_only=True):
    """The engine cores' two sockets: the api binds them, engine cores connect to them."""

    input_addr: Annotated[
        str,
        _doc(
            "requests to the engine cores: tcp://*:5555 on the api, tcp://API_HOST:5555 on an "
            "engine"
        ),
    ]
    output_addr: Annotated[
        str,
        _doc(
            "the engine cores' outputs: tcp://*:5556 on the api, tcp://API_HOST:5556 on an engine"
        ),
    ]


class TransportConfig(msgspec.Struct, frozen=True, kw_only=True):
    """Security of the tcp:// sockets between kvserve processes (ZeroMQ CURVE).

    The command passes both to the processes it starts through the environment
    (shared/transport_security.py)."""

    transport_keys: Annotated[
        str | None,
        _doc(
            "folder of the deployment's keypair (`kvserve keys generate DIR`, copied to every "
            "node): every tcp:// socket is encrypted and admits only peers holding it "
            f"(default: ${TRANSPORT_KEYS.name})"
        ),
    ] = None
    insecure_transport: Annotated[
        bool | None,
        _doc(
            "allow tcp:// sockets without keys: plain text, and anyone who reaches a port "
            f"can send to it (default: ${INSECURE_TRANSPORT.name})"
        ),
    ] = None


def _store_addresses(engine: EngineConfig) -> list[str]:
    transfer = engine.kv_transfer_config
    address = transfer.store_address if transfer is not None else None
    return [] if address is None else [address]


class ServeOptions(msgspec.Struct, frozen=True, kw_only=True):
    """`kvserve serve`: the api in this process, the engine cores (and, with data
    parallelism, the DP coordinator) in child processes."""

    engine: EngineConfig = msgspec.field(default_factory=EngineConfig)
    http: HTTPConfig = msgspec.field(default_factory=HTTPConfig)
    frontend: FrontendConfig = msgspec.field(default_factory=FrontendConfig)
    data_parallel: DataParallelConfig = msgspec.field(default_factory=DataParallelConfig)
    pd: PDConfig = msgspec.field(default_factory=PDConfig)
    transport: TransportConfig = msgspec.field(default_factory=TransportConfig)

    def __post_init__(self) -> None:
        self.data_parallel.layout(self.engine.parallel.data_parallel_size)  # checks it
        self.pd.validate(self.engine, self.data_parallel)
        _check_lora_modules(self.frontend, self.engine.lora)

    @property
    def socket_addresses(self) -> list[str]:
        """The addresses given on the command line that this launch's sockets use (the
        others are ipc://, or tcp:// exactly when these are)."""
        dp = self.data_parallel
        layout = dp.layout(self.engine.parallel.data_parallel_size)
        addresses = _store_addresses(self.engine)
        if layout.multi_node or dp.headless:
            addresses.append(f"tcp://{layout.address}:{layout.rpc_port}")
        return addresses


def _check_lora_modules(frontend: FrontendConfig, lora: LoRAConfig) -> None:
    if frontend.lora_modules and not lora.enable_lora:
        raise ValueError("--lora-modules needs --enable-lora")


class APIOptions(msgspec.Struct, frozen=True, kw_only=True):
    """`kvserve api`: the HTTP server alone, for engine cores started elsewhere."""

    model: ModelConfig = msgspec.field(default_factory=ModelConfig)
    lora: LoRAConfig = msgspec.field(default_factory=LoRAConfig)
    sockets: EngineSockets
    http: HTTPConfig = msgspec.field(default_factory=HTTPConfig)
    frontend: FrontendConfig = msgspec.field(default_factory=FrontendConfig)
    data_parallel_size: Annotated[
        int, _doc("engine cores that connect to the sockets (serving starts when all are ready)")
    ] = 1
    load_table_addr: Annotated[
        str | None, _doc("the DP coordinator's --publish-addr, e.g. tcp://coordinator:5558")
    ] = None
    dp_routing: DPRoutingOption = "load"
    transport: TransportConfig = msgspec.field(default_factory=TransportConfig)

    def __post_init__(self) -> None:
        # The engines need --enable-lora (and the same --max-loras) too: the api cannot
        # tell whether theirs match.
        _check_lora_modules(self.frontend, self.lora)

    @property
    def socket_addresses(self) -> list[str]:
        addresses = [self.sockets.input_addr, self.sockets.output_addr]
        return addresses + ([self.load_table_addr] if self.load_table_addr else [])


class EngineOptions(msgspec.Struct, frozen=True, kw_only=True):
    """`kvserve engine`: one engine core, serving an api elsewhere."""

    engine: EngineConfig = msgspec.field(default_factory=EngineConfig)
    sockets: EngineSockets
    engine_index: Annotated[int, _doc("this engine core's data-parallel index")] = 0
    stats_addr: Annotated[
        str | None, _doc("the DP coordinator's --stats-addr, e.g. tcp://coordinator:5557")
    ] = None
    transport: TransportConfig = msgspec.field(default_factory=TransportConfig)

    @property
    def socket_addresses(self) -> list[str]:
        addresses = [self.sockets.input_addr, self.sockets.output_addr]
        addresses += [self.stats_addr] if self.stats_addr else []
        return addresses + _store_addresses(self.engine)


class CoordinatorOptions(msgspec.Struct, frozen=True, kw_only=True):
    """`kvserve coordinator`: the DP coordinator alone (engine loads in, load table out)."""

    stats_addr: Annotated[str, _doc("address to bind for the engines' loads")] = "tcp://*:5557"
    publish_addr: Annotated[
        str, _doc("address to bind for publishing the load table to api servers")
    ] = "tcp://*:5558"
    transport: TransportConfig = msgspec.field(default_factory=TransportConfig)

    @property
    def socket_addresses(self) -> list[str]:
        return [self.stats_addr, self.publish_addr]


class KvStoreOptions(msgspec.Struct, frozen=True, kw_only=True):
    """`kvserve kv-store`: the KV-cache store (P/D transfer, CPU offload tier)."""

    address: Annotated[
        str,
        _doc(
            "addresses to bind, comma-separated: ipc://PATH for clients on this host (they "
            "copy through shared memory), tcp://HOST:PORT for the others (blocks as frames)"
        ),
    ] = "tcp://*:5570"
    size: Annotated[int, _doc("bytes of KV blocks held at most (8G, 512M, 1.5G)", parse="size")] = (
        4 * GiB
    )
    lease_timeout_s: Annotated[
        float,
        _doc("seconds a client's reservation, get or pin lasts unless released or committed"),
    ] = 30.0
    device: Annotated[
        Literal["cpu", "cuda"],
        _doc("where the blocks live: cpu (shared memory) or cuda (exported with CUDA IPC)"),
    ] = "cpu"
    transport: TransportConfig = msgspec.field(default_factory=TransportConfig)

    def __post_init__(self) -> None:
        if self.size <= 0 or self.lease_timeout_s <= 0:
            raise ValueError("--size and --lease-timeout-s must be positive")
        for addr in self.addresses:
            if not addr.startswith(("ipc://", "tcp://")):
                raise ValueError(f"--address {addr!r}: use ipc://PATH or tcp://HOST:PORT")

    @property
    def addresses(self) -> list[str]:
        return [addr.strip() for addr in self.address.split(",") if addr.strip()]

    @property
    def socket_addresses(self) -> list[str]:
        return self.addresses


class WorkerOptions(msgspec.Struct, frozen=True, kw_only=True):
    """`kvserve worker`: one worker rank, started by an engine core's mp executor."""

    rank: Annotated[int, _doc("this worker's global rank (TP-major)")]
    model_dir: Annotated[str, _doc("resolved HF-style model folder")]
    engine_config: Annotated[EngineConfig, _doc("the EngineConfig", parse="json")]
    ring_handle: Annotated[ShmRingHandle, _doc("the engine's shared-memory ring", parse="json")]
    result_addr: Annotated[
        str, _doc("ZMQ address of the engine's PULL socket for ready messages and outputs")
    ]
    distributed_init_method: Annotated[
        str | None, _doc("torch.distributed rendezvous, tcp://HOST:PORT (TP x PP > 1)")
    ] = None


class GenerateOptions(msgspec.Struct, frozen=True, kw_only=True):
    """`kvserve generate`: one completion, offline."""

    engine: EngineConfig = msgspec.field(default_factory=EngineConfig)
    prompt: Annotated[str, _doc("the prompt")]
    max_tokens: Annotated[int, _doc("tokens to generate at most")] = 64
    temperature: Annotated[float, _doc("sampling temperature (0: greedy)")] = 0.0
    chat: Annotated[bool, _doc("wrap the prompt in the chat template")] = False


class TrainDraftOptions(msgspec.Struct, frozen=True, kw_only=True):
    """`kvserve train-draft`: Medusa heads or an EAGLE-1 head from the model's own greedy
    generations.

    Self-distillation on this machine: no hub, no data sets."""

    model: Annotated[
        str | None, _doc("HF folder or GGUF file of the target (default: SmolLM2-135M-Instruct)")
    ] = None
    output: Annotated[str, _doc("folder to write the heads to (config.json, model.safetensors)")]
    method: Annotated[
        Literal["medusa", "eagle"], _doc("draft kind: Medusa heads or an EAGLE-1 decoder layer")
    ] = "medusa"
    num_heads: Annotated[int, _doc("Medusa heads: the most tokens drafted per step")] = 3
    num_layers: Annotated[int, _doc("residual layers per head")] = 1
    num_spec_tokens: Annotated[int, _doc("EAGLE: the drafted chain's length when scoring")] = 4
    share_lm_head: Annotated[
        bool, _doc("heads use the target's LM head (nothing to store; fewer bytes per step)")
    ] = True
    prompts: Annotated[
        str | None,
        _doc('a .jsonl of {"prompt": ...} lines (default: bench/spec_decode/train_prompts.jsonl)'),
    ] = None
    num_prompts: Annotated[int, _doc("prompts to generate from, a tenth held out for scoring")] = (
        200
    )
    max_tokens: Annotated[int, _doc("tokens per generation at most")] = 96
    epochs: Annotated[
        int | None, _doc("passes over the training data (default: medusa 2, eagle 6)")
    ] = None
    lr: Annotated[float | None, _doc("AdamW learning rate (default 1e-3)")] = None
    batch_size: Annotated[
        int | None,
        _doc("per training step: medusa positions (default 64), eagle sequences (default 2)"),
    ] = None
    seed: Annotated[int, _doc("seed of the prompt shuffle, the split and the training")] = 0

    def __post_init__(self):
        if self.num_heads < 1 or self.num_layers < 0 or self.num_spec_tokens < 1:
            raise ValueError("--num-heads, --num-spec-tokens must be >= 1, --num-layers >= 0")
        if self.num_prompts < 2 or self.max_tokens < self.num_heads + 2:
            raise ValueError(
                "--num-prompts must be >= 2 (some are held out) and --max-tokens > --num-heads + 1"
            )
        if self.train_epochs < 1 or self.train_batch_size < 1 or self.learning_rate <= 0:
            raise ValueError("--epochs, --batch-size and --lr must be positive")

    @property
    def train_epochs(self) -> int:
        return self.epochs if self.epochs is not None else {"medusa": 2, "eagle": 6}[self.method]

    @property
    def learning_rate(self) -> float:
        return self.lr if self.lr is not None else 1e-3

    @property
    def train_batch_size(self) -> int:
        if self.batch_size is not None:
            return self.batch_size
        return {"medusa": 64, "eagle": 2}[self.method]


# ---------------------------------------------------------------------- vLLM flags refused

_NO_HUB = "kvserve loads local folders, GGUF files and the local HF cache only (no downloads)"
_LATER = "not built yet"
UNSUPPORTED_VLLM_FLAGS: dict[str, RefusedFlag] = {
    "--kv-events-config": RefusedFlag(f"KV cache events: {_LATER}"),
    "--cpu-offload-gb": RefusedFlag("weights are never offloaded to CPU memory"),
    "--kv-cache-dtype": RefusedFlag(
        "the KV cache holds the model's dtype (only `auto`)", accepted=("auto",)
    ),
    "--reasoning-parser": RefusedFlag(f"reasoning parsers: {_LATER}"),
    "--guided-decoding-backend": RefusedFlag(
        "vLLM replaced it with --structured-outputs-config; kvserve's backend is xgrammar",
        accepted=("auto", "xgrammar"),
    ),
    "--enable-expert-parallel": RefusedFlag("expert parallelism (MoE models) is not supported"),
    "--api-server-count": RefusedFlag(
        "one api process per server (scale engines with --data-parallel-size)", accepted=("1",)
    ),
    "--revision": RefusedFlag(_NO_HUB),
    "--code-revision": RefusedFlag(_NO_HUB),
    "--tokenizer-revision": RefusedFlag(_NO_HUB),
    "--download-dir": RefusedFlag(_NO_HUB),
    "--hf-token": RefusedFlag(_NO_HUB),
    "--load-format": RefusedFlag(
        "weights load from safetensors or GGUF as found", accepted=("auto", "safetensors", "gguf")
    ),
    "--tokenizer-mode": RefusedFlag(
        "the fast tokenizer (tokenizer.json) when present, else transformers' own",
        accepted=("auto",),
    ),
    "--limit-mm-per-prompt": RefusedFlag("multimodal inputs are not supported"),
    "--compilation-config": RefusedFlag("torch.compile and CUDA graphs are not used"),
    "-O": RefusedFlag("torch.compile and CUDA graphs are not used", accepted=("0",)),
    "--swap-space": RefusedFlag("preempted requests are recomputed, never swapped to CPU"),
    "--async-scheduling": RefusedFlag(f"asynchronous scheduling: {_LATER}"),
    "--enable-sleep-mode": RefusedFlag("sleep mode is not supported"),
    "--device": RefusedFlag("the device is what torch finds (CUDA, else CPU)", accepted=("auto",)),
    "--worker-cls": RefusedFlag("the worker class is fixed"),
    "--worker-extension-cls": RefusedFlag("the worker class is fixed"),
}
