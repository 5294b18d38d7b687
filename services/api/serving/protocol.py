"""The OpenAI shapes the serving core speaks, and how a request body decodes.

Every surface translates into these: Anthropic's Messages and OpenAI's Responses become a
ChatCompletionRequest, tool calls are OpenAI's (the parsers emit them), and every response
carries UsageInfo and, when asked, prompt logprobs. The OpenAI surface's own response bodies
are surfaces/openai_protocol.py's.

Requests decode strictly typed: a wrong type is a 400 that names the field. Unknown fields are
ignored with one warning line, as vLLM does; OpenAI fields kvserve knows but cannot honour
(`UNSUPPORTED_FIELDS`: audio output, predicted outputs, `suffix`, ...) are a 400 when set.
"""

from __future__ import annotations

import re
import time
from typing import Annotated, Any

import msgspec
import numpy as np
from msgspec import UNSET, UnsetType

from kvserve.services.api.serving.errors import APIError
from kvserve.services.api.serving.latency_targets import LatencyTargets
from kvserve.shared.logging import init_logger
from kvserve.shared.structured_outputs import StructuredOutputsParams

logger = init_logger(__name__)

# Every integer a request carries fits in 64 bits (what the engine's msgpack carries): a
# 400-digit seed is a 400 naming the field, never an encoding error.
Int64 = Annotated[int, msgspec.Meta(ge=-(2**63), le=2**63 - 1)]

# Sampling knobs that map one to one onto SamplingParams (None = SamplingParams' default).
SAMPLING_FIELDS = (
    "n",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "seed",
    "stop",
    "stop_token_ids",
    "ignore_eos",
    "min_tokens",
    "skip_special_tokens",
    "include_stop_str_in_output",
    "allowed_token_ids",
    "bad_words",
)


_VALIDATION_PATH = re.compile(r"at `\$\.(\w+)")


def decode_request(
    body: bytes, request_type: type[msgspec.Struct], max_depth: int | None = None
) -> Any:
    """Decode and type-check a JSON body; errors become 400s naming the bad field.

    Fields the request type does not know are ignored, with one warning line per request;
    a field of UNSUPPORTED_FIELDS that asks for something is a 400.

    Args:
        max_depth: a body nesting deeper is a 400 before it is decoded (--max-json-depth).
    """
    if max_depth is not None:
        check_json_depth(body, max_depth)
    try:
        request = msgspec.json.decode(body, type=request_type)
    except msgspec.ValidationError as exc:
        match = _VALIDATION_PATH.search(str(exc))
        raise APIError(
            400, f"invalid request: {exc}", param=match.group(1) if match else None
        ) from None
    except msgspec.DecodeError as exc:
        raise APIError(400, f"the request body is not valid JSON: {exc}") from None
    except RecursionError:
        raise APIError(400, "the request body nests too deeply") from None
    _warn_unknown_fields(body, request_type)
    _refuse_unsupported_fields(request)
    return request


_JSON_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"', re.DOTALL)
_NOT_BRACKETS = bytes(c for c in range(256) if c not in b"[]{}")


def json_depth(body: bytes) -> int:
    """How deeply arrays and objects nest in a JSON text (0 for a scalar), ignoring brackets
    inside strings; for malformed JSON an estimate (the decoder then refuses it)."""
    if body.count(b"[") + body.count(b"{") <= 1:
        return int(b"[" in body or b"{" in body)
    brackets = _JSON_STRING.sub(b"", body).translate(None, _NOT_BRACKETS)
    if not brackets:
        return 0
    codes = np.frombuffer(brackets, dtype=np.uint8)
    steps = np.where((codes == ord("[")) | (codes == ord("{")), np.int8(1), np.int8(-1))
    return int(np.cumsum(steps, dtype=np.int32).max())


def check_json_depth(body: bytes, max_depth: int) -> None:
    """A 400 when the body nests deeper than max_depth (--max-json-depth)."""
    if body.count(b"[") + body.count(b"{") <= max_depth:
        return  # most bodies: too few brackets to nest deeper, found without a scan
    depth = json_depth(body)
    if depth > max_depth:
        raise APIError(
            400,
            f"the JSON body's nesting depth is {depth}, more than the limit of {max_depth} "
            f"(--max-json-depth)",
        )


_RAW_FIELDS = msgspec.json.Decoder(dict[str, msgspec.Raw])


def _warn_unknown_fields(body: bytes, request_type: type[msgspec.Struct]) -> None:
    # Values stay undecoded (Raw): only the keys are read a second time.
    unknown = set(_RAW_FIELDS.decode(body)) - set(request_type.__struct_fields__)
    if unknown:
        logger.warning(
            "The following fields were present in the request but ignored: %s", sorted(unknown)
        )


