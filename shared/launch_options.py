"""Each command's launch options: one frozen options struct per process kind.

DataParallelConfig and its DPLayout, PDConfig (prefill/decode disaggregation),
EngineSockets and TransportConfig (the sockets between processes) compose, with EngineConfig
(shared/config.py) and the api's HTTPConfig and FrontendConfig (shared/api_config.py), into
ServeOptions, APIOptions, EngineOptions, CoordinatorOptions, KvStoreOptions, WorkerOptions,
GenerateOptions and TrainDraftOptions. shared/cli_args.py generates each command's flags
from its struct.
"""

from __future__ import annotations

import os
from typing import Annotated, Literal

import msgspec

from kvserve.shared.api_config import FrontendConfig, HTTPConfig
from kvserve.shared.cli_args import flag_doc
from kvserve.shared.config import EngineConfig, GiB, KVRole, LoRAConfig, ModelConfig
from kvserve.shared.env import INSECURE_TRANSPORT, TRANSPORT_KEYS
from kvserve.shared.shm_ring import ShmRingHandle

DPRouting = Literal["load", "prefix"]
DPRoutingOption = Annotated[
    DPRouting,
    flag_doc(
        "load: lowest 4 x waiting + running; prefix: prefer the engine holding the prompt's "
        "prefix blocks, within a load slack"
    ),
]

DPPrefixSlackOption = Annotated[
    int,
    flag_doc(
        "--dp-routing prefix: how far above the least loaded engine's score (4 x waiting + "
        "running) the engine holding a prompt's prefix may be and still get it (a large "
        "value pins a prefix to its engine)"
    ),
]


