"""Per-request timings and per-step figures for the api's metrics, as vLLM V1 computes them.

Two clocks, never mixed: `arrival_time` and `now` are time.monotonic() in the api process;
every `*_ts` is time.monotonic() in the engine core process (an `EngineCoreEvent`'s or an
`EngineCoreOutputs`' timestamp). Each figure is a difference within one clock:

    api     arrival ──────────── TTFT ───────────▶ first output ─── ... ───▶ last output
            └───────────────────────────── e2e latency ────────────────────────────┘
    engine     queued ─ queue ─▶ scheduled ─ prefill ─▶ first token ─ decode ─▶ last token
                                 └────────────────── inference ─────────────────┘

The engine times are those of the steps that produced the tokens (the end of each step),
and "scheduled" is the first schedule: a preempted request's later waits count as inference.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvserve.shared.messages import EngineCoreEventType, EngineCoreOutput


@dataclass(slots=True)
class RequestTimes:
    """What one engine request (one child of an n > 1 request) has seen so far."""

    arrival_time: float  # api clock: when the api took the request in
    # Its latency targets in ms (None: none the api knows of; serving/latency_targets.py).
    ttft_target_ms: float | None = None
    tpot_target_ms: float | None = None
    first_output_time: float | None = None  # api clock: its first token's output arrived
    queued_ts: float | None = None  # engine clock, from here on
    scheduled_ts: float | None = None  # the first time only
    first_token_ts: float | None = None
    last_token_ts: float | None = None
    num_generation_tokens: int = 0
    num_preemptions: int = 0  # PREEMPTED events seen
    num_cached_tokens: int = 0  # prompt tokens the prefix cache or the KV store served


@dataclass(frozen=True, slots=True)
class PhaseTimes:
    """A finished request's time in each engine phase, in seconds."""

    queued_time: float  # queued -> first scheduled
    prefill_time: float  # first scheduled -> first token
    decode_time: float  # first token -> last token
    inference_time: float  # first scheduled -> last token

    @staticmethod
    def of(times: RequestTimes) -> PhaseTimes | None:
        """None unless the request was queued, scheduled and produced a token."""
        if (
            times.queued_ts is None
            or times.scheduled_ts is None
            or times.first_token_ts is None
            or times.last_token_ts is None
        ):
            return None
        return PhaseTimes(
            queued_time=times.scheduled_ts - times.queued_ts,
            prefill_time=times.first_token_ts - times.scheduled_ts,
            decode_time=times.last_token_ts - times.first_token_ts,
            inference_time=times.last_token_ts - times.scheduled_ts,
        )


@dataclass(frozen=True, slots=True)
class FinishedRequestStats:
    """One finished engine request, as the per-request histograms observe it."""

    finish_reason: str  # "stop", "length", "abort" or "error"
    e2e_latency: float  # api clock
    num_prompt_tokens: int
    num_generation_tokens: int
    max_tokens_param: int | None
    phases: PhaseTimes | None  # None for a request that never produced a token
    tenant: str = "default"
    num_preemptions: int = 0
    num_cached_tokens: int = 0
    # api clock: arrival -> its first token's output (None: it produced none).
    time_to_first_token: float | None = None
    ttft_target_ms: float | None = None
    tpot_target_ms: float | None = None

    @property
    def mean_time_per_output_token(self) -> float | None:
        """Decode time over the tokens after the first; None below two tokens."""
        if self.phases is None or self.num_generation_tokens < 2:
            return None
        return self.phases.decode_time / (self.num_generation_tokens - 1)


@dataclass(frozen=True, slots=True)
class RequestUsage:
    """What one api request (one prompt and its n choices) used, counted as its response's
    `usage` counts: the prompt once, the tokens of every choice.

    Args:
        tenant: who it was served for.
        num_prompt_tokens: the prompt's length (`usage.prompt_tokens`).
        num_completion_tokens: the tokens of all its choices (`usage.completion_tokens`);
            those made before the client went away for an aborted request.
        finish_reasons: one per choice ("abort" for a choice the client left unfinished).
    """

    tenant: str
    num_prompt_tokens: int
    num_completion_tokens: int
    finish_reasons: tuple[str, ...]


