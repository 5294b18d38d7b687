"""A traced request's phases inside the engine core, timed for --otlp-traces-endpoint.

Only requests that carry a trace context (EngineCoreRequest.trace_context) get a
RequestTrace; the scheduler skips all of this while none is running. The phases travel back
as EngineSpans in the request's last output, and the api turns them into OpenTelemetry spans
under the context the request carried (services/api/observability/tracing.py), as vLLM does: one
exporter, in the api.

    queued ─ engine.waiting ─▶ scheduled ─ engine.prefill (one per chunk) ─▶ ...
           ─ engine.decode (first decode step to the last) ─▶ finished
    preempted ─ engine.waiting (preempted=1) ─▶ scheduled again ─ engine.prefill ...
    parked for a KV load (a connector's external hit) ─ engine.kv_load ─▶ back in the queue

KV saves are not a phase: the connector saves blocks beside the steps, and the request does
not wait for them.
"""

from __future__ import annotations

from kvserve.shared.messages import EngineSpan


class RequestTrace:
    """The phases of one request; times are time.time_ns()."""

    __slots__ = (
        "spans",
        "waiting_since_ns",
        "num_preemptions",
        "step_start_ns",
        "step_is_prefill",
        "step_position",
        "step_num_tokens",
        "decode_start_ns",
        "decode_end_ns",
        "num_decode_steps",
        "load_start_ns",
        "load_num_blocks",
    )

    def __init__(self, queued_ns: int):
        self.spans: list[EngineSpan] = []
        self.waiting_since_ns: int | None = queued_ns
        self.num_preemptions = 0
        self.step_start_ns: int | None = None  # the step in flight, if any
        self.step_is_prefill = False
        self.step_position = 0
        self.step_num_tokens = 0
        self.decode_start_ns: int | None = None
        self.decode_end_ns = 0
        self.num_decode_steps = 0
        self.load_start_ns: int | None = None
        self.load_num_blocks = 0

    def scheduled(
        self, now_ns: int, num_computed_tokens: int, num_tokens: int, num_prompt_tokens: int
    ) -> None:
        """A step computes `num_tokens` of the request from position `num_computed_tokens`."""
        if self.waiting_since_ns is not None:
            attributes = {"preempted": 1} if self.num_preemptions else {}
            self.spans.append(
                EngineSpan("engine.waiting", self.waiting_since_ns, now_ns, attributes)
            )
            self.waiting_since_ns = None
        self.step_start_ns = now_ns
        self.step_is_prefill = num_computed_tokens < num_prompt_tokens
        self.step_position = num_computed_tokens
        self.step_num_tokens = num_tokens

    def step_done(self, now_ns: int) -> None:
        """The step scheduled last has its outputs."""
        if self.step_start_ns is None:
            return
        if self.step_is_prefill:
            attributes = {"position": self.step_position, "num_tokens": self.step_num_tokens}
            self.spans.append(EngineSpan("engine.prefill", self.step_start_ns, now_ns, attributes))
        else:
            if self.decode_start_ns is None:
                self.decode_start_ns = self.step_start_ns
            self.decode_end_ns = now_ns
            self.num_decode_steps += 1
        self.step_start_ns = None

    def preempted(self, now_ns: int) -> None:
        """Back to the waiting queue: its KV is freed and will be computed again."""
        self.step_start_ns = None
        self.waiting_since_ns = now_ns
        self.num_preemptions += 1

    def kv_load_started(self, now_ns: int, num_blocks: int) -> None:
        """Parked until a connector loads `num_blocks` blocks of its prefix."""
        self.load_start_ns = now_ns
        self.load_num_blocks = num_blocks

    def kv_load_done(self, now_ns: int, num_loaded_blocks: int) -> None:
        """The load ended: `num_loaded_blocks` arrived (the rest is recomputed)."""
        if self.load_start_ns is None:
            return
        attributes = {"num_blocks": self.load_num_blocks, "num_loaded_blocks": num_loaded_blocks}
        self.spans.append(EngineSpan("engine.kv_load", self.load_start_ns, now_ns, attributes))
        self.load_start_ns = None

    def finish(self) -> list[EngineSpan]:
        """Every phase, the decode steps as one span."""
        if self.decode_start_ns is not None:
            attributes = {"num_steps": self.num_decode_steps}
            self.spans.append(
                EngineSpan("engine.decode", self.decode_start_ns, self.decode_end_ns, attributes)
            )
            self.decode_start_ns = None
        return self.spans
