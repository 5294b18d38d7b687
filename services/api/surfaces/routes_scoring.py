"""The rerank, score and classify surface (with --runner pooling), as vLLM serves it.

POST /rerank, /v1/rerank     Jina's shape: query, documents, top_n, return_documents
POST /v2/rerank              Cohere v2's shape (the `cohere` SDK's ClientV2.rerank)
POST /score, /v1/score       text_1 against text_2 (1:1, 1:N, N:N)
POST /classify, /v1/classify a classifier's label and probabilities per input
"""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from kvserve.services.api.app_context import AppContext, context_of, with_errors
from kvserve.services.api.serving.protocol import decode_request
from kvserve.services.api.surfaces.scoring_protocol import (
    ClassifyRequest,
    RerankRequest,
    ScoreRequest,
)


async def rerank(request: Request) -> Response:
    ctx = context_of(request)
    body = decode_request(await request.body(), RerankRequest, ctx.max_json_depth)
    return await ctx.scores.rerank(body, request, cohere=False)


async def rerank_v2(request: Request) -> Response:
    ctx = context_of(request)
    body = decode_request(await request.body(), RerankRequest, ctx.max_json_depth)
    return await ctx.scores.rerank(body, request, cohere=True)


async def score(request: Request) -> Response:
    ctx = context_of(request)
    body = decode_request(await request.body(), ScoreRequest, ctx.max_json_depth)
    return await ctx.scores.score(body, request)


async def classify(request: Request) -> Response:
    ctx = context_of(request)
    body = decode_request(await request.body(), ClassifyRequest, ctx.max_json_depth)
    return await ctx.scores.classify(body, request)


def routes(ctx: AppContext) -> list[Route]:
    return [
        Route("/rerank", with_errors(rerank), methods=["POST"]),
        Route("/v1/rerank", with_errors(rerank), methods=["POST"]),
        Route("/v2/rerank", with_errors(rerank_v2), methods=["POST"]),
        Route("/score", with_errors(score), methods=["POST"]),
        Route("/v1/score", with_errors(score), methods=["POST"]),
        Route("/classify", with_errors(classify), methods=["POST"]),
        Route("/v1/classify", with_errors(classify), methods=["POST"]),
    ]
