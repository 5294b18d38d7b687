"""The --tool-call-parser and --reasoning-parser names (vLLM's), shared by the flags, the
structured-outputs config and the api's registries (services/api/parsers/)."""

from __future__ import annotations

from typing import Literal

# The --tool-call-parser names (services/api/parsers/tool_registry.py registers each).
TOOL_CALL_PARSER_NAMES = (
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
)
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

# The --reasoning-parser names (services/api/parsers/reasoning_parsers.py registers each).
REASONING_PARSER_NAMES = (
    "deepseek_r1",
    "qwen3",
    "deepseek_v3",
    "glm45",
    "kimi_k2",
    "mistral",
    "openai_gptoss",
)
ReasoningParserName = Literal["deepseek_r1", "qwen3", "deepseek_v3", "glm45", "kimi_k2", "mistral"]

# gpt-oss's harmony: not text parsers behind the registries but the api's harmony package.
HARMONY_TOOL_PARSER = "openai"
HARMONY_REASONING_PARSER = "openai_gptoss"
