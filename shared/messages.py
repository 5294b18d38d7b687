"""Every message that crosses a process boundary, one msgspec Struct each.

Hot structs are `array_like` (encoded as arrays, not maps), `omit_defaults` and `gc=False`
(they hold no reference cycles, so the cyclic GC need not track them).
"""

from __future__ import annotations

import enum
from typing import Any

import msgspec

from kvserve.shared.lora import LoRARequest
from kvserve.shared.sampling_params import SamplingParams

_HOT = dict(array_like=True, omit_defaults=True, gc=False)


class FinishReason(enum.IntEnum):
    """Why a request ended; an int on the wire, the OpenAI string in the API."""

    STOP = 0  # EOS, a stop token or a stop string
    LENGTH = 1  # max_tokens or max_model_len
    ABORT = 2  # aborted by the client or the server
    ERROR = 3  # the request failed (its error says why)

    def __str__(self) -> str:
        return self.name.lower()


class ImageInput(msgspec.Struct, **_HOT):
    """One image of a prompt, preprocessed by the api (services/api/serving/multimodal.py).

    The pixels travel as raw bytes with their dtype and shape (the processor's flattened
    patches, [num_patches, channels * temporal_patch * patch * patch] for Qwen2.5-VL), never
    pickled. Its tokens are prompt positions [offset, offset + length), each an image
    placeholder token the model replaces by the vision encoder's output; `mm_hash` (of the
    pixels and grid) keys the prefix cache, so blocks holding the image's tokens hit only for
    the same image.
    """

    pixel_values: bytes
    dtype: str
    shape: list[int]
    grid_thw: list[int]  # (temporal, height, width) patches
    offset: int
    length: int
    mm_hash: str

    @property
    def end(self) -> int:
        return self.offset + self.length


class PromptPin(msgspec.Struct, **_HOT):
    """Keep the prompt's first `num_tokens` tokens' full KV blocks out of LRU eviction for
    `ttl_s` seconds after the request (and after each later hit): an Anthropic
    `cache_control` breakpoint or OpenAI's `prompt_cache_retention` (scheduler/core/
    prompt_pins.py). `ttl_class` labels its metrics ("5m", "1h", "24h")."""

    num_tokens: int
    ttl_s: float
    ttl_class: str = "5m"


class EngineCoreRequest(msgspec.Struct, **_HOT):
    """A tokenized request, as the api sends it to an engine core."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_id: int | None = None
    arrival_time: float = 0.0
    priority: int = 0
    cache_salt: str | None = None
    lora_request: LoRARequest | None = None  # the adapter to run with; None: the base model
    # A migrated request (its engine died): the tokens it had already emitted, which the new
    # engine recomputes with the prompt and counts as output (max_tokens, penalties, the
    # grammar, the thinking, the seeded generator's draws), emitting only what follows.
    resumed_output_token_ids: list[int] = []
    # Who the request is served for (services/api/tenancy/tenants.py) and that tenant's weight: the
    # fair scheduler serves tenants in proportion to their weights.
    tenant: str = "default"
    tenant_weight: float = 1.0
    # Images in the prompt, in prompt order (their placeholder tokens are in the prompt).
    mm_inputs: list[ImageInput] = []
    # --otlp-traces-endpoint: the W3C trace context ({"traceparent": ...}) of the api span
    # the engine's spans belong under; None (one nil byte) when tracing is off.
    # The engine core then times the request and returns EngineSpans when it finishes.
    trace_context: dict[str, str] | None = None
    # Latency targets in ms (time to first token, time per output token), resolved by the
    # api (the request's own, else its tenant's, else the server's); None: the engine core's
    # --slo-ttft-ms / --slo-tpot-ms, and no target where those are unset (scheduler.md).
    slo_ttft_ms: float | None = None
    slo_tpot_ms: float | None = None
    # Prompt caching: prefixes to pin, shortest first (PromptPin); [] for none.
    pins: list[PromptPin] = []
    # The tightest TTFT target any request may arrive with (a tenant's in the api's key
    # file); None: none known. The steps this request is in leave room for one such request
    # arriving, before any is live (scheduler.md "Latency targets").
    standing_ttft_ms: float | None = None


class Logprobs(msgspec.Struct, **_HOT):
    """Logprobs of a run of positions; row i belongs to position i.

    Column 0 is the token that was sampled (or, for prompt logprobs, the actual next prompt
    token); columns 1.. are the top-n tokens, best first.
    """

    token_ids: list[list[int]]
    logprobs: list[list[float]]
    ranks: list[int]  # vocabulary rank of column 0's token (1 = most likely)


class EngineCoreEventType(enum.IntEnum):
    """A step in a request's life inside the engine core, timed for the metrics."""

    QUEUED = 0  # the scheduler took it in
    SCHEDULED = 1  # scheduled from the waiting queue: the first time, or again once preempted
    PREEMPTED = 2


