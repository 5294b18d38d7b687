"""The api process's options: the HTTP server, what one request may ask for, the OpenAI
front end.

HTTPConfig, LimitsConfig (inside FrontendConfig) and FrontendConfig; `kvserve serve` and
`kvserve api` compose them into their options structs (shared/launch_options.py), and the
app takes them (services/api/server.py's build_app).
"""

from __future__ import annotations

import importlib.util
import json
import os
from typing import Annotated, Literal

import msgspec

from kvserve.shared.cli_args import flag_doc
from kvserve.shared.env import API_KEY, VLLM_API_KEY
from kvserve.shared.lora import LoRAModulePath
from kvserve.shared.parser_names import ReasoningParserName, ToolCallParserName


class HTTPConfig(msgspec.Struct, frozen=True, kw_only=True):
    """The HTTP server."""

    host: Annotated[str, flag_doc("interface to listen on")] = "0.0.0.0"
    port: Annotated[int, flag_doc("port to listen on")] = 8000
    api_key: Annotated[
        str | None,
        flag_doc(
            f"require this bearer token on /v1/* (default: ${API_KEY.name}, else "
            f"${VLLM_API_KEY.name})"
        ),
    ] = None
    api_key_file: Annotated[
        str | None,
        flag_doc(
            "a file of 'name:key' lines: each key is accepted on /v1/*, and its name shows in "
            "the request log and the kvserve:api_key_requests_total metric"
        ),
    ] = None
    shutdown_timeout: Annotated[
        float, flag_doc("seconds SIGTERM/SIGINT waits for in-flight requests")
    ] = 30.0
    uvicorn_log_level: Annotated[
        Literal["critical", "error", "warning", "info", "debug", "trace"],
        flag_doc("uvicorn's log level"),
    ] = "info"

    root_path: Annotated[
        str | None, flag_doc("the path prefix a proxy serves the app under (ASGI root_path)")
    ] = None
    ssl_keyfile: Annotated[str | None, flag_doc("TLS private key file (PEM); serve https")] = None
    ssl_certfile: Annotated[str | None, flag_doc("TLS certificate file (PEM)")] = None
    ssl_ca_certs: Annotated[
        str | None, flag_doc("CA certificates file for client certificates")
    ] = None
    ssl_cert_reqs: Annotated[
        int, flag_doc("client certificates: 0 none, 1 optional, 2 required (Python's ssl module)")
    ] = 0
    allowed_origins: Annotated[
        list[str], flag_doc("CORS: allowed origins, as JSON", parse="json")
    ] = msgspec.field(default_factory=lambda: ["*"])
    allow_credentials: Annotated[bool, flag_doc("CORS: allow credentials")] = False
    allowed_methods: Annotated[
        list[str], flag_doc("CORS: allowed methods, as JSON", parse="json")
    ] = msgspec.field(default_factory=lambda: ["*"])
    allowed_headers: Annotated[
        list[str], flag_doc("CORS: allowed headers, as JSON", parse="json")
    ] = msgspec.field(default_factory=lambda: ["*"])
    disable_uvicorn_access_log: Annotated[bool, flag_doc("no access log line per request")] = False

    def __post_init__(self) -> None:
        if (self.ssl_keyfile is None) != (self.ssl_certfile is None):
            raise ValueError("TLS needs both --ssl-keyfile and --ssl-certfile")

    @property
    def effective_api_key(self) -> str | None:
        """--api-key, else $KVSERVE_API_KEY, else $VLLM_API_KEY, else None."""
        if self.api_key is not None:
            return self.api_key
        return API_KEY.get() or VLLM_API_KEY.get()


