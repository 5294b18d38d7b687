"""AppContext: the serving core every route module's handlers share, on `app.state.ctx`.

    build_app ─make_context─▶ AppContext ─▶ app.state.ctx
                                  ▲
    routes_*.py handler(request) ─┘ context_of(request)

It also holds the helpers every handler uses: JSON and error responses, and `with_errors`,
which turns whatever a handler raises into OpenAI's error body (or another API's).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from kvserve.services.api.engine_client.client import (
    EngineClient,
    EngineDeadError,
    EngineOverloadedError,
)
from kvserve.services.api.observability.dashboard_sampler import DashboardSampler
from kvserve.services.api.observability.log_stats import LoggingStatLogger
from kvserve.services.api.observability.metrics import ApiMetrics
from kvserve.services.api.observability.ttft_estimate import TtftEstimator
from kvserve.services.api.serving.errors import APIError
from kvserve.services.api.serving.generation_config import load_generation_defaults
from kvserve.services.api.serving.models import ServingModels
from kvserve.services.api.serving.slo_admission import SloAdmission
from kvserve.services.api.surfaces.chat import OpenAIServingChat
from kvserve.services.api.surfaces.completions import OpenAIServingCompletion
from kvserve.services.api.surfaces.embeddings import OpenAIServingEmbedding
from kvserve.services.api.surfaces.messages import AnthropicServingMessages
from kvserve.services.api.surfaces.responses import OpenAIServingResponses, ResponseStore
from kvserve.services.api.surfaces.scoring import ServingScores
from kvserve.services.api.tenancy.quotas import TenantQuotas
from kvserve.services.api.tenancy.tenants import TenantDirectory
from kvserve.shared.api_config import FrontendConfig
from kvserve.shared.config import LoRAConfig
from kvserve.shared.logging import init_logger

logger = init_logger(__name__)

Endpoint = Callable[[Request], Awaitable[Response]]


@dataclass(slots=True)
class AppContext:
    """
    Args:
        engine_client: where requests go.
        served_model_name: the base model's name in the API.
        frontend: the front end's options.
        models: the base model and its LoRA adapters.
        metrics: the Prometheus series.
        completions: the completions handler (and the checks every surface shares).
        chat: the chat handler (and its template).
        messages: the Anthropic Messages handler (over chat).
        responses: the OpenAI Responses handler (over chat) and its response store.
        embeddings: the embeddings handler (--runner pooling).
        scores: the rerank, score and classify handler (--runner pooling).
        tenants: the keys and tenants (weights, quotas), reloaded on SIGHUP.
        quotas: what each tenant has in flight and used in the last minute (every
            handler's `quotas`).
        dashboard: the status page's readings of the series (observability/routes_dashboard.py).
    """

    engine_client: EngineClient
    served_model_name: str
    frontend: FrontendConfig
    models: ServingModels
    metrics: ApiMetrics
    completions: OpenAIServingCompletion
    chat: OpenAIServingChat
    messages: AnthropicServingMessages
    responses: OpenAIServingResponses
    embeddings: OpenAIServingEmbedding
    scores: ServingScores
    tenants: TenantDirectory
    quotas: TenantQuotas
    dashboard: DashboardSampler

    @property
    def max_json_depth(self) -> int:
        return self.frontend.limits.max_json_depth


def make_context(
    engine_client: EngineClient,
    served_model_name: str,
    frontend: FrontendConfig,
    lora_config: LoRAConfig | None,
    tenants: TenantDirectory,
) -> AppContext:
    """The serving core over one engine client (see build_app for the arguments)."""
    models = ServingModels(
        served_model_name, engine_client.model_name, lora_config, frontend.lora_modules
    )
    max_loras = models.lora_config.max_loras if models.enable_lora else None
    metrics = ApiMetrics(engine_client, served_model_name, max_loras, frontend.metrics_prefix)
    if not frontend.disable_log_stats:
        engine_client.stat_loggers.append(LoggingStatLogger())
    completions = OpenAIServingCompletion(engine_client, served_model_name, frontend, models)
    chat = OpenAIServingChat(engine_client, served_model_name, frontend, models)
    models.parser_names = (chat.frontend.tool_call_parser, chat.frontend.reasoning_parser)
    defaults = load_generation_defaults(
        frontend.generation_config, engine_client.tokenizer_info.model_dir
    )
    if defaults:
        logger.info("request defaults from the generation config: %s", defaults)
    completions.generation_defaults = chat.generation_defaults = defaults
    embeddings = OpenAIServingEmbedding(engine_client, served_model_name, frontend, models)
    # One object for all: a tenant's quotas count its requests on every surface.
    quotas = TenantQuotas(on_refused=metrics.tenants.quota_refused)
    scores = ServingScores(engine_client, served_model_name, frontend, models)
    completions.quotas = chat.quotas = embeddings.quotas = scores.quotas = quotas
    if frontend.slo_admission == "reject":
        estimator = TtftEstimator()
        engine_client.stat_loggers.append(estimator)
        completions.admission = chat.admission = SloAdmission(estimator)
    # After ApiMetrics among the stat loggers: a step's reading sees the step counted.
    dashboard = DashboardSampler(engine_client, metrics)
    engine_client.stat_loggers.append(dashboard)
    engine_client.standing_ttft_ms = tenants.tightest_ttft_ms
    return AppContext(
        engine_client,
        served_model_name,
        frontend,
        models,
        metrics,
        completions,
        chat,
        AnthropicServingMessages(chat),
        OpenAIServingResponses(
            chat, ResponseStore(frontend.responses_store_size, frontend.responses_store_ttl)
        ),
        embeddings,
        scores,
        tenants,
        quotas,
        dashboard,
    )


def context_of(request: Request) -> AppContext:
    return request.app.state.ctx


# --------------------------------------------------------------------------- responses


def json_response(body: msgspec.Struct, status_code: int = 200) -> Response:
    return Response(
        msgspec.json.encode(body), status_code=status_code, media_type="application/json"
    )


def error_response(exc: APIError) -> Response:
    response = json_response(exc.to_body(), exc.status_code)
    response.headers.update(exc.headers or {})
    return response


def with_errors(
    endpoint: Endpoint, render: Callable[[APIError], Response] = error_response
) -> Endpoint:
    """Turn whatever an endpoint raises into an error body (OpenAI's, or what `render` makes
    of the APIError: Anthropic's for /v1/messages); the server stays up."""

    async def wrapped(request: Request) -> Response:
        try:
            return await endpoint(request)
        except APIError as exc:
            return render(exc)
        except EngineOverloadedError as exc:
            return render(exc.to_api_error())
        except EngineDeadError as exc:
            return render(APIError(503, f"the engine is dead: {exc}"))
        except Exception as exc:  # noqa: BLE001 - a bug must cost one request, not the server
            logger.exception("%s %s failed", request.method, request.url.path)
            return render(APIError(500, f"internal error: {type(exc).__name__}: {exc}"))

    return wrapped
