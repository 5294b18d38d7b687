"""POST /v1/embeddings (with --runner pooling): OpenAI's embeddings over the same engine.

Each input (a string, a list of strings, a list of token ids, or a list of those) becomes an
embedding request (SamplingParams.pooling): it is scheduled and batched with everything else,
prefill only; once its prompt is computed the worker pools the final hidden states, normalises
them (L2) and the request ends. The pooling is the model's: a sentence-transformers folder's
1_Pooling/config.json (mean or last token), else the last token, as vLLM's --convert embed
does for a generative model. `encoding_format` float or base64 (little-endian float32);
`dimensions` is refused (no model served here was trained for shortened embeddings).
"""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any, Literal

import msgspec
import numpy as np
from starlette.requests import Request
from starlette.responses import Response

from kvserve.services.api.serving.base import OpenAIServing, raise_if_failed
from kvserve.services.api.serving.errors import APIError
from kvserve.services.api.serving.protocol import Int64
from kvserve.services.api.serving.validation import check_prompt_length
from kvserve.shared.logging import init_logger
from kvserve.shared.sampling_params import SamplingParams

logger = init_logger(__name__)

MAX_INPUTS = 2048  # OpenAI's limit on inputs per request


class EmbeddingRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """POST /v1/embeddings."""

    input: str | list[Any]
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Int64 | None = None
    user: str | None = None
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


def pooling_of(model_dir: str | None) -> Literal["last", "mean"]:
    """The model's pooling: its sentence-transformers pooling config, else the last token."""
    path = Path(model_dir or "") / "1_Pooling" / "config.json"
    if not model_dir or not path.is_file():
        return "last"
    config = json.loads(path.read_text())
    if config.get("pooling_mode_mean_tokens"):
        return "mean"
    if config.get("pooling_mode_lasttoken"):
        return "last"
    modes = sorted(k for k, v in config.items() if k.startswith("pooling_mode") and v)
    raise ValueError(f"{path}: pooling {modes} is not supported (mean or last token)")


class OpenAIServingEmbedding(OpenAIServing):
    """The embeddings endpoint (see OpenAIServing for the constructor's arguments)."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.enabled = self.frontend.runner == "pooling"
        self.pooling = (
            pooling_of(self.engine_client.tokenizer_info.model_dir) if self.enabled else "last"
        )

    def _token_ids_of(self, request: EmbeddingRequest) -> list[list[int]]:
        items = request.input
        if isinstance(items, str):
            items = [items]
        elif items and all(isinstance(x, int) and not isinstance(x, bool) for x in items):
            items = [items]  # one prompt as token ids
        if not items:
            raise APIError(400, "input must hold at least one item", "input")
        if len(items) > MAX_INPUTS:
            raise APIError(400, f"at most {MAX_INPUTS} inputs a request", "input")
        prompts = []
        for item in items:
            if isinstance(item, str):
                token_ids = list(self.tokenizer.encode(item))
            elif isinstance(item, list) and all(
                isinstance(x, int) and not isinstance(x, bool) for x in item
            ):
                token_ids = item
            else:
                raise APIError(400, "input items must be strings or lists of token ids", "input")
            if not token_ids:
                raise APIError(400, "an input is empty", "input")
            self.check_prompt_tokens(token_ids, "input")
            check_prompt_length(len(token_ids), self.engine_client.max_model_len, "input")
            prompts.append(token_ids)
        return prompts

    async def create_embedding(self, request: EmbeddingRequest, raw_request: Request) -> Response:
        if not self.enabled:
            raise APIError(
                400, "embeddings need the pooling runner: start the server with --runner pooling"
            )
        self.check_model(request.model)
        if request.dimensions is not None:
            raise APIError(
                400, "dimensions is not supported: the model has one embedding size", "dimensions"
            )
        prompts = self._token_ids_of(request)
        self.check_engine(len(prompts))
        params = SamplingParams(max_tokens=1, pooling=self.pooling)
        request_id = self.request_ids(raw_request, request, "embd-")[1]
        vectors: list[bytes | None] = [None] * len(prompts)
        results = self.generate(
            request_id,
            [(None, ids) for ids in prompts],
            [params] * len(prompts),
            0,
            self.lora_request(request.model),
        )
        async for index, output in results:
            raise_if_failed(output)
            if output.finished:
                vectors[index] = output.outputs[0].pooled
        data = []
        for index, vector in enumerate(vectors):
            assert vector is not None, "every embedding request ends with its vector"
            embedding: list[float] | str = (
                base64.b64encode(vector).decode()
                if request.encoding_format == "base64"
                else np.frombuffer(vector, dtype=np.float32).tolist()
            )
            data.append(EmbeddingData(index, embedding))
        num_tokens = sum(len(ids) for ids in prompts)
        body = EmbeddingResponse(
            data, self.response_model(request.model), EmbeddingUsage(num_tokens, num_tokens)
        )
        logger.info("embeddings %s: %d inputs, %d tokens", request_id, len(prompts), num_tokens)
        return Response(msgspec.json.encode(body), media_type="application/json")
