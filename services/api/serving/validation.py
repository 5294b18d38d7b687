"""Every check the api makes of one request, in one place, with one error format: an
APIError 400 naming the field (`param`), and the flag when a --max-* bound refused it.

The api checks what it can know, once, before the engine sees the request; the engine core
checks the rest (what only it knows) itself. Each check runs before the work it bounds:

    decoded request ─▶ check_request         n, prompts, characters (before any tokenizing),
                                              stop strings, token-id lists, messages, tools,
                                              top_logprobs / prompt_logprobs vs stream
    token ids ──────▶ check_prompt_tokens    not empty, within the tokenizer's vocabulary
                      check_token_id_range   logit_bias, allowed / stop token ids
    prompt length ──▶ resolve_max_tokens     prompt (+ completion) within max_model_len
    SamplingParams ─▶ check_sampling_params  the struct's own rules, logprobs vs the engine's
                                              --max-logprobs

(Body size and JSON depth come first, as bytes: limits.py and protocol.json_depth.)
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

from kvserve.services.api.serving.errors import APIError
from kvserve.services.api.serving.protocol import SAMPLING_FIELDS
from kvserve.shared.api_config import LimitsConfig
from kvserve.shared.sampling_params import SamplingParams, logprobs_over_limit

# A prompt may hold at most this many characters per max_model_len token (when
# --max-prompt-chars is not given): far above any tokenizer's average (3-5), so no prompt
# that fits the context is refused, yet a 64 MiB one is refused before it is tokenized.
CHARS_PER_TOKEN_BOUND = 32


def refused(message: str, param: str | None) -> APIError:
    """The one error format: a 400 naming the field."""
    return APIError(400, message, param=param)


def over_limit(param: str | None, what: str, value: int, limit: int, flag: str) -> APIError:
    return refused(f"{what} is {value}, more than the limit of {limit} (--{flag})", param)


# --------------------------------------------------------------------------- the request


def check_request(request: Any, limits: LimitsConfig, max_model_len: int) -> None:
    """The bounds of a CompletionRequest or ChatCompletionRequest, before anything is
    tokenized or sent."""
    if request.n > limits.max_n:
        raise over_limit("n", "n", request.n, limits.max_n, "max-n")
    _check_stop(request.stop, limits)
    for field in ("stop_token_ids", "allowed_token_ids", "logit_bias", "bad_words"):
        values = getattr(request, field)
        if values is not None and len(values) > limits.max_token_id_list:
            raise over_limit(
                field,
                f"the number of {field}",
                len(values),
                limits.max_token_id_list,
                "max-token-id-list",
            )
    if hasattr(request, "messages"):
        _check_chat(request, limits, max_model_len)
    else:
        _check_prompts(request.prompt, limits, max_model_len)
    check_prompt_logprobs(request)


def check_prompt_logprobs(request: Any) -> None:
    """vLLM's rule: prompt logprobs come whole, so never in a stream."""
    if request.stream and request.prompt_logprobs:
        raise refused("`prompt_logprobs` are not available when `stream=True`.", "prompt_logprobs")


def max_prompt_chars(limits: LimitsConfig, max_model_len: int) -> int:
    if limits.max_prompt_chars is not None:
        return limits.max_prompt_chars
    return CHARS_PER_TOKEN_BOUND * max_model_len


def check_prompt_chars(text_chars: int, limits: LimitsConfig, max_model_len: int, param: str):
    """A prompt of `text_chars` characters, refused before it is tokenized when longer than
    any prompt that could fit the context."""
    limit = max_prompt_chars(limits, max_model_len)
    if text_chars > limit:
        raise refused(
            f"the prompt has {text_chars} characters, more than the limit of {limit} "
            f"(--max-prompt-chars; default {CHARS_PER_TOKEN_BOUND} x max_model_len "
            f"{max_model_len}): it cannot fit the model's context",
            param,
        )


def _check_stop(stop: str | list[str] | None, limits: LimitsConfig) -> None:
    if stop is None:
        return
    stops = [stop] if isinstance(stop, str) else stop
    if len(stops) > limits.max_stop_strings:
        raise over_limit(
            "stop",
            "the number of stop strings",
            len(stops),
            limits.max_stop_strings,
            "max-stop-strings",
        )
    longest = max((len(s) for s in stops), default=0)
    if longest > limits.max_stop_string_chars:
        raise over_limit(
            "stop",
            "a stop string's length",
            longest,
            limits.max_stop_string_chars,
            "max-stop-string-chars",
        )