class EngineCoreEvent(msgspec.Struct, **_HOT):
    """One timed event of a request.

    `timestamp` is time.monotonic() in the engine core process, as is
    `EngineCoreOutputs.timestamp`: only differences between timestamps of one engine core
    mean anything (the api never compares them with its own clock).
    """

    type: EngineCoreEventType
    timestamp: float


class EngineSpan(msgspec.Struct, **_HOT):
    """One timed phase of a traced request inside the engine core (services/scheduler/core/
    request_trace.py); the api makes it an OpenTelemetry span under the request's context.

    Times are time.time_ns() (wall clock, as OpenTelemetry's), so the api can place them in
    its own trace: on one machine the clocks agree; across machines they are as close as
    the machines' clocks are.
    """

    name: str
    start_ns: int
    end_ns: int
    attributes: dict[str, int] = {}


class EngineCoreOutput(msgspec.Struct, **_HOT):
    """What one request gained in one step."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: Logprobs | None = None
    new_prompt_logprobs: Logprobs | None = None
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None  # the stop token id, if one ended it
    # Prompt tokens the prefix cache served at the first schedule: in the request's first
    # output only; the others carry 0, which costs no bytes while the fields after it
    # are unset too.
    num_cached_tokens: int = 0
    error: str | None = None  # set when finish_reason is ERROR
    # Events since the request's last output; None (a nil byte) on most steps.
    events: list[EngineCoreEvent] | None = None
    # An embedding (SamplingParams.pooling): the pooled, normalised hidden state as float32
    # bytes, in the output that finishes the request.
    pooled: bytes | None = None
    # A traced request's engine phases (EngineCoreRequest.trace_context), in the output
    # that finishes it; None otherwise.
    trace_spans: list[EngineSpan] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class SchedulerStats(msgspec.Struct, **_HOT):
    """A snapshot of one engine core's load, sent with its outputs."""

    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    kv_cache_usage: float = 0.0  # fraction of blocks in use, 0..1
    num_preemptions: int = 0  # in this step
    prefix_cache_queries: int = 0  # prompt tokens looked up, in this step
    prefix_cache_hits: int = 0  # of those, tokens found cached
    num_scheduled_tokens: int = 0  # prompt and decode tokens this step computed
    # Structured outputs: requests whose grammar is still compiling (also counted in
    # num_waiting_reqs), cache lookups and hits in this step, and the seconds each grammar
    # compiled in this step took.
    num_waiting_for_grammar: int = 0
    grammar_cache_queries: int = 0
    grammar_cache_hits: int = 0
    grammar_compile_times: list[float] = []
    # LoRA: requests per adapter name, running and waiting (vLLM's lora_requests_info).
    running_lora_adapters: dict[str, int] = {}
    waiting_lora_adapters: dict[str, int] = {}
    # Tenants: requests per tenant name, running and waiting (those with none left out).
    running_by_tenant: dict[str, int] = {}
    waiting_by_tenant: dict[str, int] = {}
    # Speculative decoding in this step: requests that verified drafts, the drafts, those
    # accepted, and accepted counts per draft position (index 0: the first draft).
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_accepted_per_pos: list[int] = []
    # KV connector: prompt tokens looked up in the store and found there (external prefix
    # hits, beyond the local ones), whether the store answers (None: no connector), the
    # seconds of each batch transfer, bytes moved, and the store's own figures.
    external_prefix_cache_queries: int = 0
    external_prefix_cache_hits: int = 0
    kv_store_up: bool | None = None
    kv_transfer_seconds: list[float] = []
    kv_bytes_loaded: int = 0
    kv_bytes_saved: int = 0
    kv_store_usage: float = 0.0
    kv_store_hits: int = 0
    kv_store_misses: int = 0
    # The store's disk tier (--disk-path), as the store counts it since it started: bytes
    # and block files held, blocks written, read back and evicted, files that failed checks.
    kv_store_disk_bytes: int = 0
    kv_store_disk_blocks: int = 0
    kv_store_disk_writes: int = 0
    kv_store_disk_reads: int = 0
    kv_store_disk_evictions: int = 0
    kv_store_disk_checksum_failures: int = 0
    # Latency targets: the step-time model's mean relative error |predicted - measured| /
    # measured (an EWMA over the measured steps; 0 before the first).
    step_time_prediction_error: float = 0.0
    # Prompt pins (scheduler/core/prompt_pins.py): distinct blocks pinned now; in this step,
    # pinned prefixes found whole in the cache (hits) or not (misses) per TTL class, pins
    # whose TTL passed, and pins that yielded to the budget or to a request's blocks.
    num_pinned_blocks: int = 0
    pin_hits: dict[str, int] = {}
    pin_misses: dict[str, int] = {}
    num_pins_expired: int = 0
    num_pins_yielded: int = 0


