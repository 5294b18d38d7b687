"""The OpenAI surface: completions, chat completions, responses, models, and vLLM's tokenize
pair.

POST /v1/completions, /v1/chat/completions   JSON, or SSE with "stream": true
POST /v1/responses                           JSON, or the Responses SSE events (stream: true)
GET  /v1/responses/{id}                      a stored response
POST /v1/embeddings                          with --runner pooling
GET  /v1/models
POST /tokenize, /detokenize                  vLLM's shapes
"""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from kvserve.services.api.app_context import AppContext, context_of, json_response, with_errors
from kvserve.services.api.observability.tracing import trace_span
from kvserve.services.api.serving.errors import APIError
from kvserve.services.api.serving.latency_targets import set_request_targets
from kvserve.services.api.serving.prompt_cache import set_openai_prompt_cache
from kvserve.services.api.serving.protocol import ChatCompletionRequest, ModelList, decode_request
from kvserve.services.api.serving.validation import check_prompt_chars
from kvserve.services.api.surfaces.embeddings import EmbeddingRequest
from kvserve.services.api.surfaces.openai_protocol import (
    CompletionRequest,
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeRequest,
    TokenizeResponse,
)
from kvserve.services.api.surfaces.responses_protocol import ResponsesRequest


async def create_completion(request: Request) -> Response:
    ctx = context_of(request)
    raw_body = await request.body()
    with trace_span("parse"):
        body = decode_request(raw_body, CompletionRequest, ctx.max_json_depth)
    set_request_targets(body.slo, request.headers)
    set_openai_prompt_cache(body.prompt_cache_key, body.prompt_cache_retention)
    return await ctx.completions.create_completion(body, request)


async def create_chat_completion(request: Request) -> Response:
    ctx = context_of(request)
    raw_body = await request.body()
    with trace_span("parse"):
        body = decode_request(raw_body, ChatCompletionRequest, ctx.max_json_depth)
    set_request_targets(body.slo, request.headers)
    set_openai_prompt_cache(body.prompt_cache_key, body.prompt_cache_retention)
    return await ctx.chat.create_chat_completion(body, request)


async def create_response(request: Request) -> Response:
    ctx = context_of(request)
    body = decode_request(await request.body(), ResponsesRequest, ctx.max_json_depth)
    set_request_targets(body.slo, request.headers)
    set_openai_prompt_cache(body.prompt_cache_key, body.prompt_cache_retention)
    return await ctx.responses.create(body, request)


async def create_embedding(request: Request) -> Response:
    ctx = context_of(request)
    body = decode_request(await request.body(), EmbeddingRequest, ctx.max_json_depth)
    return await ctx.embeddings.create_embedding(body, request)


async def retrieve_response(request: Request) -> Response:
    ctx = context_of(request)
    return json_response(ctx.responses.retrieve(request.path_params["response_id"]))


async def list_models(request: Request) -> Response:
    ctx = context_of(request)
    return json_response(ModelList(data=ctx.models.model_cards(ctx.engine_client.max_model_len)))


async def tokenize(request: Request) -> Response:
    ctx = context_of(request)
    body = decode_request(await request.body(), TokenizeRequest, ctx.max_json_depth)
    ctx.completions.check_model(body.model)
    if (body.prompt is None) == (body.messages is None):
        raise APIError(400, "give exactly one of `prompt` or `messages`", param="prompt")
    max_model_len = ctx.engine_client.max_model_len
    if body.messages is not None:
        token_ids = ctx.chat.apply_chat_template(body.messages, body.add_generation_prompt)
    else:
        check_prompt_chars(len(body.prompt), ctx.frontend.limits, max_model_len, "prompt")
        token_ids = ctx.engine_client.tokenizer_info.tokenizer.encode(
            body.prompt, add_special_tokens=body.add_special_tokens
        )
    return json_response(TokenizeResponse(len(token_ids), max_model_len, list(token_ids)))


async def detokenize(request: Request) -> Response:
    ctx = context_of(request)
    body = decode_request(await request.body(), DetokenizeRequest, ctx.max_json_depth)
    ctx.completions.check_model(body.model)
    if body.tokens:
        ctx.completions.check_prompt_tokens(body.tokens, "tokens")
    tokenizer = ctx.engine_client.tokenizer_info.tokenizer
    return json_response(DetokenizeResponse(tokenizer.decode(body.tokens)))


def routes(ctx: AppContext) -> list[Route]:
    return [
        Route("/v1/completions", with_errors(create_completion), methods=["POST"]),
        Route("/v1/chat/completions", with_errors(create_chat_completion), methods=["POST"]),
        Route("/v1/responses", with_errors(create_response), methods=["POST"]),
        Route("/v1/responses/{response_id}", with_errors(retrieve_response), methods=["GET"]),
        Route("/v1/embeddings", with_errors(create_embedding), methods=["POST"]),
        Route("/v1/models", with_errors(list_models), methods=["GET"]),
        Route("/tokenize", with_errors(tokenize), methods=["POST"]),
        Route("/detokenize", with_errors(detokenize), methods=["POST"]),
    ]
