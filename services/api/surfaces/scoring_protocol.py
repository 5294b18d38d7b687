"""The request and response shapes of /rerank (Jina: /rerank, /v1/rerank), /v2/rerank
(Cohere v2), /v1/score and /classify, as vLLM serves them."""

from __future__ import annotations

from typing import Any

import msgspec

from kvserve.services.api.serving.protocol import Int64


class RerankDocument(msgspec.Struct):
    text: str


class RerankRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """POST /rerank, /v1/rerank (Jina's shape) and /v2/rerank (Cohere v2's).

    documents are strings, or Jina's {"text": ...} objects; top_n (0 or None: all) keeps the
    best; return_documents echoes each document's text (Jina: default true; Cohere v2 sends
    false). max_tokens_per_doc is Cohere's cut of each document (as truncation).
    """

    query: str
    documents: list[str | RerankDocument]
    model: str | None = None
    top_n: Int64 | None = None
    return_documents: bool = True
    max_tokens_per_doc: Int64 | None = None
    truncate_prompt_tokens: Int64 | None = None
    request_id: str | None = None
    user: str | None = None


class RerankResult(msgspec.Struct, omit_defaults=True):
    index: int
    relevance_score: float
    document: RerankDocument | None = None


class RerankUsage(msgspec.Struct):
    total_tokens: int
    prompt_tokens: int


class RerankResponse(msgspec.Struct):
    """Jina's (and vLLM's /v1/rerank) response."""

    id: str
    model: str
    usage: RerankUsage
    results: list[RerankResult]


class CohereApiVersion(msgspec.Struct):
    version: str = "2"


class CohereBilledUnits(msgspec.Struct):
    search_units: int
    input_tokens: int


class CohereMeta(msgspec.Struct):
    api_version: CohereApiVersion
    billed_units: CohereBilledUnits


class CohereRerankResponse(msgspec.Struct):
    """Cohere's v2 rerank response."""

    id: str
    results: list[RerankResult]
    meta: CohereMeta


class ScoreRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """POST /score, /v1/score: text_1 against text_2, 1:1, 1:N or N:N (pairwise)."""

    text_1: str | list[str]
    text_2: str | list[str]
    model: str | None = None
    truncate_prompt_tokens: Int64 | None = None
    request_id: str | None = None
    user: str | None = None


class ScoreData(msgspec.Struct, tag="score", tag_field="object"):
    index: int
    score: float


class PoolingUsage(msgspec.Struct):
    prompt_tokens: int
    total_tokens: int
    completion_tokens: int = 0


class ScoreResponse(msgspec.Struct, tag="list", tag_field="object"):
    id: str
    created: int
    model: str
    data: list[ScoreData]
    usage: PoolingUsage


class ClassifyRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """POST /classify, /v1/classify: one text or a list of them."""

    input: str | list[str]
    model: str | None = None
    truncate_prompt_tokens: Int64 | None = None
    request_id: str | None = None
    user: str | None = None


class ClassifyData(msgspec.Struct, tag="classification", tag_field="object"):
    index: int
    label: str
    probs: list[float]
    num_classes: int


class ClassifyResponse(msgspec.Struct, tag="list", tag_field="object"):
    id: str
    created: int
    model: str
    data: list[ClassifyData]
    usage: PoolingUsage


SCORING_STRUCTS: tuple[Any, ...] = (
    RerankRequest,
    RerankResponse,
    CohereRerankResponse,
    ScoreRequest,
    ScoreResponse,
    ClassifyRequest,
    ClassifyResponse,
)
