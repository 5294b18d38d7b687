"""GET /openapi.json: the routes and their bodies as OpenAPI 3.1, generated from the msgspec
structs the routes decode and answer (msgspec.json.schema_components), so the description is
the decoder.

Used by clients and by the fuzz tests (schemathesis, tests/e2e/test_api_fuzz.py and
bench/fuzz_api.py), which send what the schemas allow and what they do not.
"""

from __future__ import annotations

from typing import Any

import msgspec

from kvserve.services.api.serving.errors import ErrorResponse
from kvserve.services.api.serving.protocol import ChatCompletionRequest, ModelList
from kvserve.services.api.surfaces.anthropic_protocol import (
    CountTokensRequest,
    CountTokensResponse,
    ErrorBody,
    MessageResponse,
    MessagesRequest,
)
from kvserve.services.api.surfaces.embeddings import EmbeddingRequest, EmbeddingResponse
from kvserve.services.api.surfaces.openai_protocol import (
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeRequest,
    TokenizeResponse,
)
from kvserve.services.api.surfaces.responses_protocol import ResponseObject, ResponsesRequest
from kvserve.services.api.surfaces.scoring_protocol import SCORING_STRUCTS
from kvserve.services.api.tenancy.usage import UsageReport

_REF = "#/components/schemas/{name}"
# The errors any POST route may answer, besides its own 200.
_ERRORS = {
    "400": "invalid request (the message names the field or the limit)",
    "401": "missing or unknown API key (/v1/* only, when keys are set)",
    "404": "unknown model",
    "413": "request body over --max-request-body-bytes",
    "429": "every engine queue is full (--max-waiting-requests); see Retry-After",
    "503": "no engine core serves",
}


def _json(ref: str) -> dict[str, Any]:
    return {"application/json": {"schema": {"$ref": _REF.format(name=ref)}}}


def _post(
    summary: str,
    request: str,
    response: str,
    stream: bool = False,
    error: str = "ErrorResponse",
    events: str = "server-sent events ending data: [DONE]",
) -> dict[str, Any]:
    ok: dict[str, Any] = {"description": "the result", "content": _json(response)}
    if stream:
        ok["content"]["text/event-stream"] = {"schema": {"type": "string"}}
        ok["description"] += f' (with "stream": true, {events})'
    errors = {code: {"description": why, "content": _json(error)} for code, why in _ERRORS.items()}
    responses = {"200": ok} | errors
    return {
        "post": {
            "summary": summary,
            "requestBody": {"required": True, "content": _json(request)},
            "responses": responses,
        }
    }


def _get(summary: str, media_type: str = "application/json", ref: str | None = None):
    schema = {"$ref": _REF.format(name=ref)} if ref else {"type": "object"}
    if media_type != "application/json":
        schema = {"type": "string"}
    ok = {"description": "the result", "content": {media_type: {"schema": schema}}}
    return {"get": {"summary": summary, "responses": {"200": ok}}}


def _get_stored_response() -> dict[str, Any]:
    route = _get("a stored response (store: true)", ref="ResponseObject")
    route["get"]["parameters"] = [
        {"name": "response_id", "in": "path", "required": True, "schema": {"type": "string"}}
    ]
    route["get"]["responses"]["404"] = {
        "description": "no such response stored (never, or dropped: size and TTL flags)",
        "content": _json("ErrorResponse"),
    }
    return route


def _get_usage() -> dict[str, Any]:
    route = _get("each tenant's requests and tokens, in whole minutes", ref="UsageReport")
    seconds = {"type": "number", "minimum": 0, "maximum": 1e12}
    route["get"]["parameters"] = [
        {"name": bound, "in": "query", "required": False, "schema": seconds, "description": why}
        for bound, why in (
            ("start", "unix seconds (default: the oldest bucket kept)"),
            ("end", "unix seconds, not included (default: now)"),
        )
    ]
    errors = {
        "400": "start or end not unix seconds, or start after end",
        "401": _ERRORS["401"],
        "403": "the API key is not one of --usage-admin-keys",
    }
    for code, why in errors.items():
        route["get"]["responses"][code] = {"description": why, "content": _json("ErrorResponse")}
    return route