class EngineCoreOutputs(msgspec.Struct, **_HOT):
    outputs: list[EngineCoreOutput] = []
    scheduler_stats: SchedulerStats | None = None
    timestamp: float = 0.0  # time.monotonic() in the engine core when the step ended
    engine_index: int = 0


# --------------------------------------------------------------------------- scheduler -> worker


class NewRequestData(msgspec.Struct, **_HOT):
    """A request the worker has not seen (or sees again after a preemption), in full."""

    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    # With G KV cache groups (shared/kv_cache_groups.py): G equal slices, group-major.
    block_ids: list[int]
    num_computed_tokens: int
    output_token_ids: list[int] = []  # non-empty when resumed after preemption
    eos_token_id: int | None = None  # the sampler hides it until min_tokens are out
    lora_request: LoRARequest | None = None  # the adapter the worker runs it with
    mm_inputs: list[ImageInput] = []  # the prompt's images (their encoder runs in the worker)


class CachedRequestData(msgspec.Struct, **_HOT):
    """Running requests the worker already holds: parallel lists, one entry per request."""

    req_ids: list[str] = []
    new_block_ids: list[list[int]] = []  # blocks appended in this step (group-major)
    num_computed_tokens: list[int] = []


class SpecDecodeMetadata(msgspec.Struct, **_HOT):
    """Speculative decoding's part of one step (services/scheduler/core/spec_scheduler.py).

    draft_token_ids: the drafts each request verifies in this step (they follow its known
    tokens and are counted in num_scheduled_tokens). num_to_propose: how many drafts each
    request's proposer makes after the step (absent: none).
    """

    draft_token_ids: dict[str, list[int]] = {}
    num_to_propose: dict[str, int] = {}


