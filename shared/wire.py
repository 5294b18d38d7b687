"""The engine socket protocol: message types and the structs only the transport uses.

Frames of one message, api <-> engine core:

    ROUTER/DEALER (api -> engine):  [identity], type byte, msgpack payload, *array frames
    PUSH/PULL     (engine -> api):  type byte, msgpack payload, *array frames

Each type has exactly one payload type (`PAYLOAD_TYPES`), decoded by a typed Decoder. Utility
calls are RPCs on the same channel: the method is a tagged struct (its tag is the method
name, its fields the arguments), so they decode as typed as everything else.
"""

from __future__ import annotations

import enum
import socket

import msgspec

from kvserve.shared.messages import EngineCoreOutputs, EngineCoreRequest


class MsgType(enum.IntEnum):
    """The first frame of every message (one byte)."""

    # api -> engine core
    ADD = 0  # EngineCoreRequest
    ABORT = 1  # list of request ids
    UTILITY = 2  # UtilityCall
    FRONTEND_HEARTBEAT = 3  # no payload: the api lives (engines not its children watch it)
    TENANT_SERVICE = 4  # TenantService: the other engines' tenant counters (fair policy, DP)
    # engine core -> api
    READY = 10  # EngineReady, on the DEALER, once, before anything else
    OUTPUTS = 11  # EngineCoreOutputs, one per engine step
    UTILITY_OUTPUT = 12  # UtilityOutput
    HEARTBEAT = 13  # EngineHeartbeat, from the output thread every interval
    DEAD = 14  # EngineDead: the engine core failed and is exiting

    @property
    def frame(self) -> bytes:
        return _FRAMES[self]


_FRAMES = {t: bytes([t]) for t in MsgType}


# How an engine core words the refusal of a request past --max-waiting-requests (the start
# of the ERROR output's message); the api answers it with a 429.
QUEUE_FULL_ERROR = "queue full"


class EngineReady(msgspec.Struct, frozen=True, kw_only=True):
    """The READY message: what an engine core's start-up learned (never patched into its
    config), plus who to watch for liveness. The offline `LLM` reads the same struct."""

    engine_index: int
    num_blocks: int
    max_model_len: int
    block_size: int
    hostname: str  # pids below are only meaningful on this host
    pid: int
    worker_pids: list[int] = []
    # How the engine hashes prefix blocks, so a DP router can hash prompts the same way.
    enable_prefix_caching: bool = True
    prefix_caching_hash_algo: str = "sha256"
    # --max-logprobs: the api rejects requests for more logprobs per token (a 400).
    max_logprobs: int = 20
    # --max-waiting-requests: the api answers 429 once the engine's queue holds this many.
    max_waiting_requests: int = 4096
    # Every CacheConfig field and num_gpu_blocks, as strings: the labels of the api's
    # `kvserve:cache_config_info` (vLLM's vllm:cache_config_info).
    cache_config_info: dict[str, str] = {}
    # The CPU GEMM path of each linear layer shape ('float32:960x576' -> 'onednn'), measured
    # by the worker at start-up: the labels of `kvserve:gemm_path_info`.
    gemm_plan: dict[str, str] = {}
    # --kv-transfer-config's kv_role (kv_producer, kv_consumer, kv_both), None without KV
    # transfer: P/D serving sends prefills to producers and decodes to consumers.
    kv_role: str | None = None
    # --enable-sleep-mode: the api serves /sleep, /wake_up and /is_sleeping.
    enable_sleep_mode: bool = False


class EngineHeartbeat(msgspec.Struct, frozen=True, tag="heartbeat", array_like=True, gc=False):
    """Progress of the engine's busy loop, so the api tells a hung loop from a busy one.

    The output thread sends it every interval whatever the main loop does: silence means the
    process is gone, frozen or starved of CPU (shared/progress.py tells which); heartbeats
    with a frozen `num_iterations` and `idle=False` mean the loop is stuck (or in one very
    long step). The last fields came later: with defaults, so the peers before them decode.
    """

    engine_index: int
    num_iterations: int  # busy-loop iterations since start (inputs handled or a step run)
    num_steps: int  # engine steps since start
    idle: bool  # the loop is blocked waiting for input (nothing to do)
    num_unfinished_reqs: int
    # The engine process's ns on a CPU and waiting on a run queue, summed over its threads
    # (shared/progress.py; wait 0 where the kernel does not say).
    cpu_ns: int = 0
    wait_ns: int = 0


class EngineStats(msgspec.Struct, frozen=True, tag="stats", array_like=True):
    """Result of the `get_stats` utility: a consistent snapshot taken between steps."""

    num_blocks: int  # allocatable KV blocks (the null block excluded)
    num_free_blocks: int  # free or cached-but-unused blocks
    num_running_reqs: int
    num_waiting_reqs: int
    num_steps: int
    num_preemptions_total: int


