"""What the engine core refuses before a request reaches the scheduler.

The api checks all of this first (a 400 naming the field); these checks are the engine's own
guard against a client that talks to the engine socket directly, or an api of another
version. A refused request gets an ERROR output; nothing here may raise into the busy loop,
since an out-of-vocabulary id or a NaN temperature would otherwise fail the whole step.
"""

from __future__ import annotations

import json
import math
import os

from kvserve.shared.messages import EngineCoreRequest
from kvserve.shared.sampling_params import non_finite_error
from kvserve.shared.wire import QUEUE_FULL_ERROR

_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1


def model_vocab_size(model_dir: str) -> int | None:
    """config.json's vocab_size (the embedding's rows), or None when it names none."""
    path = os.path.join(model_dir, "config.json")
    if not os.path.exists(path):
        return None
    with open(path) as f:
        config = json.load(f)
    size = config.get("vocab_size") or (config.get("text_config") or {}).get("vocab_size")
    return int(size) if size else None


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
        vocab_size: token ids must be below this (None: not checked).
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
        return None
    id_lists = {
        "prompt_token_ids": request.prompt_token_ids,
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
    return None