class SchedulerOutput(msgspec.Struct, **_HOT):
    """One step's plan: a diff against what the workers already hold."""

    scheduled_new_reqs: list[NewRequestData] = []
    scheduled_cached_reqs: CachedRequestData = msgspec.field(default_factory=CachedRequestData)
    num_scheduled_tokens: dict[str, int] = {}
    total_num_scheduled_tokens: int = 0
    finished_req_ids: list[str] = []  # finished or aborted since the last step: drop state
    preempted_req_ids: list[str] = []  # preempted in this step: drop state, resent later
    # Structured outputs: the requests that sample under a grammar in this step, and their
    # allowed next tokens, one row each in that order: ceil(vocab_size / 32) little-endian
    # int32 words per row, bit j of word w allowing token 32 * w + j. Raw bytes keep the
    # ring message compact (a numpy view on the worker side, no per-token Python objects).
    grammar_req_ids: list[str] = []
    grammar_bitmask: bytes = b""
    # Requests whose token in this step is decided already (a thinking budget spent: the
    # next end-of-thinking token): the sampler allows that token alone.
    forced_token_ids: dict[str, int] = {}
    # Some scheduled request is an embedding (SamplingParams.pooling): the runner pools.
    has_pooling: bool = False
    # Speculative decoding: the drafts verified in this step and the drafts to propose.
    spec_decode: SpecDecodeMetadata = msgspec.field(default_factory=SpecDecodeMetadata)
    # KV connector: opaque to the core, built by the scheduler-side connector and read by
    # the worker-side one (services/kv_store/connector.py); empty: nothing to move.
    kv_connector_metadata: bytes = b""
    # Images whose vision encoder runs in this step: request id -> indices into its
    # mm_inputs (services/scheduler/core/encoder_budget.py). The worker keeps each output
    # until the request's computed tokens pass the image's end (the scheduler frees its
    # budget by the same rule).
    scheduled_encoder_inputs: dict[str, list[int]] = {}

    @property
    def is_empty(self) -> bool:
        """Nothing to compute and nothing for the workers to drop or move."""
        return not (
            self.total_num_scheduled_tokens
            or self.finished_req_ids
            or self.preempted_req_ids
            or self.kv_connector_metadata
        )


class ModelRunnerOutput(msgspec.Struct, **_HOT):
    """Rank 0's answer to one SchedulerOutput."""

    req_ids: list[str] = []
    # One list per req_ids entry; empty for a request whose prompt chunk did not reach the end.
    sampled_token_ids: list[list[int]] = []
    logprobs: dict[str, Logprobs] = {}
    prompt_logprobs: dict[str, Logprobs] = {}
    # Speculative decoding: each request's drafts for its next step (absent: none).
    spec_token_ids: dict[str, list[int]] = {}
    # KV connector: the worker-side connector's answer to kv_connector_metadata (opaque).
    kv_connector_output: bytes = b""
    # Embedding requests whose prompt finished in this step: their pooled vectors (float32).
    pooled: dict[str, bytes] = {}


# --------------------------------------------------------------------------- worker -> executor


class WorkerReady(msgspec.Struct, frozen=True):
    """What the executor itself needs of a rank once its model is loaded. Every other fact
    the worker learns at start-up (GEMM plan, step costs, KV layout) the engine core asks for
    by name, through Executor.collective_rpc (a WorkerCall)."""

    rank: int
    pid: int
    max_model_len: int
    num_blocks: int  # KV blocks that fit this rank's memory budget


class WorkerCall(msgspec.Struct, frozen=True, array_like=True):
    """Run the public Worker method `method` on the ranks listed (Executor.collective_rpc).

    The arguments travel as plain msgpack values; the worker converts each to its
    parameter's annotated type (Worker.call)."""

    method: str
    args: list[Any]
    kwargs: dict[str, Any]
    ranks: list[int]  # global ranks that run it and answer, in the caller's order


class WorkerCallResult(msgspec.Struct, frozen=True, array_like=True):
    """One rank's answer to a WorkerCall: the method's return value, msgpack-encoded, which
    the caller decodes as the type it expects."""

    rank: int
    result: msgspec.Raw


class WorkerFailure(msgspec.Struct, frozen=True):
    """A worker's last word before it exits on an exception."""

    rank: int
    message: str  # the formatted traceback


# ---- kv_store: the KV-cache store's control socket (services/kv_store/) ---------------------
#
# Client DEALER -> store ROUTER: [KvStoreRequest payload, *data frames]; the store answers on
# the same socket with [KvStoreReply payload, *data frames]. Every request but KvRelease carries
# a call_id that its reply echoes, so a client drops the late reply of a call it gave up on.
# Both unions are tagged and array_like (msgspec needs one or the other for every member).

# Bytes per element of the KV-cache dtypes a store can hold (torch dtype names, no torch here).
KV_DTYPE_BYTES = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "int8": 1,
    "uint8": 1,
}