class DataParallelConfig(msgspec.Struct, frozen=True, kw_only=True):
    """Where the data-parallel engine cores run (their count is --data-parallel-size)."""

    data_parallel_size_local: Annotated[
        int | None, flag_doc("engine cores on this node (default: --data-parallel-size, one node)")
    ] = None
    data_parallel_start_rank: Annotated[
        int, flag_doc("index of this node's first engine core (--headless nodes)")
    ] = 0
    data_parallel_address: Annotated[
        str | None, flag_doc("IP or host name of the front-end node, which other nodes reach")
    ] = None
    data_parallel_rpc_port: Annotated[
        int, flag_doc("front-end port where headless nodes register their engines")
    ] = 29550
    headless: Annotated[
        bool, flag_doc("run engine cores only, registering with the front-end node")
    ] = False
    dp_routing: DPRoutingOption = "load"
    dp_prefix_slack: DPPrefixSlackOption = 8
    restart_dead_engines: Annotated[
        bool,
        flag_doc(
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
        int, flag_doc("prefill engine cores (kv_producer); P/D needs --decode-size too")
    ] = 0
    decode_size: Annotated[
        int, flag_doc("decode engine cores (kv_consumer); P/D needs --prefill-size too")
    ] = 0
    kv_store_size: Annotated[
        int, flag_doc("bytes of KV blocks the P/D KV store holds at most (8G, 512M)", parse="size")
    ] = 4 * GiB
    kv_store_disk_path: Annotated[
        str | None,
        flag_doc(
            "folder of the P/D KV store's disk tier (its --disk-path): evicted blocks spill "
            "there, pinned ones outlive a store restart"
        ),
    ] = None
    kv_store_disk_bytes: Annotated[
        int,
        flag_doc("bytes of block files the P/D KV store's disk tier holds at most", parse="size"),
    ] = 16 * GiB

    @property
    def enabled(self) -> bool:
        return self.prefill_size > 0 or self.decode_size > 0

    def store_options(self, address: str) -> KvStoreOptions:
        """The options of the P/D KV store that listens on `address`."""
        return KvStoreOptions(
            address=address,
            size=self.kv_store_size,
            disk_path=self.kv_store_disk_path,
            disk_bytes=self.kv_store_disk_bytes,
        )

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
        if self.kv_store_disk_path is not None and self.kv_store_disk_bytes <= 0:
            raise ValueError(
                f"--kv-store-disk-bytes must be positive, got {self.kv_store_disk_bytes}"
            )


class EngineSockets(msgspec.Struct, frozen=True, kw_only=True):
    """The engine cores' two sockets: the api binds them, engine cores connect to them."""

    input_addr: Annotated[
        str,
        flag_doc(
            "requests to the engine cores: tcp://*:5555 on the api, tcp://API_HOST:5555 on an "
            "engine"
        ),
    ]
    output_addr: Annotated[
        str,
        flag_doc(
            "the engine cores' outputs: tcp://*:5556 on the api, tcp://API_HOST:5556 on an engine"
        ),
    ]


class TransportConfig(msgspec.Struct, frozen=True, kw_only=True):
    """Security of the tcp:// sockets between kvserve processes (ZeroMQ CURVE).

    The command passes both to the processes it starts through the environment
    (shared/transport_security.py)."""

    transport_keys: Annotated[
        str | None,
        flag_doc(
            "folder of the deployment's keypair (`kvserve keys generate DIR`, copied to every "
            "node): every tcp:// socket is encrypted and admits only peers holding it "
            f"(default: ${TRANSPORT_KEYS.name})"
        ),
    ] = None
    insecure_transport: Annotated[
        bool | None,
        flag_doc(
            "allow tcp:// sockets without keys: plain text, and anyone who reaches a port "
            f"can send to it (default: ${INSECURE_TRANSPORT.name})"
        ),
    ] = None


def _store_addresses(engine: EngineConfig) -> list[str]:
    transfer = engine.kv_transfer_config
    address = transfer.store_address if transfer is not None else None
    addresses = [] if address is None else [address]
    events = engine.kv_events_config
    if events is not None and events.is_publishing:
        addresses += [addr for addr in (events.endpoint, events.replay_endpoint) if addr]
    return addresses


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
        int,
        flag_doc("engine cores that connect to the sockets (serving starts when all are ready)"),
    ] = 1
    load_table_addr: Annotated[
        str | None, flag_doc("the DP coordinator's --publish-addr, e.g. tcp://coordinator:5558")
    ] = None
    dp_routing: DPRoutingOption = "load"
    dp_prefix_slack: DPPrefixSlackOption = 8
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
    engine_index: Annotated[int, flag_doc("this engine core's data-parallel index")] = 0
    stats_addr: Annotated[
        str | None, flag_doc("the DP coordinator's --stats-addr, e.g. tcp://coordinator:5557")
    ] = None
    transport: TransportConfig = msgspec.field(default_factory=TransportConfig)

    @property
    def socket_addresses(self) -> list[str]:
        addresses = [self.sockets.input_addr, self.sockets.output_addr]
        addresses += [self.stats_addr] if self.stats_addr else []
        return addresses + _store_addresses(self.engine)


class CoordinatorOptions(msgspec.Struct, frozen=True, kw_only=True):
    """`kvserve coordinator`: the DP coordinator alone (engine loads in, load table out)."""

    stats_addr: Annotated[str, flag_doc("address to bind for the engines' loads")] = "tcp://*:5557"
    publish_addr: Annotated[
        str, flag_doc("address to bind for publishing the load table to api servers")
    ] = "tcp://*:5558"
    transport: TransportConfig = msgspec.field(default_factory=TransportConfig)

    @property
    def socket_addresses(self) -> list[str]:
        return [self.stats_addr, self.publish_addr]


