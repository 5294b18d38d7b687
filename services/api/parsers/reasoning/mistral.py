"""Magistral's thinking (--reasoning-parser mistral): [THINK]...[/THINK] (special tokens of
tokenizer v13, kept in the text for this parser) when the reply opens with [THINK]; a reply
without it is all answer, as vLLM's mistral parser starts in content.

    [THINK]The user asks for 2+2.[/THINK]4
"""

from __future__ import annotations

from kvserve.services.api.parsers.reasoning_parsers import ReasoningParser


class MistralReasoningParser(ReasoningParser):
    start = "[THINK]"
    end = "[/THINK]"
    requires_start = True
    needs_special_tokens = True