class LimitsConfig(msgspec.Struct, frozen=True, kw_only=True):
    """What one request may ask for: past a limit the api answers 400 naming it, before
    anything is tokenized or queued (services/api/serving/limits.py)."""

    max_request_body_bytes: Annotated[
        int, flag_doc("bytes of a request body at most (413 past it, unparsed)", parse="size")
    ] = 16 << 20
    max_prompt_chars: Annotated[
        int | None,
        flag_doc("characters of a prompt or of all messages at most (default: 32 x max_model_len)"),
    ] = None
    max_n: Annotated[int, flag_doc("completions per prompt (`n`) at most")] = 128
    max_prompts: Annotated[int, flag_doc("prompts in one /v1/completions batch at most")] = 1024
    max_stop_strings: Annotated[int, flag_doc("stop strings of a request at most")] = 64
    max_stop_string_chars: Annotated[int, flag_doc("characters of one stop string at most")] = 512
    max_messages: Annotated[int, flag_doc("messages of a chat request at most")] = 2048
    max_tools: Annotated[int, flag_doc("tools of a chat request at most (OpenAI's limit)")] = 128
    max_token_id_list: Annotated[
        int,
        flag_doc("entries of stop_token_ids, allowed_token_ids, logit_bias and bad_words at most"),
    ] = 4096
    max_json_depth: Annotated[int, flag_doc("nesting of a JSON body at most")] = 64

    def __post_init__(self) -> None:
        for name in self.__struct_fields__:
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be positive, got {value}")


