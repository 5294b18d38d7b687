"""What the engine core refuses before a request reaches the scheduler: the one place.

The api checks what it can first (a 400 naming the field); these checks are the engine's own
guard against a client that talks to the engine socket directly, or an api of another
version, plus what only the engine knows (its max_model_len after the KV cache is sized,
the ids in use, whether structured outputs and LoRA run, an adapter's own files). A refused
request gets an ERROR output (Scheduler.reject); the scheduler trusts what passes. Nothing
here may raise into the busy loop, since an out-of-vocabulary id or a NaN temperature would
otherwise fail the whole step.
"""

from __future__ import annotations

import math

from kvserve.shared.config import LoRAConfig
from kvserve.shared.lora import read_adapter_config
from kvserve.shared.messages import EngineCoreRequest
from kvserve.shared.sampling_params import non_finite_error
from kvserve.shared.wire import QUEUE_FULL_ERROR

_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1
# Token ids travel as int32 to the workers: the bound when the vocabulary is not known.
_MAX_TOKEN_ID = 2**31 - 1


def queue_full_error(max_waiting_requests: int) -> str:
    """The refusal of a request past --max-waiting-requests; the api matches its prefix
    (QUEUE_FULL_ERROR) and answers a 429."""
    return (
        f"{QUEUE_FULL_ERROR}: the engine already queues {max_waiting_requests} requests "
        f"(--max-waiting-requests); retry later"
    )


def check_engine_request(
    request: EngineCoreRequest, vocab_size: int | None, max_logprobs: int
) -> str | None:
    """Why the engine must refuse `request`, or None when it may be scheduled.

    Args:
        request: as decoded from the engine socket (SamplingParams' own checks ran).
        vocab_size: token ids must be below this (None: below 2**31, int32's bound).
        max_logprobs: the engine's --max-logprobs.
    """
    params = request.sampling_params
    non_finite = non_finite_error(params)
    if non_finite is not None:
        return non_finite
    if params.logit_bias and not all(math.isfinite(v) for v in params.logit_bias.values()):
        return "logit_bias values must be finite numbers"
    if params.seed is not None and not _INT64_MIN <= params.seed <= _INT64_MAX:
        return f"seed must fit in 64 bits, got {params.seed}"
    if params.max_tokens is not None and params.max_tokens > _INT64_MAX:
        return f"max_tokens must fit in 64 bits, got {params.max_tokens}"
    for name in ("logprobs", "prompt_logprobs"):
        value = getattr(params, name)
        if value is not None and value > max_logprobs:
            return f"{name} is {value}, more than the engine's --max-logprobs {max_logprobs}"
    if vocab_size is None:
        vocab_size = _MAX_TOKEN_ID + 1
    id_lists = {
        "prompt_token_ids": request.prompt_token_ids,
        "resumed_output_token_ids": request.resumed_output_token_ids,
        "stop_token_ids": params.stop_token_ids or (),
        "allowed_token_ids": params.allowed_token_ids or (),
        "logit_bias": params.logit_bias or (),
        "bad_words_token_ids": [i for ids in params.bad_words_token_ids or () for i in ids],
    }
    for name, ids in id_lists.items():
        if ids and (min(ids) < 0 or max(ids) >= vocab_size):
            return f"{name} must be token ids in [0, {vocab_size})"
    if request.eos_token_id is not None and not 0 <= request.eos_token_id < vocab_size:
        return f"eos_token_id must be in [0, {vocab_size})"
    for name in ("slo_ttft_ms", "slo_tpot_ms", "standing_ttft_ms"):
        target = getattr(request, name)
        if target is not None and not (0 < target < math.inf):
            return f"{name} must be a positive number of ms, got {target}"
    return None