# OpenAI (and old vLLM) request fields kvserve cannot honour: field -> (the values that ask
# for nothing, why). A request setting another value is a 400 naming the field.
UNSUPPORTED_FIELDS: dict[str, tuple[tuple[Any, ...], str]] = {
    "suffix": ((None, UNSET), "suffix (insertion) is not supported"),
    "audio": ((None, UNSET), "audio output is not supported"),
    "modalities": ((None, UNSET, ["text"]), "only the text modality is supported"),
    "prediction": ((None, UNSET), "predicted outputs are not supported"),
    "web_search_options": ((None, UNSET), "web search is not supported"),
    "functions": ((None, UNSET), "`functions` is deprecated: use `tools`"),
    "function_call": ((None, UNSET), "`function_call` is deprecated: use `tool_choice`"),
    "store": ((None, UNSET, False), "responses are not stored"),
    "metadata": (
        (None, UNSET, {}),
        "metadata is for stored responses, which kvserve keeps none of",
    ),
    "verbosity": ((None, UNSET), "verbosity is not supported"),
    "service_tier": ((None, UNSET, "auto", "default"), "there is one service tier"),
    "guided_json": ((None, UNSET), "vLLM removed guided_*: use structured_outputs.json"),
    "guided_regex": ((None, UNSET), "vLLM removed guided_*: use structured_outputs.regex"),
    "guided_choice": ((None, UNSET), "vLLM removed guided_*: use structured_outputs.choice"),
    "guided_grammar": ((None, UNSET), "vLLM removed guided_*: use structured_outputs.grammar"),
}


def _refuse_unsupported_fields(request: msgspec.Struct) -> None:
    """The chat and completions requests' UNSUPPORTED_FIELDS (others, such as the Responses
    request, declare and check their own)."""
    if not isinstance(request, _UnsupportedFields):
        return
    for name, (harmless, why) in UNSUPPORTED_FIELDS.items():
        value = getattr(request, name, UNSET)
        if value not in harmless:
            raise APIError(400, f"`{name}` is not supported by kvserve: {why}", param=name)
    best_of = getattr(request, "best_of", None)
    if best_of is not None and best_of != getattr(request, "n", 1):
        raise APIError(400, "best_of is not supported (vLLM V1 dropped it): use n", param="best_of")


class _UnsupportedFields(msgspec.Struct, kw_only=True):
    """Decoded only to be refused when set (UNSUPPORTED_FIELDS)."""

    audio: Any = UNSET
    modalities: Any = UNSET
    prediction: Any = UNSET
    web_search_options: Any = UNSET
    functions: Any = UNSET
    function_call: Any = UNSET
    store: Any = UNSET
    metadata: Any = UNSET
    verbosity: Any = UNSET
    service_tier: Any = UNSET
    guided_json: Any = UNSET
    guided_regex: Any = UNSET
    guided_choice: Any = UNSET
    guided_grammar: Any = UNSET


# --------------------------------------------------------------------------- requests


class StreamOptions(msgspec.Struct, kw_only=True):
    include_usage: bool = False


class JsonSchemaFormat(msgspec.Struct, kw_only=True):
    """response_format.json_schema: the schema and its name (OpenAI's shape)."""

    name: str | None = None
    description: str | None = None
    schema: dict[str, Any] | None = None
    strict: bool | None = None


class ResponseFormat(msgspec.Struct, kw_only=True):
    """OpenAI's response_format (text, json_object, json_schema) and vLLM's structural_tag
    (its `structures` and `triggers`, or xgrammar's `format`)."""

    type: str
    json_schema: JsonSchemaFormat | None = None
    structures: list[dict[str, Any]] | None = None
    triggers: list[str] | None = None
    format: dict[str, Any] | None = None


class SamplingRequest(_UnsupportedFields, kw_only=True):
    """Fields that completions and chat share (ChatCompletionRequest below, CompletionRequest in
    surfaces/openai_protocol.py)."""

    model: str | None = None
    n: Int64 = 1
    temperature: float | None = None
    top_p: float | None = None
    top_k: Int64 | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    seed: Int64 | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[Int64] | None = None
    ignore_eos: bool = False
    min_tokens: Int64 = 0
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    priority: Int64 = 0
    user: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    # kvserve's latency targets for this request (serving/latency_targets.py).
    slo: LatencyTargets | None = None
    # OpenAI's prompt caching (serving/prompt_cache.py): DP affinity, and "24h" pins.
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    # vLLM's extras: top logprobs per prompt token; logprobs naming tokens "token_id:N"
    # (None: the server's --return-tokens-as-token-ids); the request id when no
    # X-Request-Id header names one.
    prompt_logprobs: Int64 | None = None
    return_tokens_as_token_ids: bool | None = None
    request_id: str | None = None
    # Constraints: OpenAI's response_format and logit_bias (token id as a string -> bias),
    # vLLM's structured_outputs, allowed_token_ids and bad_words.
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsParams | None = None
    logit_bias: dict[str, float] | None = None
    allowed_token_ids: list[Int64] | None = None
    bad_words: list[str] | None = None
    # vLLM's beam search: n is the width (serving/beam_search.py).
    use_beam_search: bool = False
    length_penalty: float = 1.0
    early_stopping: bool = False

    def sampling_kwargs(self) -> dict[str, Any]:
        """The sampling knobs the client set, with SamplingParams' names."""
        return {
            name: value for name in SAMPLING_FIELDS if (value := getattr(self, name)) is not None
        }

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class ImageURL(msgspec.Struct, kw_only=True):
    url: str
    detail: str | None = None  # OpenAI's; the processor decides the resolution here