class EngineDead(msgspec.Struct, frozen=True):
    """The sentinel an engine core sends before it exits on an error."""

    engine_index: int
    reason: str


# ------------------------------------------------------------------------------- utilities


class ResetPrefixCache(msgspec.Struct, frozen=True, tag="reset_prefix_cache"):
    """Forget cached prefixes; the result is False while requests still hold blocks."""


class GetStats(msgspec.Struct, frozen=True, tag="get_stats"):
    """Return an `EngineStats`."""


class Ping(msgspec.Struct, frozen=True, tag="ping"):
    """Answered by the busy loop itself (not an IO thread): an `EngineHeartbeat`."""


class Sleep(msgspec.Struct, frozen=True, tag="sleep"):
    """--enable-sleep-mode: free the KV cache (level 1; on CUDA the weights also move to
    pinned host memory) or the KV cache and the weights (level 2). The result is False while
    requests are in flight (nothing is freed)."""

    level: int


SLEEP_WEIGHTS = "weights"
SLEEP_KV_CACHE = "kv_cache"
SLEEP_TAGS = (SLEEP_WEIGHTS, SLEEP_KV_CACHE)  # in the order a wake_up restores them


def check_sleep_tags(tags: list[str] | None) -> list[str]:
    """The tags a wake_up restores, in the order it must restore them (None: all)."""
    if tags is None:
        return list(SLEEP_TAGS)
    unknown = [t for t in tags if t not in SLEEP_TAGS]
    if unknown:
        raise ValueError(f"unknown wake_up tags {unknown}: use {' and/or '.join(SLEEP_TAGS)}")
    return [t for t in SLEEP_TAGS if t in tags]


class WakeUp(msgspec.Struct, frozen=True, tag="wake_up"):
    """Restore what Sleep freed: `tags` among "weights" and "kv_cache" (None: both)."""

    tags: list[str] | None = None


class IsSleeping(msgspec.Struct, frozen=True, tag="is_sleeping"):
    """True while anything Sleep freed is not restored."""


UtilityMethod = ResetPrefixCache | GetStats | Ping | Sleep | WakeUp | IsSleeping
UtilityResult = bool | EngineStats | EngineHeartbeat | None


class UtilityCall(msgspec.Struct, frozen=True, array_like=True):
    call_id: int
    method: UtilityMethod

    @property
    def method_name(self) -> str:
        tag = type(self.method).__struct_config__.tag
        assert isinstance(tag, str), "every UtilityMethod is tagged with its name"
        return tag


class UtilityOutput(msgspec.Struct, frozen=True, array_like=True, omit_defaults=True):
    call_id: int
    failure_message: str | None = None
    result: UtilityResult = None


class TenantService(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """The tenant counters of every other engine core, summed: api -> engine core, as load
    tables arrive, so the fair policy counts what a tenant got on the others."""

    remote: dict[str, float]


PAYLOAD_TYPES: dict[MsgType, type] = {
    MsgType.ADD: EngineCoreRequest,
    MsgType.ABORT: list[str],
    MsgType.UTILITY: UtilityCall,
    MsgType.FRONTEND_HEARTBEAT: type(None),
    MsgType.TENANT_SERVICE: TenantService,
    MsgType.READY: EngineReady,
    MsgType.OUTPUTS: EngineCoreOutputs,
    MsgType.UTILITY_OUTPUT: UtilityOutput,
    MsgType.HEARTBEAT: EngineHeartbeat,
    MsgType.DEAD: EngineDead,
}


# ------------------------------------------------------------ data parallelism (coordinator)


class EngineLoad(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """One engine core's queue lengths: engine -> coordinator, and a row of the load table."""

    engine_index: int
    num_waiting: int
    num_running: int
    # --scheduling-policy fair: this engine's virtual token counter per tenant
    # (services/scheduler/core/policies/fair_share.py); empty under the other policies.
    tenant_service: dict[str, float] = {}
    # The step-time model's predicted time until a request arriving now gets its first step
    # (services/scheduler/core/queue_delay.py), in ms: the api routes a request with a TTFT
    # target to an engine that can meet it (services/api/engine_client/slo_routing.py).
    predicted_queue_delay_ms: float = 0.0


class LoadTable(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """The coordinator's view of every engine that reported recently: coordinator -> api."""

    loads: list[EngineLoad]
    timestamp: float  # the coordinator's time.time() when it was published


class EngineRegistration(msgspec.Struct, frozen=True, kw_only=True):
    """A headless node's hello to the front end: which DP ranks it will run."""

    engine_indices: list[int]
    hostname: str


class EngineAssignment(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """The front end's answer to a registration: where its engines connect.

    `error` is set (and the addresses empty) when the front end refuses the ranks.
    """

    input_addr: str = ""
    output_addr: str = ""
    stats_addr: str | None = None
    error: str | None = None


def this_hostname() -> str:
    return socket.gethostname()
