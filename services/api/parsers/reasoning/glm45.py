"""GLM-4.5/4.6's thinking (--reasoning-parser glm45): the model opens <think> itself after
<|assistant|>, so a reply thinks only when it starts with the tag; enable_thinking false
makes the template close an empty block in the prompt (the reply is then all answer).

    <think>The user wants the weather.</think>
    I'll check.<tool_call>get_weather ...
"""

from __future__ import annotations

from typing import Any

from kvserve.services.api.parsers.reasoning_parsers import ReasoningParser


class Glm45ReasoningParser(ReasoningParser):
    requires_start = True

    def starts_thinking(self, chat_template_kwargs: dict[str, Any]) -> bool:
        return chat_template_kwargs.get("enable_thinking") is not False
