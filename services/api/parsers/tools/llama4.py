"""Llama 4's pythonic tool calls (--tool-call-parser llama4_pythonic), as its chat template
and model card show them: a Python list of keyword calls, the whole reply, sometimes wrapped
in the <|python_start|> ... <|python_end|> tags:

    [get_weather(city="San Francisco", metric="celsius"), get_time()]
"""

from __future__ import annotations

from kvserve.services.api.parsers.tool_base import ExtractedToolCalls
from kvserve.services.api.parsers.tool_parsers import PythonicToolParser

_START, _END = "<|python_start|>", "<|python_end|>"


class Llama4PythonicToolParser(PythonicToolParser):
    @property
    def start_markers(self) -> tuple[str, ...]:
        return (_START, "[")

    def _extract(self, text: str) -> ExtractedToolCalls:
        body = text.strip()
        if not body.startswith(_START):
            return super()._extract(text)
        body = body.removeprefix(_START).strip().removesuffix(_END)
        extracted = super()._extract(body)
        if not extracted.calls:
            return ExtractedToolCalls(text)
        return extracted