class KvStoreOptions(msgspec.Struct, frozen=True, kw_only=True):
    """`kvserve kv-store`: the KV-cache store (P/D transfer, CPU offload tier)."""

    address: Annotated[
        str,
        flag_doc(
            "addresses to bind, comma-separated: ipc://PATH for clients on this host (they "
            "copy through shared memory), tcp://HOST:PORT for the others (blocks as frames)"
        ),
    ] = "tcp://*:5570"
    size: Annotated[
        int, flag_doc("bytes of KV blocks held at most (8G, 512M, 1.5G)", parse="size")
    ] = 4 * GiB
    lease_timeout_s: Annotated[
        float,
        flag_doc("seconds a client's reservation, get or pin lasts unless released or committed"),
    ] = 30.0
    device: Annotated[
        Literal["cpu", "cuda"],
        flag_doc("where the blocks live: cpu (shared memory) or cuda (exported with CUDA IPC)"),
    ] = "cpu"
    disk_path: Annotated[
        str | None,
        flag_doc(
            "folder of a disk tier under the memory one: evicted blocks spill there, blocks "
            "pinned with a TTL are written there and outlive a store restart until it ends"
        ),
    ] = None
    disk_bytes: Annotated[
        int, flag_doc("bytes of block files the disk tier holds at most (64G, 512M)", parse="size")
    ] = 16 * GiB
    transport: TransportConfig = msgspec.field(default_factory=TransportConfig)

    def __post_init__(self) -> None:
        if self.size <= 0 or self.lease_timeout_s <= 0:
            raise ValueError("--size and --lease-timeout-s must be positive")
        if self.disk_bytes <= 0:
            raise ValueError(f"--disk-bytes must be positive, got {self.disk_bytes}")
        if self.disk_path is not None and os.path.exists(self.disk_path):
            if not os.path.isdir(self.disk_path):
                raise ValueError(f"--disk-path {self.disk_path} exists and is not a folder")
        for addr in self.addresses:
            if not addr.startswith(("ipc://", "tcp://")):
                raise ValueError(f"--address {addr!r}: use ipc://PATH or tcp://HOST:PORT")

    @property
    def addresses(self) -> list[str]:
        return [addr.strip() for addr in self.address.split(",") if addr.strip()]

    @property
    def socket_addresses(self) -> list[str]:
        return self.addresses


class KvEventsOptions(msgspec.Struct, frozen=True, kw_only=True):
    """`kvserve kv-events`: print an engine's KV cache events (--kv-events-config), one JSON
    object per line."""

    addr: Annotated[
        str, flag_doc("the engine's PUB address (its endpoint, PORT + i for DP engine i)")
    ] = "tcp://127.0.0.1:5557"
    replay: Annotated[
        str | None,
        flag_doc("its replay address: first print the buffered batches from --from-seq"),
    ] = None
    from_seq: Annotated[int, flag_doc("first sequence number asked from --replay")] = 0
    topic: Annotated[str, flag_doc("the publisher's topic")] = ""
    max_events: Annotated[int | None, flag_doc("exit after this many events")] = None
    idle_timeout_s: Annotated[float | None, flag_doc("exit after this long without a batch")] = None
    transport: TransportConfig = msgspec.field(default_factory=TransportConfig)

    def __post_init__(self) -> None:
        for addr in (self.addr, self.replay):
            if addr is not None and not addr.startswith(("ipc://", "tcp://")):
                raise ValueError(f"{addr!r}: use ipc://PATH or tcp://HOST:PORT")
        if self.from_seq < 0:
            raise ValueError("--from-seq must be >= 0")

    @property
    def socket_addresses(self) -> list[str]:
        return [self.addr, *([self.replay] if self.replay else [])]


class WorkerOptions(msgspec.Struct, frozen=True, kw_only=True):
    """`kvserve worker`: one worker rank, started by an engine core's mp executor."""

    rank: Annotated[int, flag_doc("this worker's global rank (TP-major)")]
    model_dir: Annotated[str, flag_doc("resolved HF-style model folder")]
    engine_config: Annotated[EngineConfig, flag_doc("the EngineConfig", parse="json")]
    ring_handle: Annotated[ShmRingHandle, flag_doc("the engine's shared-memory ring", parse="json")]
    result_addr: Annotated[
        str, flag_doc("ZMQ address of the engine's PULL socket for ready messages and outputs")
    ]
    distributed_init_method: Annotated[
        str | None, flag_doc("torch.distributed rendezvous, tcp://HOST:PORT (TP x PP > 1)")
    ] = None


