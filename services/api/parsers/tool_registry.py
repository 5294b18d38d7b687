"""The --tool-call-parser names (vLLM's), each to its parser class (see tool_parsers.py for
what each format looks like)."""

from __future__ import annotations

from kvserve.services.api.parsers.tool_base import ToolParser
from kvserve.services.api.parsers.tool_parsers import (
    HermesToolParser,
    Llama3JsonToolParser,
    PythonicToolParser,
)
from kvserve.services.api.parsers.tools.deepseek import DeepSeekV3ToolParser, DeepSeekV31ToolParser
from kvserve.services.api.parsers.tools.glm45 import Glm45ToolParser
from kvserve.services.api.parsers.tools.kimi_k2 import KimiK2ToolParser
from kvserve.services.api.parsers.tools.llama4 import Llama4PythonicToolParser
from kvserve.services.api.parsers.tools.mistral import MistralToolParser
from kvserve.services.api.parsers.tools.qwen3_coder import Qwen3CoderToolParser

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesToolParser,
    "llama3_json": Llama3JsonToolParser,
    "pythonic": PythonicToolParser,
    "llama4_pythonic": Llama4PythonicToolParser,
    "mistral": MistralToolParser,
    "qwen3_coder": Qwen3CoderToolParser,
    "qwen3_xml": Qwen3CoderToolParser,
    "deepseek_v3": DeepSeekV3ToolParser,
    "deepseek_v31": DeepSeekV31ToolParser,
    "kimi_k2": KimiK2ToolParser,
    "glm45": Glm45ToolParser,
}
