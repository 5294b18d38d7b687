"""Every environment variable kvserve reads, typed and documented in one place.

Read them at the edges (process start-up, a client's constructor), never deep in a hot loop.
A malformed value is a ValueError that names the variable, not a silent default.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")


class EnvVar(Generic[T]):
    """One environment variable with its type, default and meaning.

    Args:
        name: the variable's name.
        default: the value when it is unset or empty.
        parse: turns the text into the value; its exceptions become a ValueError.
        doc: what the variable controls (for help text and readers).
    """

    def __init__(self, name: str, default: T, parse: Callable[[str], T], doc: str):
        self.name = name
        self.default = default
        self.parse = parse
        self.doc = doc

    def get(self) -> T:
        text = os.environ.get(self.name, "").strip()
        if not text:
            return self.default
        try:
            return self.parse(text)
        except ValueError as exc:
            raise ValueError(
                f"environment variable {self.name}={text!r} is invalid ({exc}); {self.doc}"
            ) from None


def _positive_float(text: str) -> float:
    value = float(text)
    if value <= 0:
        raise ValueError("must be > 0")
    return value


def _flag(text: str) -> bool:
    value = text.lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise ValueError("must be 1/true/yes/on or 0/false/no/off")


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise ValueError("must be >= 0")
    return value


def read_hung_timeout_s(hung: EnvVar[float], heartbeat: EnvVar[float]) -> float:
    """The value of `hung`, the budget that follows the silence `heartbeat` allows, so it
    must be at least as long.

    Raises:
        ValueError: it is shorter than the heartbeat timeout.
    """
    hung_s, heartbeat_s = hung.get(), heartbeat.get()
    if hung_s < heartbeat_s:
        raise ValueError(
            f"{hung.name}={hung_s:g} is shorter than {heartbeat.name}={heartbeat_s:g}: a "
            f"process is declared hung only after it was silent for the heartbeat timeout; "
            f"raise {hung.name}"
        )
    return hung_s


def _positive_int(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise ValueError("must be > 0")
    return value


ENGINE_HEARTBEAT_INTERVAL_S = EnvVar(
    "KVSERVE_ENGINE_HEARTBEAT_INTERVAL_S",
    0.5,
    _positive_float,
    "seconds between an engine core's heartbeats to the api (a positive number)",
)
ENGINE_HEARTBEAT_TIMEOUT_S = EnvVar(
    "KVSERVE_ENGINE_HEARTBEAT_TIMEOUT_S",
    3.0,
    _positive_float,
    "seconds without any message from an engine core before the api takes it for suspect: it "
    "gets no new requests while another engine serves, and keeps its running ones",
)
ENGINE_HUNG_TIMEOUT_S = EnvVar(
    "KVSERVE_ENGINE_HUNG_TIMEOUT_S",
    30.0,
    _positive_float,
    "seconds a silent engine core may go without progress (on this host: no CPU time used "
    "and no wait for a CPU, so a slow or starved engine is not hung; on another host: no "
    "message) before the api declares it hung and dead; at least "
    "KVSERVE_ENGINE_HEARTBEAT_TIMEOUT_S",
)
ENGINE_STALL_TIMEOUT_S = EnvVar(
    "KVSERVE_ENGINE_STALL_TIMEOUT_S",
    60.0,
    _positive_float,
    "seconds an engine loop may go without progress while it has work before /health "
    "reports 503 (one engine step must be shorter than this)",
)
ENGINE_READY_TIMEOUT_S = EnvVar(
    "KVSERVE_ENGINE_READY_TIMEOUT_S",
    600.0,
    _positive_float,
    "seconds the api waits for an engine core's ready message (model load + KV profile)",
)
FRONTEND_TIMEOUT_S = EnvVar(
    "KVSERVE_FRONTEND_TIMEOUT_S",
    30.0,
    _positive_float,
    "seconds an engine core that is not the api's child (headless, `kvserve engine`) runs "
    "on without a message from the api before it shuts down",
)
WORKER_HEARTBEAT_TIMEOUT_S = EnvVar(
    "KVSERVE_WORKER_HEARTBEAT_TIMEOUT_S",
    10.0,
    _positive_float,
    "seconds a worker process may go without beating before its engine core logs it as suspect",
)
WORKER_HUNG_TIMEOUT_S = EnvVar(
    "KVSERVE_WORKER_HUNG_TIMEOUT_S",
    30.0,
    _positive_float,
    "seconds a silent worker process may go without using CPU time or waiting for a CPU "
    "(stopped or blocked, e.g. SIGSTOP; a Ray rank, maybe on another node: silent) before "
    "its engine core fails; at least KVSERVE_WORKER_HEARTBEAT_TIMEOUT_S",
)
RAY_ADDRESS = EnvVar(
    "RAY_ADDRESS",
    None,
    str,
    "the Ray cluster the ray executor joins, HOST:PORT of its head (Ray's own variable; "
    "default: the cluster `ray start` last started on this node)",
)
OMP_NUM_THREADS = EnvVar(
    "OMP_NUM_THREADS",
    None,
    _positive_int,
    "torch CPU threads of the engine process (default: every core the process may use)",
)
CPU_THREADS_BIND = EnvVar(
    "KVSERVE_CPU_THREADS_BIND",
    False,
    _flag,
    "pin each torch OpenMP thread of a computing process (the uni engine, each mp worker) to "
    "one core of its share of the host, as vLLM's VLLM_CPU_OMP_THREADS_BIND does (default off)",
)
NATIVE_DECODE_ROWS = EnvVar(
    "KVSERVE_NATIVE_DECODE_ROWS",
    128,
    _non_negative_int,
    "steps of up to this many requests (one token each, or 1 + k under speculative decoding) "
    "run a dense model's whole layer stack in one C call on the CPU (kernels/decode_stack.py; "
    "bench/RESULTS.md measures it); 0 turns it off. Each token's result is computed alone, so "
    "it is bit for bit the same whatever shares its step. The start-up measurement "
    "(KVSERVE_NATIVE_DECODE_MEASURE) cuts it to the counts where the stack wins: ~8 for "
    "bfloat16 weights on an AMX CPU, all 128 for W8A8 weights on AMX-INT8 tiles",
)
NATIVE_DECODE_MEASURE = EnvVar(
    "KVSERVE_NATIVE_DECODE_MEASURE",
    True,
    _flag,
    "time decode steps of 1, 2, 4, ... requests (up to KVSERVE_NATIVE_DECODE_ROWS) on the "
    "native decode stack and on the modules at start-up, and keep the stack to the counts "
    "where it is not slower (with AMX, oneDNN's bfloat16 tiles beat it from ~10 requests); "
    "off: the stack takes every step of up to KVSERVE_NATIVE_DECODE_ROWS requests",
)
PRELOAD_ALLOCATOR = EnvVar(
    "KVSERVE_PRELOAD_ALLOCATOR",
    True,
    _flag,
    "on a host without an NVIDIA device, start the engine core and worker processes with "
    "tcmalloc (or jemalloc) in LD_PRELOAD where the system has it, as vLLM-CPU asks its users "
    "to (kvserve/launch/allocator.py); off: glibc's malloc",
)
PREFILL_ROUTE_MEASURE = EnvVar(
    "KVSERVE_PREFILL_ROUTE_MEASURE",
    True,
    _flag,
    "time first prefill chunks of 32..1024 tokens through the CPU decode kernel and through "
    "torch's flash attention at start-up, and send chunks up to the longest the decode kernel "
    "still won to it (kernels/prefill_route.py: measure_prefill_route); off: the defaults "
    "(bfloat16: 63 tokens with AMX, 1024 without; float32: 512)",
)
CPU_GEMM_MEASURE = EnvVar(
    "KVSERVE_CPU_GEMM_MEASURE",
    True,
    _flag,
    "with --cpu-gemm auto, time each linear layer's shape on every CPU GEMM path at start-up "
    "(or reuse this machine's cached timings) and run each on the fastest (kernels/gemm.py); "
    "off: every shape runs torch's own path, untimed (what --cpu-gemm torch forces)",
)
API_KEY = EnvVar(
    "KVSERVE_API_KEY",
    None,
    str,
    "bearer token /v1/* requires when --api-key is not given (vLLM's VLLM_API_KEY)",
)
VLLM_API_KEY = EnvVar(
    "VLLM_API_KEY",
    None,
    str,
    "vLLM's name for the bearer token, read when neither --api-key nor KVSERVE_API_KEY is set",
)
CACHE_DIR = EnvVar(
    "KVSERVE_CACHE_DIR",
    os.path.join(os.path.expanduser("~"), ".cache", "kvserve"),
    str,
    "folder for converted models and built CPU kernels (default ~/.cache/kvserve)",
)
QUANT_ACTIVATIONS = EnvVar(
    "KVSERVE_QUANT_ACTIVATIONS",
    "int8",
    str,
    "activations of the CPU matmul over weights held quantized: int8 (quantized in blocks "
    "of 32, integer dot products, as llama.cpp) or float32 (weight tiles expanded in the "
    "kernel: the float32 expansion's numbers, slower)",
)
HF_HUB_CACHE = EnvVar(
    "HF_HUB_CACHE",
    None,
    str,
    "Hugging Face hub cache that hub ids (org/name) are looked up in, offline (default: "
    "$HF_HOME/hub, else ~/.cache/huggingface/hub)",
)
HF_HOME = EnvVar(
    "HF_HOME",
    os.path.join(os.path.expanduser("~"), ".cache", "huggingface"),
    str,
    "Hugging Face's home folder; its hub/ is the hub cache unless HF_HUB_CACHE is set",
)
TRANSPORT_KEYS = EnvVar(
    "KVSERVE_TRANSPORT_KEYS",
    None,
    str,
    "folder of the deployment's CURVE keypair (`kvserve keys generate DIR`): every tcp:// "
    "socket between kvserve processes is encrypted and admits only holders of it; "
    "--transport-keys sets it for the processes a command starts",
)
INSECURE_TRANSPORT = EnvVar(
    "KVSERVE_INSECURE_TRANSPORT",
    False,
    _flag,
    "1 allows tcp:// sockets without keys (plain text, no authentication); "
    "--insecure-transport sets it for the processes a command starts",
)
FAULT_POISON_TOKEN_ID = EnvVar(
    "KVSERVE_FAULT_POISON_TOKEN_ID",
    None,
    int,
    "tests only: an engine core kills itself (SIGKILL) on a request whose prompt holds this "
    "token id, as a request that crashes every engine it lands on would (a poison request)",
)

PROMPT_CACHE_TTL_SCALE = EnvVar(
    "KVSERVE_PROMPT_CACHE_TTL_SCALE",
    1.0,
    _positive_float,
    "tests only: the api multiplies every prompt-cache TTL (cache_control's 5m / 1h, "
    "prompt_cache_retention's 24h) by this factor, so a test sees a pin expire in seconds",
)


def _step_costs(text: str) -> list[tuple[int, float]]:
    """'1:0.02,8:0.025,64:0.09' -> [(1, 0.02), (8, 0.025), (64, 0.09)]."""
    pairs = []
    for item in text.split(","):
        tokens, _, seconds = item.partition(":")
        pairs.append((_positive_int(tokens), _positive_float(seconds)))
    return pairs


SPEC_STEP_COSTS = EnvVar(
    "KVSERVE_SPEC_STEP_COSTS",
    None,
    _step_costs,
    "query tokens:seconds pairs (1:0.02,8:0.025,64:0.09): adaptive speculative decoding "
    "weighs drafts against these step costs instead of timing verify steps of 1, 2, 4, ... "
    "256 tokens at start-up (three rounds: over a dozen CPU seconds for the default model). "
    "Tests set it, so the rule's choices do not depend on the machine or its load",
)