class KvFingerprint(msgspec.Struct, frozen=True, kw_only=True):
    """The layout of one TP rank's KV blocks: blocks are shared only under equal layouts.

    A store block (a slot) holds one block's K and V for every layer of one TP rank, laid out
    [num_layers, num_planes, block_size * num_kv_heads * head_size] in `dtype`: two planes (K
    and V) for full attention, one for a latent cache (MLA: num_kv_heads 1, head_size the
    latent plus the rope key).
    """

    model: str
    dtype: str  # a torch dtype name: "float32", "bfloat16", ...
    block_size: int
    num_layers: int
    num_kv_heads: int  # on this TP rank
    head_size: int
    tp_rank: int = 0
    num_planes: int = 2

    def __post_init__(self) -> None:
        if self.dtype not in KV_DTYPE_BYTES:
            raise ValueError(
                f"KV store dtype {self.dtype!r} is not one of {sorted(KV_DTYPE_BYTES)}"
            )
        sizes = (
            self.block_size,
            self.num_layers,
            self.num_kv_heads,
            self.head_size,
            self.num_planes,
        )
        if min(sizes) < 1 or self.tp_rank < 0:
            raise ValueError(f"a KV layout needs positive sizes and tp_rank >= 0: {self}")

    @property
    def block_elements(self) -> int:
        """Elements of one layer's K (or V, or latent) of one block."""
        return self.block_size * self.num_kv_heads * self.head_size

    @property
    def block_bytes(self) -> int:
        """Bytes of one store slot: every plane (K and V) of every layer."""
        return self.num_planes * self.num_layers * self.block_elements * KV_DTYPE_BYTES[self.dtype]

    def key(self) -> bytes:
        """16 bytes naming this layout, the same in every process and on every machine."""
        import hashlib

        return hashlib.sha256(msgspec.msgpack.encode(self)).digest()[:16]


class KvHostArenaHandle(msgspec.Struct, frozen=True):
    """A store pool's slots in POSIX shared memory (/dev/shm/<shm_name>), for clients on the
    store's host; slot i is bytes [i * slot_bytes, (i + 1) * slot_bytes)."""

    shm_name: str
    num_slots: int
    slot_bytes: int


class KvCudaArenaHandle(msgspec.Struct, frozen=True):
    """A store pool's slots in CUDA memory, exported with CUDA IPC (the fields of torch's
    `UntypedStorage._share_cuda_()`, in its order); slot i as in KvHostArenaHandle."""

    device: int
    storage_handle: bytes
    storage_size_bytes: int
    storage_offset_bytes: int
    ref_counter_handle: bytes
    ref_counter_offset: int
    event_handle: bytes
    event_sync_required: bool
    num_slots: int
    slot_bytes: int


class KvHello(msgspec.Struct, tag="hello", array_like=True, frozen=True):
    """First call of a client: opens (or joins) the pool of `fingerprint`."""

    call_id: int
    fingerprint: KvFingerprint


class KvLookup(msgspec.Struct, tag="lookup", **_HOT):
    """How many of `block_hashes`, from the first, the store holds (committed)."""

    call_id: int
    pool_id: bytes
    block_hashes: list[bytes]


class KvReserve(msgspec.Struct, tag="reserve", **_HOT):
    """Put, phase 1 (arena): lease slots for the blocks of `block_hashes` not held yet."""

    call_id: int
    pool_id: bytes
    block_hashes: list[bytes]


class KvCommit(msgspec.Struct, tag="commit", **_HOT):
    """Put, phase 2 (arena): the client wrote the leased slots; make the blocks visible."""

    call_id: int
    lease_id: int


class KvPut(msgspec.Struct, tag="put", **_HOT):
    """Put in one call (frames): one data frame follows, the blocks' bytes back to back."""

    call_id: int
    pool_id: bytes
    block_hashes: list[bytes]


class KvGet(msgspec.Struct, tag="get", **_HOT):
    """The held prefix of `block_hashes`: its slots, pinned under a lease (KvLease), or with
    `as_frames` its bytes as data frames (KvCount)."""

    call_id: int
    pool_id: bytes
    block_hashes: list[bytes]
    as_frames: bool = False