# Every body the routes take or answer, each a component of the document.
_BODY_TYPES = (
    CompletionRequest,
    ChatCompletionRequest,
    TokenizeRequest,
    DetokenizeRequest,
    CompletionResponse,
    ChatCompletionResponse,
    ModelList,
    TokenizeResponse,
    DetokenizeResponse,
    ErrorResponse,
    MessagesRequest,
    MessageResponse,
    CountTokensRequest,
    CountTokensResponse,
    ErrorBody,
    ResponsesRequest,
    ResponseObject,
    EmbeddingRequest,
    EmbeddingResponse,
    UsageReport,
    *SCORING_STRUCTS,
)


def openapi_document(version: str) -> dict[str, Any]:
    """The OpenAPI 3.1 document of the app's routes (server.build_app)."""
    _, components = msgspec.json.schema_components(_BODY_TYPES, ref_template=_REF)
    return {
        "openapi": "3.1.0",
        "info": {"title": "kvserve", "version": version},
        "paths": _paths(),
        "components": {
            "schemas": components,
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
        },
    }


def _paths() -> dict[str, Any]:
    """Each route's path -> its methods, bodies and answers."""
    health = _get("200 while an engine core serves, else 503; lists every engine's state")
    health["get"]["responses"]["503"] = {"description": "no engine core serves"}
    return {
        "/v1/completions": _post(
            "OpenAI completions", "CompletionRequest", "CompletionResponse", stream=True
        ),
        "/v1/chat/completions": _post(
            "OpenAI chat completions", "ChatCompletionRequest", "ChatCompletionResponse", True
        ),
        "/v1/responses": _post(
            "OpenAI's Responses API",
            "ResponsesRequest",
            "ResponseObject",
            stream=True,
            events="the Responses events, response.created to response.completed",
        ),
        "/v1/responses/{response_id}": _get_stored_response(),
        "/v1/embeddings": _post(
            "OpenAI embeddings (--runner pooling)", "EmbeddingRequest", "EmbeddingResponse"
        ),
        **_scoring_paths(),
        "/v1/messages": _post(
            "Anthropic's Messages API",
            "MessagesRequest",
            "MessageResponse",
            stream=True,
            error="ErrorBody",
            events="Anthropic's events, message_start to message_stop",
        ),
        "/v1/messages/count_tokens": _post(
            "Anthropic's token count",
            "CountTokensRequest",
            "CountTokensResponse",
            error="ErrorBody",
        ),
        "/v1/models": _get("the served model", ref="ModelList"),
        "/v1/usage": _get_usage(),
        "/tokenize": _post("vLLM's tokenize", "TokenizeRequest", "TokenizeResponse"),
        "/detokenize": _post("vLLM's detokenize", "DetokenizeRequest", "DetokenizeResponse"),
        "/health": health,
        "/version": _get("kvserve's version"),
        "/metrics": _get("Prometheus metrics", "text/plain"),
    }


def _scoring_paths() -> dict[str, Any]:
    """The rerank, score and classify routes (--runner pooling; surfaces/routes_scoring.py)."""
    jina = _post("rerank, Jina's shape (--runner pooling)", "RerankRequest", "RerankResponse")
    cohere = _post("rerank, Cohere v2's shape", "RerankRequest", "CohereRerankResponse")
    score = _post("text_1 against text_2 (--runner pooling)", "ScoreRequest", "ScoreResponse")
    classify = _post("labels and probabilities", "ClassifyRequest", "ClassifyResponse")
    return {
        "/rerank": jina,
        "/v1/rerank": jina,
        "/v2/rerank": cohere,
        "/score": score,
        "/v1/score": score,
        "/classify": classify,
        "/v1/classify": classify,
    }