class RequestChecker:
    """Every engine-side check of a request (see the module docstring), in one call.

    Args:
        vocab_size: token ids must be below this (None: below 2**31).
        max_logprobs: the engine's --max-logprobs.
        max_model_len: the scheduler's effective limit (prompt + at least one token).
        structured_outputs: whether the engine compiles grammars.
        lora_config: with enable_lora, requests may name adapters; else they are refused.
        speculative: the engine verifies drafts (several tokens a step): a thinking budget,
            which decides one step's token, is refused there.
        pooling_only: the model is an encoder: it pools (embeds, scores, classifies) and
            never generates, so every other request is refused.
    """

    def __init__(
        self,
        vocab_size: int | None,
        max_logprobs: int,
        max_model_len: int,
        structured_outputs: bool,
        lora_config: LoRAConfig | None,
        speculative: bool = False,
        pooling_only: bool = False,
    ):
        self.pooling_only = pooling_only
        self.vocab_size = vocab_size
        self.max_logprobs = max_logprobs
        self.max_model_len = max_model_len
        self.structured_outputs = structured_outputs
        self.speculative = speculative
        self.lora_config = lora_config if lora_config and lora_config.enable_lora else None
        # (adapter id, path) -> why it cannot run (None: it can); read once per adapter.
        self._lora_errors: dict[tuple[int, str], str | None] = {}

    def check(self, request: EngineCoreRequest, id_in_use: bool) -> str | None:
        """Why the engine must refuse `request`, or None when it may be scheduled.

        Args:
            request: as decoded from the engine socket.
            id_in_use: another unfinished request has its id.
        """
        try:
            return self._check(request, id_in_use)
        except Exception as exc:  # noqa: BLE001 - a bad request must never stop the engine
            return f"invalid request: {exc}"

    def _check(self, request: EngineCoreRequest, id_in_use: bool) -> str | None:
        if id_in_use:
            return f"request id {request.request_id!r} is already in use"
        num_prompt_tokens = len(request.prompt_token_ids)
        if not num_prompt_tokens:
            return "the prompt is empty; send at least one token"
        num_resumed = len(request.resumed_output_token_ids)
        if num_resumed and num_prompt_tokens + num_resumed >= self.max_model_len:
            return (
                f"the migrated request holds {num_prompt_tokens + num_resumed} tokens but "
                f"max_model_len is {self.max_model_len}"
            )
        if num_prompt_tokens >= self.max_model_len:
            return (
                f"the prompt has {num_prompt_tokens} tokens but max_model_len is "
                f"{self.max_model_len}; shorten it to at most {self.max_model_len - 1} "
                f"tokens so that at least one can be generated"
            )
        if self.pooling_only and request.sampling_params.pooling is None:
            return (
                "this model is an encoder: it serves embeddings, scores and classes "
                "(--runner pooling), not generation"
            )
        error = check_engine_request(request, self.vocab_size, self.max_logprobs)
        if error is not None:
            return error
        if request.sampling_params.structured_outputs is not None and not self.structured_outputs:
            return "structured outputs are not enabled in this engine"
        if request.sampling_params.thinking_token_budget is not None and self.speculative:
            return "a thinking budget is not supported with speculative decoding"
        if request.mm_inputs:
            error = check_image_spans(request)
            if error is not None:
                return error
        if request.lora_request is not None:
            return self._check_lora(request)
        return None

    def _check_lora(self, request: EngineCoreRequest) -> str | None:
        lora_request = request.lora_request
        assert lora_request is not None
        if self.lora_config is None:
            return "LoRA adapters are not enabled in this engine (start it with enable_lora)"
        key = (lora_request.lora_int_id, lora_request.lora_path)
        if key not in self._lora_errors:
            try:
                read_adapter_config(lora_request.lora_path, self.lora_config.max_lora_rank)
                self._lora_errors[key] = None
            except ValueError as exc:
                self._lora_errors[key] = str(exc)
        return self._lora_errors[key]


def check_image_spans(request: EngineCoreRequest) -> str | None:
    """Why a request's images cannot be placed: spans out of the prompt, out of order or
    overlapping, or pixels whose bytes do not fill their shape (the worker would fail the
    step, and every request in it)."""
    end = 0
    for index, image in enumerate(request.mm_inputs):
        if image.offset < end or image.length < 1 or image.end > len(request.prompt_token_ids):
            span = f"[{image.offset}, {image.end})"
            return f"image {index} spans tokens {span}: out of order or past the prompt"
        end = image.end
        itemsize = {"float32": 4, "bfloat16": 2, "float16": 2}.get(image.dtype)
        count = 1
        for size in image.shape:
            count *= size
        if (
            itemsize is None
            or count * itemsize != len(image.pixel_values)
            or len(image.grid_thw) != 3
        ):
            return (
                f"image {index} has pixels that do not match dtype {image.dtype!r} and "
                f"shape {image.shape}"
            )
    return None
