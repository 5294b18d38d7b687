"""Sampling parameters: the user-facing knobs of one request, validated at construction."""

from __future__ import annotations

import math
from typing import Any, Literal, NoReturn

import msgspec

from kvserve.shared.structured_outputs import StructuredOutputsParams

# OpenAI's bounds on a logit_bias value.
MAX_LOGIT_BIAS = 100.0
_FLOAT_FIELDS = (
    "temperature",
    "top_p",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
)


class _StrictKeywords(msgspec.StructMeta):
    """Turns an unknown keyword into a ValueError that names it, instead of a TypeError."""

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        unknown = sorted(set(kwargs) - set(cls.__struct_fields__))
        if unknown:
            raise ValueError(
                f"{cls.__name__}: unknown parameter(s) {unknown}; "
                f"valid ones are {sorted(cls.__struct_fields__)}"
            )
        return super().__call__(*args, **kwargs)


def _bad(field: str, value: object, why: str) -> NoReturn:
    """Refuse a field's value: `{field} {why}, got {value!r}`."""
    raise ValueError(f"{field} {why}, got {value!r}")


class SamplingParams(msgspec.Struct, metaclass=_StrictKeywords, kw_only=True, omit_defaults=True):
    """How to sample the tokens of one request (vLLM's names and defaults).

    Args:
        n: number of completions for the prompt; they share the prompt's KV blocks.
        temperature: 0 means greedy.
        top_p, top_k, min_p: nucleus, top-k (0 or -1 = off) and min-p filtering.
        presence_penalty, frequency_penalty: OpenAI-style additive penalties on output tokens.
        repetition_penalty: multiplicative penalty on prompt and output tokens (1 = off).
        seed: per-request seed; the same seed gives the same tokens whatever else is batched.
        max_tokens: new tokens to generate at most (None = up to max_model_len).
        min_tokens: EOS and stop tokens are suppressed before this many new tokens.
        stop: strings that end the output (not included in it).
        stop_token_ids: token ids that end the output (included in token_ids).
        ignore_eos: keep going past EOS.
        logprobs: number of top logprobs per sampled token (plus the sampled one), at most
            --max-logprobs.
        prompt_logprobs: number of top logprobs per prompt token, at most --max-logprobs.
        skip_special_tokens: drop special tokens from the text.
        include_stop_str_in_output: keep the matched stop string in the text.
        structured_outputs: a constraint the output must satisfy (JSON schema, regex, ...).
        logit_bias: token id -> bias added to its logit, in [-100, 100] (OpenAI's).
        allowed_token_ids: only these tokens may be sampled.
        bad_words: words that must not appear; the api (or LLM) tokenizes them into
            bad_words_token_ids, which the sampler reads.
        bad_words_token_ids: the token sequences of bad_words; the last token of a sequence
            is banned when the output ends with the ones before it.
        reasoning_end_token_ids: the tokens that end the model's thinking (a reasoning
            parser's end tag, tokenized by the api): until the output holds them, the request
            is thinking; structured outputs constrain only what follows them.
        thinking_token_budget: at most this many thinking tokens; then the engine forces
            reasoning_end_token_ids, one per step, and the answer follows (needs them).
        pooling: an embedding request: nothing is sampled; once the prompt is computed, its
            final hidden states are pooled ("last": the last token's; "mean": the mean over
            the prompt; "cls": the first token's; the last two need the prompt computed
            whole, no prefix-cache hit), passed through the model's classifier head if it
            has one (a cross-encoder's or classifier's logits), else L2 normalised when
            `normalize`, returned as EngineCoreOutput.pooled, and the request stops.
        normalize: L2-normalise the pooled vector (an embedding model's Normalize module).
        token_type_start: an encoder's pair input (a cross-encoder's query and document):
            the prompt tokens from this index on have token type 1 (vLLM's compressed
            token_type_ids); None: every token has type 0.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    structured_outputs: StructuredOutputsParams | None = None
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    bad_words_token_ids: list[list[int]] | None = None
    reasoning_end_token_ids: list[int] | None = None
    thinking_token_budget: int | None = None
    pooling: Literal["last", "mean", "cls"] | None = None
    normalize: bool = True
    token_type_start: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.top_k == -1:
            self.top_k = 0
        self._verify()

    def _verify(self) -> None:
        """Raise a ValueError naming the first field out of its range."""
        non_finite = non_finite_error(self)  # NaN passes every comparison below
        if non_finite is not None:
            raise ValueError(non_finite)
        self._verify_sampling()
        self._verify_lengths()
        self._verify_token_lists()
        self._verify_modes()

    def _verify_sampling(self) -> None:
        if self.n < 1:
            _bad("n", self.n, "must be at least 1")
        if self.temperature < 0.0:
            _bad("temperature", self.temperature, "must be non-negative")
        if not 0.0 < self.top_p <= 1.0:
            _bad("top_p", self.top_p, "must be in (0, 1]")
        if self.top_k < 0:
            _bad("top_k", self.top_k, "must be -1 (off), 0 (off) or positive")
        if not 0.0 <= self.min_p <= 1.0:
            _bad("min_p", self.min_p, "must be in [0, 1]")
        if not -2.0 <= self.presence_penalty <= 2.0:
            _bad("presence_penalty", self.presence_penalty, "must be in [-2, 2]")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            _bad("frequency_penalty", self.frequency_penalty, "must be in [-2, 2]")
        if self.repetition_penalty <= 0.0:
            _bad("repetition_penalty", self.repetition_penalty, "must be positive")

    def _verify_lengths(self) -> None:
        if self.max_tokens is not None and self.max_tokens < 1:
            _bad("max_tokens", self.max_tokens, "must be at least 1")
        if self.min_tokens < 0:
            _bad("min_tokens", self.min_tokens, "must be non-negative")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            _bad("min_tokens", self.min_tokens, f"must not exceed max_tokens={self.max_tokens}")
        # The upper bound is the engine's --max-logprobs, checked where requests come in.
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and value < 0:
                _bad(name, value, "must be non-negative")

    def _verify_token_lists(self) -> None:
        if self.stop is not None and any(not s for s in self.stop):
            _bad("stop", self.stop, "must not contain empty strings")
        if self.logit_bias and not all(abs(v) <= MAX_LOGIT_BIAS for v in self.logit_bias.values()):
            _bad("logit_bias", self.logit_bias, "values must be in [-100, 100]")
        if self.logit_bias and min(self.logit_bias) < 0:
            _bad("logit_bias", self.logit_bias, "keys must be token ids (>= 0)")
        if self.allowed_token_ids is not None and (
            not self.allowed_token_ids or min(self.allowed_token_ids) < 0
        ):
            _bad("allowed_token_ids", self.allowed_token_ids, "must list token ids (>= 0)")
        if self.bad_words is not None and any(not w.strip() for w in self.bad_words):
            _bad("bad_words", self.bad_words, "must not contain empty words")

    def _verify_modes(self) -> None:
        """Embedding (pooling) and thinking (reasoning) requests."""
        if self.pooling is not None and self.n != 1:
            _bad("n", self.n, "must be 1 for an embedding (pooling) request")
        if self.reasoning_end_token_ids is not None and (
            not self.reasoning_end_token_ids or min(self.reasoning_end_token_ids) < 0
        ):
            _bad("reasoning_end_token_ids", self.reasoning_end_token_ids, "must list token ids")
        if self.thinking_token_budget is not None:
            if self.thinking_token_budget < 0:
                _bad("thinking_token_budget", self.thinking_token_budget, "must be non-negative")
            if self.reasoning_end_token_ids is None:
                _bad(
                    "thinking_token_budget",
                    self.thinking_token_budget,
                    "needs reasoning_end_token_ids (a reasoning parser)",
                )

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    @property
    def all_stop_token_ids(self) -> set[int]:
        return set(self.stop_token_ids or ())

    @property
    def has_logits_processors(self) -> bool:
        """logit_bias, allowed_token_ids or bad words touch this request's logits."""
        return bool(self.logit_bias or self.allowed_token_ids or self.bad_words_token_ids)


