"""POST /v1/embeddings (with --runner pooling): OpenAI's embeddings over the same engine.

Each input (a string, a list of strings, a list of token ids, or a list of those) becomes a
pooling request (SamplingParams.pooling): it is scheduled and batched with everything else,
prefill only; once its prompt is computed the worker pools the final hidden states as the
model's folder says (pooling_model.py: a sentence-transformers Pooling module's cls, mean or
last token, and its Normalize module; else the last token of a decoder, the CLS of an
encoder) and the request ends. `encoding_format` float or base64 (little-endian float32);
`dimensions` keeps the first d values (Matryoshka) and normalises them again when the model
normalises; `truncate_prompt_tokens` cuts over-long inputs (else they are a 400).
"""

from __future__ import annotations

import base64
from typing import Any, Literal

import msgspec
import numpy as np
from starlette.requests import Request
from starlette.responses import Response

from kvserve.services.api.serving.errors import APIError
from kvserve.services.api.serving.protocol import Int64
from kvserve.services.api.surfaces.pooling_serving import PoolingServing
from kvserve.shared.logging import init_logger

logger = init_logger(__name__)


class EmbeddingRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """POST /v1/embeddings."""

    input: str | list[Any]
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Int64 | None = None
    user: str | None = None
    truncate_prompt_tokens: Int64 | None = None  # vLLM's: cut inputs to this many tokens
    request_id: str | None = None  # vLLM's: the id the engine and the logs use


class EmbeddingData(msgspec.Struct, tag="embedding", tag_field="object"):
    index: int
    embedding: list[float] | str


class EmbeddingUsage(msgspec.Struct):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(msgspec.Struct, tag="list", tag_field="object"):
    data: list[EmbeddingData]
    model: str
    usage: EmbeddingUsage


class OpenAIServingEmbedding(PoolingServing):
    """The embeddings endpoint (see OpenAIServing for the constructor's arguments)."""

    def _token_ids_of(self, request: EmbeddingRequest) -> list[list[int]]:
        items = request.input
        if isinstance(items, str):
            items = [items]
        elif items and all(isinstance(x, int) and not isinstance(x, bool) for x in items):
            items = [items]  # one prompt as token ids
        self.check_count(len(items), "input")
        max_length = self.truncation_length(request.truncate_prompt_tokens, "input")
        prompts = []
        for item in items:
            if isinstance(item, str):
                prompts.append(self.text_tokens(item, max_length, "input"))
            elif isinstance(item, list) and all(
                isinstance(x, int) and not isinstance(x, bool) for x in item
            ):
                # Token ids keep their last max_length (vLLM's truncate_prompt_tokens).
                ids = item[-max_length:] if max_length is not None and item else item
                prompts.append(self.checked(ids, "input"))
            else:
                raise APIError(400, "input items must be strings or lists of token ids", "input")
        return prompts

    def _check_dimensions(self, request: EmbeddingRequest) -> None:
        if self.spec.is_classifier:
            raise APIError(
                400,
                "the model is a classifier (a cross-encoder): use /rerank, /v1/score or /classify",
            )
        if request.dimensions is None:
            return
        if request.dimensions < 1:
            raise APIError(400, "dimensions must be at least 1", "dimensions")

    async def create_embedding(self, request: EmbeddingRequest, raw_request: Request) -> Response:
        self.check_enabled("embeddings")
        self.check_model(request.model)
        self._check_dimensions(request)
        prompts = self._token_ids_of(request)
        params = self.params()
        request_id, vectors = await self.pool(
            raw_request, request, "embd-", prompts, [params] * len(prompts)
        )
        data = []
        for index, vector in enumerate(vectors):
            vector = self._shorten(vector, request.dimensions)
            embedding: list[float] | str = (
                base64.b64encode(vector.astype("<f4").tobytes()).decode()
                if request.encoding_format == "base64"
                else vector.tolist()
            )
            data.append(EmbeddingData(index, embedding))
        num_tokens = sum(len(ids) for ids in prompts)
        body = EmbeddingResponse(
            data, self.response_model(request.model), EmbeddingUsage(num_tokens, num_tokens)
        )
        logger.info("embeddings %s: %d inputs, %d tokens", request_id, len(prompts), num_tokens)
        return Response(msgspec.json.encode(body), media_type="application/json")

    def _shorten(self, vector: np.ndarray, dimensions: int | None) -> np.ndarray:
        """The first `dimensions` values (Matryoshka), normalised again if the model
        normalises."""
        if dimensions is None:
            return vector
        if dimensions > len(vector):
            raise APIError(
                400, f"dimensions must be at most the model's {len(vector)}", "dimensions"
            )
        short = vector[:dimensions]
        if self.spec.normalize:
            norm = float(np.linalg.norm(short))
            short = short / norm if norm > 0 else short
        return short