@dataclass(slots=True)
class IterationStats:
    """What one EngineCoreOutputs message (one engine step) did to the api's requests.

    Args:
        now: api clock when the message was processed.
        engine_timestamp: engine clock when the step ended.
    """

    now: float
    engine_timestamp: float
    num_prompt_tokens: int = 0  # prompts of the requests that got their first token
    num_generation_tokens: int = 0
    # Of those prompts, the tokens a cache served (vLLM's prompt_tokens_cached).
    num_cached_prompt_tokens: int = 0
    time_to_first_tokens: list[float] = field(default_factory=list)
    first_token_tenants: list[str] = field(default_factory=list)  # parallel to the above
    inter_token_latencies: list[float] = field(default_factory=list)
    finished_requests: list[FinishedRequestStats] = field(default_factory=list)
    # One entry per finished api request (all its n children done): its longest child.
    max_num_generation_tokens: list[int] = field(default_factory=list)
    n_params: list[int] = field(default_factory=list)
    # Engine requests whose client went away (request_success{finished_reason="abort"}).
    num_aborted: int = 0
    # One entry per api request that ended (finished or aborted): the per-tenant usage.
    request_usages: list[RequestUsage] = field(default_factory=list)

    def observe_output(
        self,
        times: RequestTimes,
        output: EngineCoreOutput,
        num_prompt_tokens: int,
        tenant: str = "default",
    ) -> None:
        """Take one engine request's output of this step: its events, then its tokens."""
        for event in output.events or ():
            if event.type == EngineCoreEventType.QUEUED:
                times.queued_ts = event.timestamp
            elif event.type == EngineCoreEventType.SCHEDULED and times.scheduled_ts is None:
                times.scheduled_ts = event.timestamp
            elif event.type == EngineCoreEventType.PREEMPTED:
                times.num_preemptions += 1
        if output.num_cached_tokens:  # the request's first output only
            times.num_cached_tokens = output.num_cached_tokens
        num_new_tokens = len(output.new_token_ids)
        # A pooling request's one output (an embedding, a score) ends its prompt as a first
        # token would: its prompt counts, and its time to that output (as vLLM counts them).
        if num_new_tokens == 0 and (output.pooled is None or times.first_token_ts is not None):
            return
        if times.first_token_ts is None:
            self.num_prompt_tokens += num_prompt_tokens
            self.num_cached_prompt_tokens += times.num_cached_tokens
            self.time_to_first_tokens.append(self.now - times.arrival_time)
            self.first_token_tenants.append(tenant)
            times.first_output_time = self.now
            times.first_token_ts = self.engine_timestamp
        else:
            assert times.last_token_ts is not None
            # Per output, not per token: a step that yields several tokens is one interval.
            self.inter_token_latencies.append(self.engine_timestamp - times.last_token_ts)
        times.last_token_ts = self.engine_timestamp
        times.num_generation_tokens += num_new_tokens
        self.num_generation_tokens += num_new_tokens

    def observe_finished(
        self,
        times: RequestTimes,
        finish_reason: str,
        num_prompt_tokens: int,
        max_tokens_param: int | None,
        tenant: str = "default",
    ) -> None:
        self.finished_requests.append(
            FinishedRequestStats(
                finish_reason=finish_reason,
                e2e_latency=self.now - times.arrival_time,
                num_prompt_tokens=num_prompt_tokens,
                num_generation_tokens=times.num_generation_tokens,
                max_tokens_param=max_tokens_param,
                phases=PhaseTimes.of(times),
                tenant=tenant,
                num_preemptions=times.num_preemptions,
                num_cached_tokens=times.num_cached_tokens,
                time_to_first_token=(
                    None
                    if times.first_output_time is None
                    else times.first_output_time - times.arrival_time
                ),
                ttft_target_ms=times.ttft_target_ms,
                tpot_target_ms=times.tpot_target_ms,
            )
        )

    def observe_finished_parent(self, n: int, max_num_generation_tokens: int) -> None:
        self.n_params.append(n)
        self.max_num_generation_tokens.append(max_num_generation_tokens)


# Why a request moved: the `reason` of kvserve:request_migrations_total (migration.death_kind).
MIGRATION_REASONS = ("engine_died", "worker_died", "engine_hung", "engine_replaced")
# Seconds from an engine's death to a moved request's first output on its new engine.
RESUME_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)


@dataclass(slots=True)
class MigrationStats:
    """Counts for /metrics: moves by reason, and the resume-time histogram's buckets."""

    moves: dict[str, int] = field(default_factory=dict)
    quarantined: int = 0
    failed: int = 0
    resume_bucket_counts: list[int] = field(default_factory=lambda: [0] * len(RESUME_BUCKETS))
    resume_count: int = 0
    resume_sum_s: float = 0.0

    def observe_resume(self, seconds: float) -> None:
        self.resume_count += 1
        self.resume_sum_s += seconds
        for i, bound in enumerate(RESUME_BUCKETS):
            if seconds <= bound:
                self.resume_bucket_counts[i] += 1
