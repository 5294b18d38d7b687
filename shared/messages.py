"""Every message that crosses a process boundary, one msgspec Struct each.

Hot structs are `array_like` (encoded as arrays, not maps), `omit_defaults` and `gc=False`
(they hold no reference cycles, so the cyclic GC need not track them).
"""

from __future__ import annotations

import enum

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
    block_ids: list[int]
    num_computed_tokens: int
    output_token_ids: list[int] = []  # non-empty when resumed after preemption
    eos_token_id: int | None = None  # the sampler hides it until min_tokens are out
    lora_request: LoRARequest | None = None  # the adapter the worker runs it with


class CachedRequestData(msgspec.Struct, **_HOT):
    """Running requests the worker already holds: parallel lists, one entry per request."""

    req_ids: list[str] = []
    new_block_ids: list[list[int]] = []  # blocks appended in this step
    num_computed_tokens: list[int] = []


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

    @property
    def is_empty(self) -> bool:
        """Nothing to compute and nothing for the workers to drop."""
        return not (
            self.total_num_scheduled_tokens or self.finished_req_ids or self.preempted_req_ids
        )


class ModelRunnerOutput(msgspec.Struct, **_HOT):
    """Rank 0's answer to one SchedulerOutput."""

    req_ids: list[str] = []
    # One list per req_ids entry; empty for a request whose prompt chunk did not reach the end.
    sampled_token_ids: list[list[int]] = []
    logprobs: dict[str, Logprobs] = {}
    prompt_logprobs: dict[str, Logprobs] = {}


# --------------------------------------------------------------------------- worker -> executor


class WorkerReady(msgspec.Struct, frozen=True):
    """What a worker learned at start-up (never patched into the config)."""

    rank: int
    pid: int
    max_model_len: int
    num_blocks: int  # KV blocks that fit this rank's memory budget
    gemm_plan: dict[str, str] = {}  # 'float32:NxK' -> its CPU GEMM path (kernels/gemm.py)


class WorkerFailure(msgspec.Struct, frozen=True):
    """A worker's last word before it exits on an exception."""

    rank: int
    message: str  # the formatted traceback
