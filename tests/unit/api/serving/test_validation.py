"""The api's request checks (services/api/serving/validation.py): one place, one error format (a 400
naming the field)."""

from __future__ import annotations

import pytest

from kvserve.services.api.serving.errors import APIError
from kvserve.services.api.serving.validation import (
    check_prompt_tokens,
    check_sampling_params,
    check_token_id_range,
    resolve_max_tokens,
)

VOCAB_SIZE = 100
MAX_MODEL_LEN = 16


def refused(check, *args) -> APIError:
    with pytest.raises(APIError) as info:
        check(*args)
    assert info.value.status_code == 400
    return info.value


def test_prompt_tokens_are_not_empty_and_within_the_vocabulary():
    check_prompt_tokens([0, VOCAB_SIZE - 1], VOCAB_SIZE, "prompt")
    assert refused(check_prompt_tokens, [], VOCAB_SIZE, "prompt").param == "prompt"
    error = refused(check_prompt_tokens, [VOCAB_SIZE], VOCAB_SIZE, "messages")
    assert error.param == "messages" and error.message == "prompt token ids must be in [0, 100)"
    assert refused(check_prompt_tokens, [-1], VOCAB_SIZE, "tokens").param == "tokens"


def test_token_id_lists_name_their_field():
    check_token_id_range([], VOCAB_SIZE, "stop_token_ids")  # nothing to check
    error = refused(check_token_id_range, {VOCAB_SIZE: 1.0}, VOCAB_SIZE, "logit_bias")
    assert error.param == "logit_bias" and "logit_bias token ids" in error.message


def test_max_tokens_fills_the_context_or_must_fit_it():
    assert resolve_max_tokens(10, None, MAX_MODEL_LEN, None, "prompt") == 6
    assert resolve_max_tokens(10, None, MAX_MODEL_LEN, 4, "prompt") == 4  # generation config
    assert resolve_max_tokens(10, 6, MAX_MODEL_LEN, None, "prompt") == 6
    too_long = refused(resolve_max_tokens, MAX_MODEL_LEN, 1, MAX_MODEL_LEN, None, "messages")
    assert too_long.param == "messages" and "maximum context length is 16" in too_long.message
    over = refused(resolve_max_tokens, 10, 7, MAX_MODEL_LEN, None, "prompt")
    assert over.param == "max_tokens" and "you requested 17 tokens" in over.message


def test_sampling_params_errors_name_the_field_and_logprobs_the_limit():
    assert check_sampling_params({"max_tokens": 4, "logprobs": 3}, 3, ()).logprobs == 3
    assert refused(check_sampling_params, {"temperature": -1.0}, 3, ()).param == "temperature"
    error = refused(check_sampling_params, {"max_tokens": 4, "logprobs": 4}, 3, ())
    assert error.param == "logprobs" and "greater than max allowed: 3" in error.message
