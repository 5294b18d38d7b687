"""The --reasoning-parser names (vLLM's), each to its parser (reasoning_parsers.py says what
each family writes). openai_gptoss is not here: harmony splits gpt-oss's channels by token
id (services/api/harmony/)."""

from __future__ import annotations

from kvserve.services.api.parsers.reasoning.deepseek_v3 import DeepSeekV3ReasoningParser
from kvserve.services.api.parsers.reasoning.glm45 import Glm45ReasoningParser
from kvserve.services.api.parsers.reasoning.kimi_k2 import KimiK2ReasoningParser
from kvserve.services.api.parsers.reasoning.mistral import MistralReasoningParser
from kvserve.services.api.parsers.reasoning_parsers import (
    DeepSeekR1ReasoningParser,
    Qwen3ReasoningParser,
    ReasoningParser,
)

REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    "deepseek_r1": DeepSeekR1ReasoningParser,
    "qwen3": Qwen3ReasoningParser,
    "deepseek_v3": DeepSeekV3ReasoningParser,
    "glm45": Glm45ReasoningParser,
    "kimi_k2": KimiK2ReasoningParser,
    "mistral": MistralReasoningParser,
}


def get_reasoning_parser(name: str | None) -> ReasoningParser | None:
    if name is None:
        return None
    if name not in REASONING_PARSERS:
        raise ValueError(
            f"unknown reasoning parser {name!r}; known: {', '.join(sorted(REASONING_PARSERS))}"
        )
    return REASONING_PARSERS[name]()
