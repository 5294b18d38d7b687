"""The serving core of the pooling surfaces (embeddings, rerank, score, classify): inputs
tokenized here (single texts and a cross-encoder's pairs), length checks and truncation, and
pooling requests run through the engine, one engine request per input, batched there with
everything else.

An input longer than max_model_len is a 400 unless the request asks for truncation
(`truncate_prompt_tokens`: k keeps the first k tokens, the end-of-input special token kept
where the tokenizer adds one; -1 keeps as many as fit). An input holds at most
max_model_len - 1 tokens, as every engine request does (the engine's one length rule).
"""

from __future__ import annotations

from typing import Any

import numpy as np
from starlette.requests import Request

from kvserve.services.api.serving.base import OpenAIServing, raise_if_failed
from kvserve.services.api.serving.errors import APIError
from kvserve.services.api.serving.validation import check_prompt_length
from kvserve.services.api.surfaces.pooling_model import PoolingSpec, pooling_spec
from kvserve.shared.sampling_params import SamplingParams

# The most inputs (or documents) one request may hold: OpenAI's embeddings limit, and
# above Cohere's 1,000 documents a rerank.
MAX_INPUTS = 2048


class PoolingServing(OpenAIServing):
    """A pooling surface (see OpenAIServing for the constructor's arguments)."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        runner = self.frontend.runner
        # An encoder model pools whatever the runner says but "generate" (vLLM's auto).
        self.enabled = runner == "pooling" or (runner == "auto" and self.is_encoder)
        model_dir = self.engine_client.tokenizer_info.model_dir
        self.spec: PoolingSpec = pooling_spec(model_dir) if self.enabled else PoolingSpec()

    def check_enabled(self, what: str) -> None:
        if not self.enabled:
            raise APIError(
                400, f"{what} needs the pooling runner: start the server with --runner pooling"
            )

    def check_count(self, count: int, param: str) -> None:
        if count == 0:
            raise APIError(400, f"{param} must hold at least one item", param)
        if count > MAX_INPUTS:
            raise APIError(400, f"at most {MAX_INPUTS} items in {param}", param)

    def truncation_length(self, truncate_prompt_tokens: int | None, param: str) -> int | None:
        """The length inputs are cut to: None (no truncation), or k (-1: max_model_len)."""
        if truncate_prompt_tokens is None:
            return None
        max_len = self.engine_client.max_model_len
        if truncate_prompt_tokens != -1 and not 1 <= truncate_prompt_tokens <= max_len:
            raise APIError(400, f"truncate_prompt_tokens must be -1 or in [1, {max_len}]", param)
        # The engine takes prompts shorter than max_model_len (it checks every request so).
        limit = max_len - 1
        return limit if truncate_prompt_tokens == -1 else min(truncate_prompt_tokens, limit)

    def text_tokens(self, text: str, max_length: int | None, param: str) -> list[int]:
        """A text's token ids (special tokens added), cut to max_length when given."""
        if max_length is None:
            token_ids = list(self.tokenizer.encode(text))
        else:
            token_ids = self.tokenizer(text, truncation=True, max_length=max_length)["input_ids"]
        return self.checked(list(token_ids), param)

    def pair_tokens(
        self, first: str, second: str, max_length: int | None, param: str
    ) -> tuple[list[int], int | None]:
        """A cross-encoder's (query, document) pair as the tokenizer's pair encoding: its
        token ids and where the second segment starts (token type 1), when the model embeds
        token types. Truncation cuts the document."""
        kwargs: dict[str, Any] = {"return_token_type_ids": True}
        if max_length is not None:
            kwargs.update(truncation="only_second", max_length=max_length)
        try:
            encoded = self.tokenizer(first, second, **kwargs)
        except Exception as exc:  # a query alone over max_length cannot be cut to fit
            raise APIError(
                400, f"this pair cannot be truncated to {max_length} tokens: {exc}", param
            ) from None
        token_ids = self.checked(list(encoded["input_ids"]), param)
        types = encoded.get("token_type_ids") or []
        start = next((i for i, t in enumerate(types) if t == 1), None)
        return token_ids, start if self.spec.use_token_types else None

    def checked(self, token_ids: list[int], param: str) -> list[int]:
        if not token_ids:
            raise APIError(400, "an input is empty", param)
        self.check_prompt_tokens(token_ids, param)
        check_prompt_length(len(token_ids), self.engine_client.max_model_len, param)
        return token_ids

    def params(self, token_type_start: int | None = None) -> SamplingParams:
        spec = self.spec
        return SamplingParams(
            max_tokens=1,
            pooling=spec.pooling,
            normalize=spec.normalize,
            token_type_start=token_type_start,
        )

    async def pool(
        self,
        raw_request: Request,
        request: Any,
        prefix: str,
        prompts: list[list[int]],
        params_list: list[SamplingParams],
    ) -> tuple[str, list[np.ndarray]]:
        """Run one pooling request per prompt; (the request id, each prompt's float32
        vector, in prompt order)."""
        self.check_engine(len(prompts))
        request_id = self.request_ids(raw_request, request, prefix)[1]
        vectors: list[np.ndarray | None] = [None] * len(prompts)
        results = self.generate(
            request_id,
            [(None, ids) for ids in prompts],
            params_list,
            0,
            self.lora_request(getattr(request, "model", None)),
        )
        async for index, output in results:
            raise_if_failed(output)
            if output.finished:
                pooled = output.outputs[0].pooled
                assert pooled is not None, "every pooling request ends with its vector"
                vectors[index] = np.frombuffer(pooled, dtype=np.float32)
        assert all(v is not None for v in vectors)
        return request_id, [v for v in vectors if v is not None]
