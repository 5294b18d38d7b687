"""vLLM's runtime LoRA adapter routes, with --enable-lora (services/api/serving/models.py).

POST /v1/load_lora_adapter, /v1/unload_lora_adapter   serve a PEFT folder as a model,
                                                      or stop; success is vLLM's text
"""

from __future__ import annotations

import msgspec
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response
from starlette.routing import Route

from kvserve.services.api.app_context import AppContext, context_of, with_errors
from kvserve.services.api.serving.protocol import decode_request


class LoadLoRAAdapterRequest(msgspec.Struct, kw_only=True):
    """POST /v1/load_lora_adapter's body (vLLM's)."""

    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(msgspec.Struct, kw_only=True):
    """POST /v1/unload_lora_adapter's body (vLLM's; lora_int_id is accepted and unused)."""

    lora_name: str
    lora_int_id: int | None = None


async def load_lora_adapter(request: Request) -> Response:
    ctx = context_of(request)
    body = decode_request(await request.body(), LoadLoRAAdapterRequest, ctx.max_json_depth)
    ctx.models.load_lora_adapter(body.lora_name, body.lora_path)
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")


async def unload_lora_adapter(request: Request) -> Response:
    ctx = context_of(request)
    body = decode_request(await request.body(), UnloadLoRAAdapterRequest, ctx.max_json_depth)
    ctx.models.unload_lora_adapter(body.lora_name)
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")


def routes(ctx: AppContext) -> list[Route]:
    """None unless the engines serve adapters."""
    if not ctx.models.enable_lora:
        return []
    return [
        Route("/v1/load_lora_adapter", with_errors(load_lora_adapter), methods=["POST"]),
        Route("/v1/unload_lora_adapter", with_errors(unload_lora_adapter), methods=["POST"]),
    ]