class TenantConfig(msgspec.Struct, frozen=True, kw_only=True):
    """Tenants: who a request is served for (services/api/tenancy/tenants.py). A tenant is the name
    of the API key a request used, or the `tenant_header` when one is trusted, else
    "default". Quotas given here apply to each tenant; a key file line's own columns
    (`name:key weight=2 max_concurrent=4 ...`) override them for that key's tenant."""

    tenant_header: Annotated[
        str | None,
        flag_doc(
            "a request header that names the tenant (e.g. X-Tenant), trusted as given: only "
            "for a trusted front end in front of the server (default: off, the key's name)"
        ),
    ] = None
    tenant_max_concurrent: Annotated[
        int | None, flag_doc("requests in flight per tenant at most (429 past it)")
    ] = None
    tenant_tokens_per_minute: Annotated[
        int | None,
        flag_doc("prompt + completion tokens per tenant in any 60 s at most (429 past it)"),
    ] = None
    tenant_requests_per_minute: Annotated[
        int | None, flag_doc("requests per tenant in any 60 s at most (429 past it)")
    ] = None
    usage_admin_keys: Annotated[
        list[str], flag_doc("names of the API keys that may read GET /v1/usage", parse="json")
    ] = msgspec.field(default_factory=lambda: ["admin"])

    def __post_init__(self) -> None:
        for name in ("tenant_max_concurrent", "tenant_tokens_per_minute"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be positive, got {value}")
        if self.tenant_requests_per_minute is not None and self.tenant_requests_per_minute < 1:
            raise ValueError(
                f"--tenant-requests-per-minute must be positive, got "
                f"{self.tenant_requests_per_minute}"
            )


class FrontendConfig(msgspec.Struct, frozen=True, kw_only=True):
    """The OpenAI front end: chat template, request defaults, API details, request logs."""

    chat_template: Annotated[
        str | None,
        flag_doc(
            "a Jinja chat template: a file, or the template itself (default: the tokenizer's)"
        ),
    ] = None
    generation_config: Annotated[
        str,
        flag_doc(
            "request defaults: auto = the model's generation_config.json (temperature, top_p, "
            "top_k, min_p, repetition_penalty, max_new_tokens), vllm = kvserve's own, or a "
            "folder holding a generation_config.json"
        ),
    ] = "auto"
    enable_prompt_tokens_details: Annotated[
        bool, flag_doc("report usage.prompt_tokens_details.cached_tokens (prefix-cache hits)")
    ] = False
    return_tokens_as_token_ids: Annotated[
        bool, flag_doc("logprobs name tokens as 'token_id:N' (for tokens that do not decode alone)")
    ] = False
    enable_request_id_headers: Annotated[
        bool, flag_doc("echo the request id in an X-Request-Id response header")
    ] = False
    enable_log_requests: Annotated[bool, flag_doc("log each request's parameters and prompt")] = (
        False
    )
    max_log_len: Annotated[
        int | None,
        flag_doc("characters (and token ids) of a prompt that --enable-log-requests logs"),
    ] = None
    disable_log_stats: Annotated[
        bool, flag_doc("no periodic throughput / KV-cache log line from the front end")
    ] = False
    slo_admission: Annotated[
        Literal["serve", "reject"],
        flag_doc(
            "a request whose TTFT target (its slo field, an x-slo-ttft-ms header or its "
            "tenant's slo_ttft_ms) is already out of reach: serve it anyway, or reject it "
            "at once with a 503 and Retry-After"
        ),
    ] = "serve"
    metrics_prefix: Annotated[
        Literal["kvserve", "vllm"],
        flag_doc(
            "names on /metrics: kvserve (kvserve:*), or vllm (vLLM 0.32's vllm:* names and "
            "labels for every series vLLM also has; kvserve's own series keep kvserve:)"
        ),
    ] = "kvserve"
    otlp_traces_endpoint: Annotated[
        str | None,
        flag_doc(
            "export one OpenTelemetry trace per request (api, engine and streaming spans; a "
            "client's W3C traceparent is its parent) to this OTLP endpoint: over HTTP/protobuf "
            "the full URL (http://collector:4318/v1/traces), or over gRPC with "
            "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL=grpc (needs kvserve[otel]; default: off)"
        ),
    ] = None
    enable_auto_tool_choice: Annotated[
        bool,
        flag_doc('tool_choice "auto": the model decides, --tool-call-parser reads its tool calls'),
    ] = False
    tool_call_parser: Annotated[
        Literal[ToolCallParserName, "auto"] | None,
        flag_doc(
            "how tool calls look in the model's text (vLLM's names): auto (the default: from "
            "the model's config and chat template, logged at start-up), hermes (JSON in "
            "<tool_call> tags), llama3_json (JSON objects), pythonic ([f(a=1), g()]), "
            "llama4_pythonic, mistral ([TOOL_CALLS]), qwen3_coder / qwen3_xml (XML), "
            "deepseek_v3, deepseek_v31, kimi_k2, glm45"
        ),
    ] = "auto"
    runner: Annotated[
        Literal["auto", "generate", "pooling"],
        flag_doc(
            "pooling: also serve /v1/embeddings, /rerank, /v1/score, /classify (the engine "
            "pools prompts' final hidden states, batched with generation); auto: pooling for "
            "an encoder model (BERT, XLM-R, ModernBERT), else generation only; generate: "
            "generation only"
        ),
    ] = "auto"
    allowed_local_media_path: Annotated[
        str | None,
        flag_doc(
            "a folder whose image files chat requests may name (file:// URLs or paths); "
            "unset: local files are refused"
        ),
    ] = None
    limit_mm_per_prompt: Annotated[
        str | None,
        flag_doc(
            "images one request may hold at most, as JSON: '{\"image\": 2}' (unset: no limit)"
        ),
    ] = None
    reasoning_parser: Annotated[
        Literal[ReasoningParserName, "auto"] | None,
        flag_doc(
            "split the model's thinking from its answer (reasoning_content): auto (the "
            "default: from the model's config and chat template, logged at start-up), "
            "deepseek_r1 or qwen3 (<think>...</think>), deepseek_v3, glm45, kimi_k2, mistral "
            "([THINK]); structured outputs then constrain the answer only"
        ),
    ] = "auto"
    exclude_tools_when_tool_choice_none: Annotated[
        bool, flag_doc('leave the tools out of the chat template when tool_choice is "none"')
    ] = False
    lora_modules: Annotated[
        list[LoRAModulePath],
        flag_doc(
            "LoRA adapters served at start-up (needs --enable-lora): name=path ..., or vLLM's "
            'JSON {"name": ..., "path": ..., "base_model_name": ...}',
            parse="items",
        ),
    ] = msgspec.field(default_factory=list)
    responses_store_size: Annotated[
        int,
        flag_doc(
            "responses /v1/responses keeps (store: true) for previous_response_id and GET "
            "/v1/responses/{id}, in memory, per api process; the oldest go first; 0 keeps none"
        ),
    ] = 1024
    responses_store_ttl: Annotated[
        float, flag_doc("seconds a stored /v1/responses response is kept")
    ] = 3600.0
    max_request_migrations: Annotated[
        int,
        flag_doc(
            "times a request moves to a live engine core after a death it may have caused (it "
            "had produced nothing on that engine yet); past it the request is quarantined and "
            "fails with an error naming why; 0: the requests of a dead engine core fail"
        ),
    ] = 2
    migration_wait_s: Annotated[
        float,
        flag_doc(
            "seconds a request whose engine core died waits for a live one (with one engine "
            "and --restart-dead-engines: for its restart) before it fails; a new request that "
            "arrives while no engine core lives (--restart-dead-engines) waits as long"
        ),
    ] = 60.0
    limits: LimitsConfig = msgspec.field(default_factory=LimitsConfig)
    tenants: TenantConfig = msgspec.field(default_factory=TenantConfig)

    def __post_init__(self) -> None:
        if self.max_request_migrations < 0:
            raise ValueError(
                f"--max-request-migrations must be >= 0, got {self.max_request_migrations}"
            )
        if self.migration_wait_s < 0:
            raise ValueError(f"--migration-wait-s must be >= 0, got {self.migration_wait_s}")
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("--enable-auto-tool-choice needs --tool-call-parser")
        parse_limit_mm_per_prompt(self.limit_mm_per_prompt)
        if self.otlp_traces_endpoint is not None:
            check_otlp_exporter(self.otlp_traces_endpoint)


def check_otlp_exporter(endpoint: str) -> None:
    """--otlp-traces-endpoint: refused at start-up, before any engine starts, when its
    exporter is not installed or OTEL_EXPORTER_OTLP_TRACES_PROTOCOL names another protocol
    (services/api/observability/tracing.py builds the exporter)."""
    protocol = os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or "http/protobuf"
    packages = {"http/protobuf": "http", "grpc": "grpc"}
    if protocol not in packages:
        raise ValueError(
            f"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL={protocol!r}: kvserve exports OTLP over "
            f"{tuple(packages)}"
        )
    schemes = ("http://", "https://") + (("grpc://",) if protocol == "grpc" else ())
    if not endpoint.startswith(schemes):
        raise ValueError(
            f"--otlp-traces-endpoint {endpoint!r}: over {protocol} it starts with one of {schemes}"
        )
    module = f"opentelemetry.exporter.otlp.proto.{packages[protocol]}.trace_exporter"
    try:
        found = importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:
        found = False
    if not found:
        needs = (
            "kvserve[otel]"
            if protocol == "http/protobuf"
            else "opentelemetry-exporter-otlp-proto-grpc"
        )
        raise ValueError(f"--otlp-traces-endpoint over {protocol} needs pip install {needs}")


def parse_limit_mm_per_prompt(value: str | None) -> dict[str, int]:
    """--limit-mm-per-prompt's JSON ('{"image": 2}'); {} when unset."""
    if not value:
        return {}
    try:
        limits = json.loads(value)
    except json.JSONDecodeError as exc:
        raise ValueError(
            f"--limit-mm-per-prompt must be JSON like '{{\"image\": 2}}': {exc}"
        ) from None
    if not isinstance(limits, dict) or not all(
        isinstance(k, str) and isinstance(v, int) and not isinstance(v, bool) and v >= 0
        for k, v in limits.items()
    ):
        raise ValueError("--limit-mm-per-prompt maps modality names to counts >= 0")
    unknown = sorted(set(limits) - {"image"})
    if unknown:
        raise ValueError(f"--limit-mm-per-prompt: unsupported modalities {unknown} (image only)")
    return limits