def _check_prompts(prompt: Any, limits: LimitsConfig, max_model_len: int) -> None:
    if isinstance(prompt, str):
        check_prompt_chars(len(prompt), limits, max_model_len, "prompt")
        return
    is_batch = any(isinstance(item, (str, list)) for item in prompt)
    if is_batch and len(prompt) > limits.max_prompts:
        raise over_limit(
            "prompt", "the number of prompts", len(prompt), limits.max_prompts, "max-prompts"
        )
    for item in prompt if is_batch else (prompt,):
        if isinstance(item, str):
            check_prompt_chars(len(item), limits, max_model_len, "prompt")
        elif isinstance(item, list):
            # Token ids: checked here already, as it bounds the cost of the vocabulary check.
            check_prompt_length(len(item), max_model_len, "prompt")


def _check_chat(request: Any, limits: LimitsConfig, max_model_len: int) -> None:
    messages = request.messages
    if len(messages) > limits.max_messages:
        raise over_limit(
            "messages",
            "the number of messages",
            len(messages),
            limits.max_messages,
            "max-messages",
        )
    if request.tools is not None and len(request.tools) > limits.max_tools:
        raise over_limit(
            "tools", "the number of tools", len(request.tools), limits.max_tools, "max-tools"
        )
    num_chars = 0
    for message in messages:
        content = message.content
        if isinstance(content, str):
            num_chars += len(content)
        elif content is not None:
            num_chars += sum(len(part.text or "") for part in content)
    check_prompt_chars(num_chars, limits, max_model_len, "messages")
    if request.top_logprobs is not None and not request.logprobs:
        raise refused("top_logprobs needs logprobs=true", "top_logprobs")


# --------------------------------------------------------------------------- token ids


def check_token_id_range(
    token_ids: Collection[int], vocab_size: int, param: str, what: str | None = None
) -> None:
    """Every id within the tokenizer's vocabulary [0, vocab_size).

    Args:
        what: how the message names the ids (default: the field).
    """
    if token_ids and (min(token_ids) < 0 or max(token_ids) >= vocab_size):
        raise refused(f"{what or param} token ids must be in [0, {vocab_size})", param)


def check_prompt_tokens(token_ids: list[int], vocab_size: int, param: str) -> None:
    """A tokenized (or given) prompt: not empty, and within the vocabulary."""
    if not token_ids:
        raise refused("the prompt is empty; send at least one token", param)
    check_token_id_range(token_ids, vocab_size, param, what="prompt")


# --------------------------------------------------------------------------- lengths


def check_prompt_length(num_prompt_tokens: int, max_model_len: int, param: str) -> None:
    """A prompt leaves room for at least one token within max_model_len."""
    if num_prompt_tokens >= max_model_len:
        raise refused(
            f"This model's maximum context length is {max_model_len} tokens. However, your "
            f"request has {num_prompt_tokens} input tokens. Please reduce the length of the "
            f"input.",
            param,
        )


def resolve_max_tokens(
    num_prompt_tokens: int,
    max_tokens: int | None,
    max_model_len: int,
    default_max_tokens: int | None,
    prompt_param: str,
) -> int:
    """The completion's max_tokens: the client's (when prompt + completion fit), else what
    fills the context (at most the generation config's default); as vLLM words it.

    Args:
        prompt_param: the field to blame for a too long prompt ("prompt" or "messages").
    """
    check_prompt_length(num_prompt_tokens, max_model_len, prompt_param)
    if max_tokens is None:
        max_tokens = max_model_len - num_prompt_tokens
        return max_tokens if default_max_tokens is None else min(max_tokens, default_max_tokens)
    if max_tokens >= 1 and num_prompt_tokens + max_tokens > max_model_len:
        raise refused(
            f"This model's maximum context length is {max_model_len} tokens. However, you "
            f"requested {num_prompt_tokens + max_tokens} tokens ({num_prompt_tokens} in the "
            f"input, {max_tokens} in the completion). Please reduce the length of the input "
            f"or of the completion.",
            "max_tokens",
        )
    return max_tokens


# --------------------------------------------------------------------------- sampling params


def check_sampling_params(
    kwargs: dict[str, Any], max_logprobs: int, override_fields: Collection[str]
) -> SamplingParams:
    """SamplingParams(**kwargs), its own ValueErrors as 400s naming the field, and its
    logprobs within the engine's --max-logprobs.

    Args:
        kwargs: the struct's fields (its __post_init__ checks each one).
        max_logprobs: the engine's limit.
        override_fields: fields the handler set (named in errors like request fields).
    """
    try:
        params = SamplingParams(**kwargs)
    except ValueError as exc:
        # SamplingParams' messages start with the field name.
        field = str(exc).split(" ", 1)[0]
        known = field in SAMPLING_FIELDS or field in override_fields or field == "max_tokens"
        raise refused(str(exc), field if known else None) from None
    over = logprobs_over_limit(params, max_logprobs)
    if over is not None:
        raise refused(over[1], over[0])
    return params
