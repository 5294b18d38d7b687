"""Kimi K2 (Thinking)'s reasoning (--reasoning-parser kimi_k2): <think>...</think>, on unless
the request says thinking (or enable_thinking) false; a tool-call section that begins before
</think> ends the thinking too, as vLLM's kimi_k2 parser reads it.

    <think>Need the weather.</think>Let me check.<|tool_calls_section_begin|>...
"""

from __future__ import annotations

from typing import Any

from kvserve.services.api.parsers.reasoning_parsers import ReasoningParser


class KimiK2ReasoningParser(ReasoningParser):
    implicit_ends = ("<|tool_calls_section_begin|>",)
    needs_special_tokens = True

    def starts_thinking(self, chat_template_kwargs: dict[str, Any]) -> bool:
        thinking = chat_template_kwargs.get("thinking")
        enable = chat_template_kwargs.get("enable_thinking")
        if thinking is None and enable is None:
            return True
        return bool(thinking) or bool(enable)