class KvPin(msgspec.Struct, tag="pin", **_HOT):
    """Pin the held prefix of `block_hashes` against eviction until KvRelease (or `ttl_s`,
    the store's lease timeout when None)."""

    call_id: int
    pool_id: bytes
    block_hashes: list[bytes]
    ttl_s: float | None = None


class KvRelease(msgspec.Struct, tag="release", **_HOT):
    """End a lease without commit (unpin, a get's copy done, an aborted put). No reply."""

    lease_id: int


class KvStatsQuery(msgspec.Struct, tag="stats", array_like=True, frozen=True):
    call_id: int


class KvShutdown(msgspec.Struct, tag="shutdown", array_like=True, frozen=True):
    """Stop the store cleanly (it answers KvCount(0) first)."""

    call_id: int


KvStoreRequest = (
    KvHello
    | KvLookup
    | KvReserve
    | KvCommit
    | KvPut
    | KvGet
    | KvPin
    | KvRelease
    | KvStatsQuery
    | KvShutdown
)


class KvStoreStats(msgspec.Struct, frozen=True, kw_only=True):
    """What a store holds and has moved since it started (all pools together).

    hits / misses count blocks asked for by lookups and gets: the held prefix, the rest.
    """

    num_blocks: int  # committed blocks held
    capacity_bytes: int
    used_bytes: int  # committed and reserved blocks
    num_pinned: int  # committed blocks under a pin or a get's lease
    num_reserved: int  # slots leased to puts, not committed yet
    num_leases: int
    num_pools: int
    hits: int = 0
    misses: int = 0
    num_evicted: int = 0
    bytes_in: int = 0
    bytes_out: int = 0
    # The disk tier (--disk-path; all 0 without one). disk_hits: blocks read back (promoted)
    # from disk; disk_checksum_failures: files found torn, truncated, corrupted or foreign;
    # disk_dropped: spills or pin writes that found no room (or a backed-up writer).
    disk_capacity_bytes: int = 0
    disk_blocks: int = 0  # files held (written or being written)
    disk_bytes: int = 0  # their bytes, headers included
    disk_pinned: int = 0  # of them, pinned with a TTL
    disk_hits: int = 0
    disk_spills: int = 0
    disk_writes: int = 0  # block files written whole (spills and pins)
    disk_evictions: int = 0  # unpinned block files deleted to make room
    disk_checksum_failures: int = 0
    disk_expirations: int = 0
    disk_dropped: int = 0
    disk_pending_writes: int = 0  # queued for the writer thread


class KvHelloReply(msgspec.Struct, tag="hello_reply", array_like=True, frozen=True):
    """The pool of a KvHello: `pool_id` names it in later calls (it changes when the store
    restarts, so a stale id is refused instead of reaching a new arena's slots)."""

    call_id: int
    pool_id: bytes
    capacity_bytes: int
    host_arena: KvHostArenaHandle | None = None
    cuda_arena: KvCudaArenaHandle | None = None


class KvCount(msgspec.Struct, tag="count", **_HOT):
    """A number of blocks: held (lookup), now stored (commit, put), sent (frames get: the
    data frames follow, each a run of whole blocks, in order)."""

    call_id: int
    num_blocks: int


class KvLease(msgspec.Struct, tag="lease", **_HOT):
    """Slots under a lease (reserve, get, pin), one per block from the first hash; a shorter
    list when the rest is not held (get, pin) or does not fit (reserve). In a reserve, -1
    marks a block the store holds already (nothing to write)."""

    call_id: int
    lease_id: int
    slots: list[int]


class KvStatsReply(msgspec.Struct, tag="stats_reply", array_like=True, frozen=True):
    call_id: int
    stats: KvStoreStats


class KvErrorCode(enum.IntEnum):
    UNKNOWN_POOL = 1  # the store restarted (or never saw this pool): say hello again
    BAD_REQUEST = 2  # a malformed request or data frame; the message says what


class KvError(msgspec.Struct, tag="error", array_like=True, frozen=True):
    call_id: int
    code: KvErrorCode
    message: str


KvStoreReply = KvHelloReply | KvCount | KvLease | KvStatsReply | KvError