class ContentPart(msgspec.Struct, kw_only=True):
    type: str
    text: str | None = None
    image_url: ImageURL | None = None  # type "image_url" (services/api/serving/multimodal.py)


class FunctionCall(msgspec.Struct, kw_only=True):
    name: str
    arguments: str  # JSON text


class ToolCall(msgspec.Struct, kw_only=True):
    """One tool call, in an assistant message (request history or response)."""

    id: str
    type: str = "function"
    function: FunctionCall


class ChatMessage(msgspec.Struct, kw_only=True):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant message's calls
    tool_call_id: str | None = None  # a `tool` message answers this call
    # An assistant message's chain of thought (vLLM's names), sent back in a tool loop:
    # harmony keeps it across tool calls and drops it after a final answer.
    reasoning: str | None = None
    reasoning_content: str | None = None


class FunctionDefinition(msgspec.Struct, kw_only=True):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema; None: no parameters
    strict: bool | None = None


class ChatTool(msgspec.Struct, kw_only=True):
    type: str = "function"
    function: FunctionDefinition


class ToolChoiceFunction(msgspec.Struct, kw_only=True):
    name: str


class NamedToolChoice(msgspec.Struct, kw_only=True):
    """tool_choice naming the function the model must call."""

    type: str = "function"
    function: ToolChoiceFunction


class ChatCompletionRequest(SamplingRequest, kw_only=True):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage]
    max_tokens: Int64 | None = None
    max_completion_tokens: Int64 | None = None  # OpenAI's newer name; wins over max_tokens
    logprobs: bool = False
    top_logprobs: Int64 | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[ChatTool] | None = None
    # "none", "auto", "required" or a NamedToolChoice; None: "auto" with tools, else "none".
    tool_choice: str | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    reasoning_effort: str | None = None  # passed to the chat template, as vLLM does
    # With --reasoning-parser: at most this many thinking tokens, then the engine forces the
    # end of the thinking and the answer follows.
    thinking_token_budget: Int64 | None = None


# --------------------------------------------------------------------------- shared by responses


def now_seconds() -> int:
    return int(time.time())


class PromptTokenUsageInfo(msgspec.Struct):
    cached_tokens: int  # prompt tokens the prefix cache served


class UsageInfo(msgspec.Struct):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    # Only with --enable-prompt-tokens-details; left out otherwise (clients read null).
    prompt_tokens_details: PromptTokenUsageInfo | UnsetType = UNSET

    @classmethod
    def of(
        cls,
        num_prompt_tokens: int,
        num_completion_tokens: int,
        num_cached_tokens: int | None = None,
    ) -> UsageInfo:
        """Usage with prompt_tokens_details when num_cached_tokens is given."""
        details = UNSET if num_cached_tokens is None else PromptTokenUsageInfo(num_cached_tokens)
        return cls(
            num_prompt_tokens,
            num_completion_tokens,
            num_prompt_tokens + num_completion_tokens,
            details,
        )


class PromptLogprob(msgspec.Struct):
    """vLLM's Logprob as it serializes: one token's logprob at a prompt position."""

    logprob: float
    rank: int | None
    decoded_token: str | None


# Per prompt position: {token id: its logprob} (JSON keys are the ids as strings); the first
# position is null (nothing precedes it).
PromptLogprobsBody = list[dict[int, PromptLogprob] | None]


class DeltaFunctionCall(msgspec.Struct, omit_defaults=True):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(msgspec.Struct, omit_defaults=True):
    """A piece of a streamed tool call: the first carries id, type and name; later ones
    append to the arguments of the call at `index`."""

    index: int
    id: str | None = None
    type: str | None = None
    function: DeltaFunctionCall | None = None


class ModelCard(msgspec.Struct, kw_only=True):
    id: str
    object: str = "model"
    created: int = msgspec.field(default_factory=now_seconds)
    owned_by: str = "kvserve"
    root: str | None = None
    parent: str | None = None
    max_model_len: int | None = None
    # kvserve's: the parsers serving this model's chat (--tool-call-parser and
    # --reasoning-parser, `auto` resolved); null when none.
    tool_call_parser: str | None = None
    reasoning_parser: str | None = None


class ModelList(msgspec.Struct, kw_only=True):
    object: str = "list"
    data: list[ModelCard]
