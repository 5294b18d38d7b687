"""A request's constraints as SamplingParams fields: response_format / structured_outputs
(one StructuredOutputsParams), logit_bias, allowed_token_ids and bad words.

Everything here is checked without the backend (the api never loads xgrammar): the shapes,
and token ids against the vocabulary. Whether a schema, regex or grammar compiles is the
engine core's to say; a failed compile comes back as an error output, answered as a 400.
"""

from __future__ import annotations

import json
from typing import Any

import msgspec

from kvserve.services.api.serving.errors import APIError
from kvserve.services.api.serving.protocol import ResponseFormat
from kvserve.services.api.serving.validation import check_token_id_range
from kvserve.shared.structured_outputs import StructuredOutputsParams


def structured_outputs_of(request) -> StructuredOutputsParams | None:
    """The request's constraint from `structured_outputs` or `response_format` (not both).

    Raises:
        APIError: a response_format kvserve does not know, or both fields set.
    """
    from_format = _from_response_format(request.response_format)
    if from_format is not None and request.structured_outputs is not None:
        raise APIError(
            400,
            "set either response_format or structured_outputs, not both",
            param="structured_outputs",
        )
    return request.structured_outputs or from_format


def _from_response_format(response_format: ResponseFormat | None) -> StructuredOutputsParams | None:
    if response_format is None or response_format.type == "text":
        return None
    kind = response_format.type
    try:
        if kind == "json_object":
            return StructuredOutputsParams(json_object=True)
        if kind == "json_schema":
            spec = response_format.json_schema
            if spec is None or spec.schema is None:
                raise APIError(
                    400,
                    'response_format {"type": "json_schema"} needs json_schema.schema',
                    param="response_format",
                )
            return StructuredOutputsParams(json=spec.schema)
        if kind == "structural_tag":
            tag = {k: v for k, v in msgspec.to_builtins(response_format).items() if v is not None}
            return StructuredOutputsParams(structural_tag=json.dumps(tag))
    except ValueError as exc:
        raise APIError(400, f"response_format: {exc}", param="response_format") from None
    raise APIError(
        400,
        f"response_format type {kind!r} is not supported: use text, json_object, json_schema "
        f"or structural_tag",
        param="response_format",
    )


def logits_processor_kwargs(request, tokenizer) -> dict[str, Any]:
    """SamplingParams' logit_bias (ids as ints), allowed_token_ids and bad words (with their
    token ids) from the request; token ids outside the vocabulary (there or in
    stop_token_ids) are a 400."""
    vocab_size = len(tokenizer)
    kwargs: dict[str, Any] = {}
    if request.logit_bias:
        try:
            bias = {int(token_id): value for token_id, value in request.logit_bias.items()}
        except ValueError:
            raise APIError(
                400, "logit_bias keys must be token ids (as strings)", param="logit_bias"
            ) from None
        check_token_id_range(bias, vocab_size, "logit_bias")
        kwargs["logit_bias"] = bias
    for field in ("allowed_token_ids", "stop_token_ids"):
        if getattr(request, field) is not None:
            check_token_id_range(getattr(request, field), vocab_size, field)
    if request.bad_words:
        kwargs["bad_words_token_ids"] = bad_words_token_ids(tokenizer, request.bad_words)
    return kwargs


def bad_words_token_ids(tokenizer, bad_words: list[str]) -> list[list[int]]:
    """Each word's token ids as it would follow other text: without and with a leading
    space (BPE vocabularies spell " word" with other tokens than "word"), once each."""
    sequences: list[list[int]] = []
    for word in bad_words:
        for prefix in ("", " "):
            ids = tokenizer.encode(prefix + word.strip(), add_special_tokens=False)
            if ids and ids not in sequences:
                sequences.append(ids)
    return sequences
