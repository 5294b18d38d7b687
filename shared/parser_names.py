"""The --tool-call-parser and --reasoning-parser names (vLLM's), shared by the flags, the
structured-outputs config and the api's registries (services/api/parsers/)."""

from __future__ import annotations

from typing import Literal, get_args

# gpt-oss's harmony: not text parsers behind the registries but the api's harmony package.
HARMONY_TOOL_PARSER = "openai"
HARMONY_REASONING_PARSER = "openai_gptoss"

# The --tool-call-parser names (services/api/parsers/tool_registry.py registers each).
ToolCallParserName = Literal[
    "hermes",
    "llama3_json",
    "pythonic",
    "llama4_pythonic",
    "mistral",
    "qwen3_coder",
    "qwen3_xml",
    "deepseek_v3",
    "deepseek_v31",
    "kimi_k2",
    "glm45",
    "openai",
]
TOOL_CALL_PARSER_NAMES: tuple[str, ...] = get_args(ToolCallParserName)

# The --reasoning-parser names (services/api/parsers/reasoning_parsers.py registers each),
# and harmony's, which is no text parser behind the registry.
ReasoningParserName = Literal["deepseek_r1", "qwen3", "deepseek_v3", "glm45", "kimi_k2", "mistral"]
REASONING_PARSER_NAMES: tuple[str, ...] = (
    *get_args(ReasoningParserName),
    HARMONY_REASONING_PARSER,
)
