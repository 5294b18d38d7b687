"""Kimi K2's tool calls (--tool-call-parser kimi_k2), as its chat template writes them:

    <|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0
    <|tool_call_argument_begin|>{"city": "Beijing"}<|tool_call_end|><|tool_calls_section_end|>
    (one line, cut here to fit the page)

The call's id (functions.NAME:INDEX) names the function. The markers are special tokens,
kept in the text for this parser.
"""

from __future__ import annotations

import re

from kvserve.services.api.parsers.tool_base import MarkedCallsParser


class KimiK2ToolParser(MarkedCallsParser):
    marker = "<|tool_calls_section_begin|>"
    call_begin = "<|tool_call_begin|>"
    needs_special_tokens = True
    call_pattern = re.compile(
        r"<\|tool_call_begin\|>\s*(?P<name>[^<]*?)\s*<\|tool_call_argument_begin\|>"
        r"(?P<arguments>.*?)<\|tool_call_end\|>",
        re.DOTALL,
    )

    def call_from(self, name: str, arguments: str) -> tuple[str, str]:
        # "functions.get_weather:0": the namespace and the call's index are not the name.
        function = name.rpartition(":")[0] if ":" in name else name
        return super().call_from(function.removeprefix("functions."), arguments)