def non_finite_error(params: SamplingParams) -> str | None:
    """The message naming the first float knob of params (temperature, top_p, min_p, the
    penalties) that is NaN or infinite; None when all are finite."""
    for name in _FLOAT_FIELDS:
        value = getattr(params, name)
        if not math.isfinite(value):
            return f"{name} must be a finite number, got {value!r}"
    return None


def token_ids_out_of_range(params: SamplingParams, vocab_size: int) -> tuple[str, str] | None:
    """(field, message) when logit_bias, allowed_token_ids or stop_token_ids name a token the
    vocabulary lacks; None when every id fits.

    Args:
        params: the request's sampling parameters.
        vocab_size: ids must be below this.
    """
    for field, ids in (
        ("logit_bias", params.logit_bias or ()),
        ("allowed_token_ids", params.allowed_token_ids or ()),
        ("stop_token_ids", params.stop_token_ids or ()),
        ("reasoning_end_token_ids", params.reasoning_end_token_ids or ()),
    ):
        if ids and max(ids) >= vocab_size:
            return field, f"{field} names token id {max(ids)}, not in [0, {vocab_size})"
    return None


def logprobs_over_limit(params: SamplingParams, max_logprobs: int) -> tuple[str, str] | None:
    """(field, message) when params ask for more logprobs per token than the engine allows
    (--max-logprobs), worded as vLLM words it; None when they fit.

    Args:
        params: the request's sampling parameters.
        max_logprobs: the limit.
    """
    for field, kind in (("logprobs", "sample"), ("prompt_logprobs", "prompt")):
        value = getattr(params, field)
        if value is not None and value > max_logprobs:
            return field, (
                f"Requested {kind} logprobs of {value}, which is greater than max allowed: "
                f"{max_logprobs}"
            )
    return None
