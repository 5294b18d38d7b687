"""User-facing results, shaped like vLLM's `RequestOutput` and `CompletionOutput`."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvserve.shared.messages import EngineSpan


@dataclass(slots=True)
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# One dict per position: token id -> Logprob (the chosen token and the top-n).
SampleLogprobs = list[dict[int, Logprob]]
PromptLogprobs = list[dict[int, Logprob] | None]


@dataclass(slots=True)
class CompletionOutput:
    """One of the n completions of a request.

    Args:
        index: which of the n completions this is.
        text: the generated text (stop string removed unless asked to keep it).
        token_ids: the generated token ids.
        cumulative_logprob: sum of the chosen tokens' logprobs, when logprobs were asked for.
        logprobs: per generated token, when asked for.
        finish_reason: "stop", "length", "abort", or None while running.
        stop_reason: the stop string or stop token id that ended it, if any.
        pooled: an embedding request's pooled, normalised vector (float32 bytes).
    """

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    cumulative_logprob: float | None = None
    logprobs: SampleLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    pooled: bytes | None = None  # an embedding request's vector (float32)

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestOutput:
    """
    Args:
        request_id: the request's id.
        prompt: the prompt text (None when given as token ids).
        prompt_token_ids: the tokenized prompt.
        prompt_logprobs: per prompt token (None for the first), when asked for.
        outputs: the n completions.
        finished: all n completions are done.
        num_cached_tokens: prompt tokens served from the prefix cache.
        engine_spans: a traced request's engine phases, per child (engine-core id, spans),
            in its finished output (services/api/observability/tracing.py); None otherwise.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    prompt_logprobs: PromptLogprobs | None = None
    num_cached_tokens: int = 0
    engine_spans: list[tuple[str, list[EngineSpan]]] | None = None
