"""DeepSeek V3.1/V3.2's thinking (--reasoning-parser deepseek_v3): R1's tags, but only when
the request turns thinking on (chat_template_kwargs {"thinking": true}, or
{"enable_thinking": true}); the template then ends the prompt with <think>, and otherwise
with </think>, so the reply is all answer (vLLM's deepseek_v3 parser decides the same way).

    <｜Assistant｜><think>   (prompt)   The user asks ...</think>It is 4.   (reply)
"""

from __future__ import annotations

from typing import Any

from kvserve.services.api.parsers.reasoning_parsers import ReasoningParser


class DeepSeekV3ReasoningParser(ReasoningParser):
    def starts_thinking(self, chat_template_kwargs: dict[str, Any]) -> bool:
        return bool(
            chat_template_kwargs.get("thinking") or chat_template_kwargs.get("enable_thinking")
        )
