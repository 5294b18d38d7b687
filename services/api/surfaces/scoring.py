"""Rerank, score and classify (with --runner pooling) over the pooling serving core.

A pair's score is the cross-encoder's when the model is a `*ForSequenceClassification` with
one label: the (query, document) pair tokenized as the tokenizer's pair encoding, one engine
request, its logit through a sigmoid (as sentence-transformers' CrossEncoder and vLLM do).
For an embedding model it is the cosine of the two texts' embeddings (each distinct text
embedded once). /classify runs the classifier on each text: label (id2label of the best
class) and softmax probabilities.
"""

from __future__ import annotations

import time
from typing import Any

import msgspec
import numpy as np
from starlette.requests import Request
from starlette.responses import Response

from kvserve.services.api.serving.errors import APIError
from kvserve.services.api.surfaces.pooling_serving import PoolingServing
from kvserve.services.api.surfaces.scoring_protocol import (
    ClassifyData,
    ClassifyRequest,
    ClassifyResponse,
    CohereApiVersion,
    CohereBilledUnits,
    CohereMeta,
    CohereRerankResponse,
    PoolingUsage,
    RerankDocument,
    RerankRequest,
    RerankResponse,
    RerankResult,
    RerankUsage,
    ScoreData,
    ScoreRequest,
    ScoreResponse,
)
from kvserve.shared.logging import init_logger

logger = init_logger(__name__)


def _json(body: msgspec.Struct) -> Response:
    return Response(msgspec.json.encode(body), media_type="application/json")