class GenerateOptions(msgspec.Struct, frozen=True, kw_only=True):
    """`kvserve generate`: one completion, offline."""

    engine: EngineConfig = msgspec.field(default_factory=EngineConfig)
    prompt: Annotated[str, flag_doc("the prompt")]
    max_tokens: Annotated[int, flag_doc("tokens to generate at most")] = 64
    temperature: Annotated[float, flag_doc("sampling temperature (0: greedy)")] = 0.0
    chat: Annotated[bool, flag_doc("wrap the prompt in the chat template")] = False


class TrainDraftOptions(msgspec.Struct, frozen=True, kw_only=True):
    """`kvserve train-draft`: Medusa heads, an EAGLE-1 or an EAGLE-3 head from the model's
    own greedy generations.

    Self-distillation on this machine: no hub, no data sets."""

    model: Annotated[
        str | None,
        flag_doc("HF folder or GGUF file of the target (default: SmolLM2-135M-Instruct)"),
    ] = None
    output: Annotated[
        str, flag_doc("folder to write the heads to (config.json, model.safetensors)")
    ]
    method: Annotated[
        Literal["medusa", "eagle", "eagle3"],
        flag_doc("draft kind: Medusa heads, an EAGLE-1 or an EAGLE-3 decoder layer"),
    ] = "medusa"
    num_heads: Annotated[int, flag_doc("Medusa heads: the most tokens drafted per step")] = 3
    num_layers: Annotated[int, flag_doc("residual layers per head")] = 1
    num_spec_tokens: Annotated[
        int,
        flag_doc("EAGLE: the drafted chain's length when scoring (EAGLE-3: and steps unrolled)"),
    ] = 4
    draft_vocab_size: Annotated[
        int, flag_doc("EAGLE-3: the draft vocabulary, the training data's most frequent tokens")
    ] = 8192
    share_lm_head: Annotated[
        bool, flag_doc("heads use the target's LM head (nothing to store; fewer bytes per step)")
    ] = True
    prompts: Annotated[
        str | None,
        flag_doc(
            'a .jsonl of {"prompt": ...} lines (default: bench/spec_decode/train_prompts.jsonl)'
        ),
    ] = None
    num_prompts: Annotated[
        int, flag_doc("prompts to generate from, a tenth held out for scoring")
    ] = 200
    max_tokens: Annotated[int, flag_doc("tokens per generation at most")] = 96
    epochs: Annotated[
        int | None, flag_doc("passes over the training data (default: medusa 2, eagle 6)")
    ] = None
    lr: Annotated[float | None, flag_doc("AdamW learning rate (default 1e-3)")] = None
    batch_size: Annotated[
        int | None,
        flag_doc("per training step: medusa positions (default 64), eagle sequences (default 2)"),
    ] = None
    seed: Annotated[int, flag_doc("seed of the prompt shuffle, the split and the training")] = 0

    def __post_init__(self):
        if (
            min(self.num_heads, self.num_spec_tokens, self.draft_vocab_size) < 1
            or self.num_layers < 0
        ):
            raise ValueError(
                "--num-heads, --num-spec-tokens, --draft-vocab-size must be >= 1, --num-layers >= 0"
            )
        if self.num_prompts < 2 or self.max_tokens < self.num_heads + 2:
            raise ValueError(
                "--num-prompts must be >= 2 (some are held out) and --max-tokens > --num-heads + 1"
            )
        if self.train_epochs < 1 or self.train_batch_size < 1 or self.learning_rate <= 0:
            raise ValueError("--epochs, --batch-size and --lr must be positive")

    @property
    def train_epochs(self) -> int:
        return (
            self.epochs
            if self.epochs is not None
            else {"medusa": 2, "eagle": 6, "eagle3": 6}[self.method]
        )

    @property
    def learning_rate(self) -> float:
        return self.lr if self.lr is not None else 1e-3

    @property
    def train_batch_size(self) -> int:
        if self.batch_size is not None:
            return self.batch_size
        return {"medusa": 64, "eagle": 2, "eagle3": 2}[self.method]