class ServingScores(PoolingServing):
    """The rerank, score and classify endpoints (see OpenAIServing for the arguments)."""

    async def score_pairs(
        self,
        raw_request: Request,
        request: Any,
        pairs: list[tuple[str, str]],
        max_length: int | None,
        param: str,
        prefix: str,
    ) -> tuple[str, list[float], int]:
        """(request id, each pair's score, prompt tokens) of (first, second) text pairs;
        `prefix` starts the request id."""
        if not self.spec.is_classifier:
            return await self._cosine_scores(raw_request, request, pairs, max_length, param, prefix)
        if self.spec.num_labels != 1:
            raise APIError(
                400,
                f"the model is a classifier of {self.spec.num_labels} labels: use "
                "/classify (scores need a cross-encoder of one label)",
            )
        encoded = [self.pair_tokens(a, b, max_length, param) for a, b in pairs]
        prompts = [ids for ids, _ in encoded]
        params = [self.params(start) for _, start in encoded]
        request_id, logits = await self.pool(raw_request, request, prefix, prompts, params)
        scores = [float(1.0 / (1.0 + np.exp(-float(row[0])))) for row in logits]
        return request_id, scores, sum(len(ids) for ids in prompts)

    async def _cosine_scores(
        self,
        raw_request: Request,
        request: Any,
        pairs: list[tuple[str, str]],
        max_length: int | None,
        param: str,
        prefix: str,
    ) -> tuple[str, list[float], int]:
        texts = list(dict.fromkeys(text for pair in pairs for text in pair))
        prompts = [self.text_tokens(text, max_length, param) for text in texts]
        params = [self.params()] * len(prompts)
        request_id, vectors = await self.pool(raw_request, request, prefix, prompts, params)
        unit = {t: v / max(float(np.linalg.norm(v)), 1e-12) for t, v in zip(texts, vectors)}
        scores = [float(np.dot(unit[a], unit[b])) for a, b in pairs]
        return request_id, scores, sum(len(ids) for ids in prompts)

    async def rerank(self, request: RerankRequest, raw_request: Request, cohere: bool) -> Response:
        """/rerank and /v1/rerank (Jina), /v2/rerank (Cohere v2, `cohere`)."""
        self.check_enabled("rerank")
        self.check_model(request.model)
        self.check_count(len(request.documents), "documents")
        texts = [d if isinstance(d, str) else d.text for d in request.documents]
        cut = request.truncate_prompt_tokens
        if cut is None:
            cut = request.max_tokens_per_doc
        max_length = self.truncation_length(cut, "documents")
        pairs = [(request.query, text) for text in texts]
        request_id, scores, num_tokens = await self.score_pairs(
            raw_request, request, pairs, max_length, "documents", "rerank-"
        )
        order = sorted(range(len(scores)), key=lambda i: -scores[i])
        if request.top_n is not None and request.top_n > 0:
            order = order[: request.top_n]
        results = [
            RerankResult(
                i, scores[i], RerankDocument(texts[i]) if request.return_documents else None
            )
            for i in order
        ]
        logger.info("rerank %s: %d documents, %d tokens", request_id, len(texts), num_tokens)
        if cohere:
            billed = CohereBilledUnits(search_units=1, input_tokens=num_tokens)
            return _json(
                CohereRerankResponse(request_id, results, CohereMeta(CohereApiVersion(), billed))
            )
        usage = RerankUsage(total_tokens=num_tokens, prompt_tokens=num_tokens)
        return _json(RerankResponse(request_id, self.response_model(request.model), usage, results))

    async def score(self, request: ScoreRequest, raw_request: Request) -> Response:
        """/score and /v1/score: 1:1, 1:N (text_1 one text) or N:N (equal lists)."""
        self.check_enabled("score")
        self.check_model(request.model)
        first = [request.text_1] if isinstance(request.text_1, str) else request.text_1
        second = [request.text_2] if isinstance(request.text_2, str) else request.text_2
        self.check_count(len(first), "text_1")
        self.check_count(len(second), "text_2")
        if len(first) == 1:
            first = first * len(second)
        if len(first) != len(second):
            raise APIError(
                400, "text_1 must hold one text or as many as text_2 (N:N pairs)", "text_1"
            )
        max_length = self.truncation_length(request.truncate_prompt_tokens, "text_2")
        request_id, scores, num_tokens = await self.score_pairs(
            raw_request, request, list(zip(first, second)), max_length, "text_2", "score-"
        )
        logger.info("score %s: %d pairs, %d tokens", request_id, len(scores), num_tokens)
        data = [ScoreData(i, s) for i, s in enumerate(scores)]
        return _json(
            ScoreResponse(
                request_id,
                int(time.time()),
                self.response_model(request.model),
                data,
                PoolingUsage(prompt_tokens=num_tokens, total_tokens=num_tokens),
            )
        )

    async def classify(self, request: ClassifyRequest, raw_request: Request) -> Response:
        """/classify and /v1/classify: each text's label and class probabilities."""
        self.check_enabled("classify")
        self.check_model(request.model)
        if not self.spec.is_classifier:
            raise APIError(400, "the model has no classification head: use /v1/embeddings")
        texts = [request.input] if isinstance(request.input, str) else request.input
        self.check_count(len(texts), "input")
        max_length = self.truncation_length(request.truncate_prompt_tokens, "input")
        prompts = [self.text_tokens(text, max_length, "input") for text in texts]
        params = [self.params()] * len(prompts)
        request_id, logits = await self.pool(raw_request, request, "classify-", prompts, params)
        data = []
        for index, row in enumerate(logits):
            if len(row) == 1:  # one label: its sigmoid, as vLLM's classify
                probs = 1.0 / (1.0 + np.exp(-row.astype(np.float64)))
            else:
                probs = np.exp(row - row.max())
                probs /= probs.sum()
            best = int(probs.argmax())
            label = self.spec.id2label.get(best, f"LABEL_{best}")
            data.append(ClassifyData(index, label, probs.tolist(), len(probs)))
        num_tokens = sum(len(ids) for ids in prompts)
        logger.info("classify %s: %d inputs, %d tokens", request_id, len(texts), num_tokens)
        usage = PoolingUsage(prompt_tokens=num_tokens, total_tokens=num_tokens)
        model = self.response_model(request.model)
        return _json(ClassifyResponse(request_id, int(time.time()), model, data, usage))
